"""Images from requests (docs/multimodal.md, "Image inputs"): hostile and broken images are each a 400 with
a message that says what is wrong, through the real server on the tiny Gemma 3 of conftest.py (and through
the loader for what needs another configuration); a good image answers with the same tokens as
`LLM.generate` with `multi_modal_data`, from the OpenAI chat endpoint (raw and through the openai SDK),
Anthropic's Messages (through the anthropic SDK) and the Responses API, `LLM.chat` and `ember chat`.
"""

from __future__ import annotations

import base64
import dataclasses
import http.server
import io
import re
import resource
import struct
import threading
import time
import zlib

import anthropic
import numpy as np
import pytest
from api_fixtures import assert_no_request_left
from conftest import DEVICE
from PIL import Image
from test_server import ServerThread, tiny_engine
from vision_fixtures import TOKENS_PER_IMAGE

from ember import LLM, AsyncLLM, EngineArgs, SamplingParams
from ember.multimodal.media import MediaConnector, decode_image

CHAT = "/v1/chat/completions"
MAX_TOKENS = 5


def encode(image: Image.Image, fmt: str, **kwargs) -> bytes:
    out = io.BytesIO()
    image.save(out, fmt, **kwargs)
    return out.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def png_header(width: int, height: int) -> bytes:
    """A PNG that declares `width` x `height` RGB pixels and holds almost no data: a decompression bomb's
    shape (its few hundred bytes would decode to width x height x 3)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    idat = zlib.compress(b"\0" * 1000)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


RGB = Image.fromarray(np.random.default_rng(0).integers(0, 256, (33, 41, 3), dtype=np.uint8))
PNG, JPEG = encode(RGB, "PNG"), encode(RGB, "JPEG")
BIG = 21 * 1024 * 1024  # past the 20 MiB limit


class _Media(http.server.BaseHTTPRequestHandler):
    """A local image host: /ok.png, /missing (404), /slow (answers after 3 s), /drip (a byte every 0.2 s),
    /big (declares 21 MiB), /endless (21 MiB, no length), /redirect (to localhost, another host name)."""

    def do_GET(self) -> None:
        try:
            self._answer()
        except (BrokenPipeError, ConnectionResetError):  # the loader stopped reading, as it should
            pass

    def _answer(self) -> None:
        path = self.path
        if path == "/ok.png":
            self._send(200, PNG)
        elif path == "/slow":
            time.sleep(3)
            self._send(200, PNG)
        elif path == "/drip":
            self.send_response(200)
            self.end_headers()
            for b in PNG[:40]:
                self.wfile.write(bytes([b]))
                self.wfile.flush()
                time.sleep(0.2)
        elif path == "/big":
            self.send_response(200)
            self.send_header("Content-Length", str(BIG))
            self.end_headers()
            self.wfile.write(PNG)
        elif path == "/endless":
            self.send_response(200)
            self.end_headers()
            for _ in range(BIG // (1 << 20)):
                self.wfile.write(b"\0" * (1 << 20))
        elif path == "/redirect":
            self.send_response(302)
            self.send_header("Location", f"http://localhost:{self.server.server_address[1]}/ok.png")
            self.end_headers()
        else:
            self._send(404, b"not found")

    def _send(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def media_host():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Media)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("media")
    (root / "allowed").mkdir()
    (root / "allowed" / "ok.png").write_bytes(PNG)
    (root / "secret.png").write_bytes(PNG)
    (root / "allowed" / "link.png").symlink_to(root / "secret.png")
    return root


def gemma3_args(path: str, **kwargs) -> EngineArgs:
    return EngineArgs(
        model=path,
        device=DEVICE,
        dtype="float32",
        kv_cache_memory=0.01,
        max_model_len=64,
        engine_process=False,
        **kwargs,
    )


@pytest.fixture(scope="module")
def server(gemma3, media_dir):
    args = gemma3_args(
        gemma3,
        allowed_local_media_path=str(media_dir / "allowed"),
        allowed_media_domains=["127.0.0.1"],
        limit_mm_per_prompt={"image": 3},
    )
    with ServerThread(AsyncLLM(args, served_model_name="tiny"), max_body_bytes=8 << 20) as s:
        yield s


def user(*parts, text: str = "w10 w11") -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": text}, *parts]}]


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def chat(server: ServerThread, messages: list[dict], **extra):
    body = {"model": "tiny", "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0, **extra}
    return server.post(CHAT, {**body, "ignore_eos": True})


# (what, the image part's URL (a function of the media host and directory), what the message says)
BAD_IMAGES = [
    ("truncated PNG", lambda h, d: data_url(PNG[: len(PNG) // 2]), "PNG data is truncated or corrupt"),
    ("truncated JPEG", lambda h, d: data_url(JPEG[: len(JPEG) // 2], "image/jpeg"), "JPEG data is truncated"),
    ("bomb past Pillow's limit", lambda h, d: data_url(png_header(100_000, 100_000)), "too many pixels"),
    ("bomb past Ember's limit", lambda h, d: data_url(png_header(6000, 6000)), r"6000x6000 pixels, more than"),
    ("zero bytes", lambda h, d: "data:image/png;base64,", r"empty \(0 bytes\)"),
    ("zero width", lambda h, d: data_url(png_header(0, 10)), "not an image in an accepted format"),
    ("text, not an image", lambda h, d: data_url(b"hello, world"), "not an image in an accepted format"),
    ("SVG", lambda h, d: data_url(b"<svg xmlns='http://www.w3.org/2000/svg'/>"), "not an image in an accepted"),
    ("TIFF", lambda h, d: data_url(encode(RGB, "TIFF")), r"accepted format \(PNG, JPEG, WEBP, GIF, BMP\)"),
    ("TIFF's own MIME", lambda h, d: data_url(encode(RGB, "TIFF"), "image/tiff"), "MIME type 'image/tiff'"),
    ("wrong MIME", lambda h, d: data_url(PNG, "image/jpeg"), "says 'image/jpeg', but its bytes are a PNG"),
    ("bad base64", lambda h, d: "data:image/png;base64,iVBOR#w0KGgo=", "not valid base64"),
    ("not base64", lambda h, d: "data:image/png,abc", "must be base64-encoded"),
    ("no comma", lambda h, d: "data:image/png;base64", "needs a ','"),
    ("another scheme", lambda h, d: "ftp://127.0.0.1/x.png", "not a data:, http"),
    ("a bare path", lambda h, d: str(d / "allowed" / "ok.png"), "not a data:, http"),
    ("oversize body", lambda h, d: h + "/big", "more than the limit of 20971520"),
    ("oversize stream", lambda h, d: h + "/endless", "more than the limit of 20971520 bytes"),
    ("disallowed domain", lambda h, d: h.replace("127.0.0.1", "localhost") + "/ok.png", "'localhost' is not among"),
    ("redirect to a disallowed domain", lambda h, d: h + "/redirect", "'localhost' is not among"),
    ("404", lambda h, d: h + "/missing", "HTTP 404"),
    ("file:// outside the allowed path", lambda h, d: f"file://{d}/secret.png", "outside the allowed local"),
    ("file:// link out of the allowed path", lambda h, d: f"file://{d}/allowed/link.png", "outside the allowed"),
    ("file:// to a directory", lambda h, d: f"file://{d}/allowed", "not a regular file"),
    ("file:// that is missing", lambda h, d: f"file://{d}/allowed/nope.png", "cannot read"),
]


@pytest.mark.parametrize("what,url,message", BAD_IMAGES, ids=[c[0] for c in BAD_IMAGES])
def test_bad_image_is_a_400_that_says_why(server, media_host, media_dir, what, url, message):
    r = chat(server, user(image_part(url(media_host, media_dir))))
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == "messages[0].content"
    assert error["message"].startswith("messages[0].content: ")
    assert re.search(message, error["message"]), error["message"]


def test_a_bomb_costs_no_memory(server):
    """A 6000x6000 and a 100000x100000 declared canvas are refused from the header: peak RSS barely moves
    (decoded, the first would be 108 MB and the second 30 GB)."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for size in (6000, 100_000, 60_000):
        for _ in range(3):
            r = chat(server, user(image_part(data_url(png_header(size, size)))))
            assert r.status_code == 400
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024  # ru_maxrss: KiB on Linux
    assert grown_mib < 64, grown_mib


def test_slow_hosts_time_out(server, media_host, monkeypatch):
    processor = server.state.engine.processor
    monkeypatch.setattr(processor, "media", dataclasses.replace(processor.media, timeout_s=0.5))
    for path, message in (("/slow", "timed out"), ("/drip", "longer than the fetch timeout")):
        start = time.monotonic()
        r = chat(server, user(image_part(media_host + path)))
        assert r.status_code == 400 and message in r.json()["error"]["message"], r.text
        assert time.monotonic() - start < 2.5


def test_file_urls_need_the_flag(gemma3, media_dir):
    """Without --allowed-local-media-path no file:// URL is read, not even one that exists."""
    connector = MediaConnector()
    with pytest.raises(ValueError, match="--allowed-local-media-path"):
        connector.load_url(f"file://{media_dir}/allowed/ok.png")
    allowed = MediaConnector(allowed_local_media_path=str(media_dir / "allowed"))
    assert allowed.load_url(f"file://{media_dir}/allowed/ok.png").size == (41, 33)


def test_counts_placeholders_and_models(server, llama_dir):
    ok = image_part(data_url(PNG))
    r = chat(server, user(ok, ok, ok, ok))  # the server allows 3 a prompt
    assert r.status_code == 400 and "4 images, more than the limit of 3" in r.json()["error"]["message"]
    r = chat(server, user(ok, text="w10 <start_of_image>"))  # a placeholder typed as text: 2 for 1 image
    assert r.status_code == 400 and "1 image(s) for 2 image placeholder(s)" in r.json()["error"]["message"]
    with ServerThread(tiny_engine(llama_dir)) as text_only:
        r = text_only.post(CHAT, {"messages": user(ok), "max_tokens": 2})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["message"] == "messages[0].content: this model does not accept image input"
    assert_no_request_left(server)


@pytest.mark.parametrize(
    "image",
    [
        encode(RGB.convert("P"), "GIF", save_all=True, append_images=[RGB.rotate(90).convert("P")], duration=50),
        encode(RGB.convert("CMYK"), "JPEG"),
        encode(RGB.convert("LA"), "PNG"),
        encode(RGB.convert("P"), "PNG", transparency=0),
        encode(RGB, "WEBP"),
        encode(RGB, "BMP"),
    ],
    ids=["animated GIF", "CMYK JPEG", "LA PNG", "P PNG with transparency", "WEBP", "BMP"],
)
def test_formats_and_modes_are_read(server, image):
    mime = {b"GIF": "image/gif", b"\xff\xd8": "image/jpeg", b"RIFF": "image/webp", b"BM": "image/bmp"}
    kind = next((m for magic, m in mime.items() if image.startswith(magic)), "image/png")
    r = chat(server, user(image_part(data_url(image, kind))))
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == MAX_TOKENS


def test_modes_become_rgb_as_transformers_makes_them():
    """Transparency over white, the first frame of an animation (transformers' convert_to_rgb)."""
    clear = Image.new("LA", (2, 2), (0, 0))
    assert decode_image(encode(clear, "PNG"), 100).getpixel((0, 0)) == (255, 255, 255)
    frames = [Image.new("RGB", (4, 4), c) for c in ((255, 0, 0), (0, 0, 255))]
    gif = encode(frames[0], "GIF", save_all=True, append_images=frames[1:])
    assert decode_image(gif, 100).getpixel((0, 0)) == (255, 0, 0)
    assert decode_image(encode(Image.new("CMYK", (2, 2), (0, 0, 0, 0)), "JPEG"), 100).mode == "RGB"


# ---- good images: the same tokens on every path ---------------------------------------------------


@pytest.fixture(scope="module")
def reference(gemma3):
    """LLM.generate's tokens for the prompt the template writes for user(text "w10 w11", one image)."""
    llm = LLM(gemma3, device=DEVICE, dtype="float32", kv_cache_memory=0.01, max_model_len=64, engine_process=False)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    prompt = "<bos>w10 w11<start_of_image>"
    out = llm.generate({"prompt": prompt, "multi_modal_data": {"image": RGB}}, params, use_tqdm=False)[0]
    yield llm, list(out.outputs[0].token_ids), out.outputs[0].text
    llm.llm_engine.shutdown()


def test_chat_with_an_image_equals_generate(server, reference, media_host, media_dir):
    _, tokens, _ = reference
    tokenizer = reference[0].get_tokenizer()
    urls = (data_url(PNG), media_host + "/ok.png", f"file://{media_dir}/allowed/ok.png")
    for part in [*map(image_part, urls), {"type": "image_url", "image_url": data_url(PNG)}]:  # and vLLM's form
        r = chat(server, user(part), logprobs=True, skip_special_tokens=False)
        assert r.status_code == 200, r.text
        got = [
            tokenizer.encode(t["token"], add_special_tokens=False)
            for t in r.json()["choices"][0]["logprobs"]["content"]
        ]
        assert got == [[t] for t in tokens]


def test_sdks_send_images(server, reference):
    _, _, text = reference
    answer = server.client().chat.completions.create(
        model="tiny",
        messages=user(image_part(data_url(PNG))),
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert answer.choices[0].message.content == text
    message = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0).messages.create(
        model="tiny",
        max_tokens=MAX_TOKENS,
        extra_body={"ignore_eos": True, "temperature": 0},
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "w10 w11"},
                    {
                        "type": "image",
                        "source": {"type": "base64", "media_type": "image/png", "data": data_url(PNG)[22:]},
                    },
                ],
            }
        ],
    )
    assert message.content[0].text == text
    response = server.client().responses.create(
        model="tiny",
        max_output_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"ignore_eos": True},
        input=[
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "w10 w11"},
                    {"type": "input_image", "image_url": data_url(PNG)},
                ],
            }
        ],
    )
    assert response.output_text == text


def test_api_errors_name_their_fields(server):
    r = server.post(
        "/v1/messages",
        {
            "model": "tiny",
            "max_tokens": 2,
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "@@"}}
                    ],
                }
            ],
        },
    )
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("messages: image_url: "), r.text
    r = server.post(
        "/v1/responses",
        {
            "model": "tiny",
            "input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:image/png;base64,"}]}],
        },
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "input", r.text
    assert "empty (0 bytes)" in r.json()["error"]["message"]
    r = server.post(
        "/v1/responses",
        {"model": "tiny", "input": [{"role": "user", "content": [{"type": "input_image", "file_id": "file-1"}]}]},
    )
    assert r.status_code == 400 and "file_id is not supported" in r.json()["error"]["message"], r.text


def test_library_takes_images_every_way(reference, media_dir):
    llm, tokens, _ = reference
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)

    def chat_tokens(part: dict) -> list[int]:
        return list(llm.chat(user(part), params, use_tqdm=False)[0].outputs[0].token_ids)

    assert chat_tokens(image_part(data_url(PNG))) == tokens
    assert chat_tokens({"type": "image_pil", "image_pil": RGB}) == tokens
    with pytest.raises(ValueError, match="--allowed-local-media-path"):  # this LLM allows no local path
        chat_tokens(image_part(f"file://{media_dir}/allowed/ok.png"))
    for image in (PNG, str(media_dir / "allowed" / "ok.png"), data_url(PNG)):  # bytes, a path, a URL
        out = llm.generate({"prompt": "<bos>w10 w11<start_of_image>", "multi_modal_data": {"image": image}}, params)
        assert list(out[0].outputs[0].token_ids) == tokens
    with pytest.raises(ValueError, match="multi_modal_data.image: image: the PNG data is truncated"):
        llm.generate({"prompt": "<start_of_image>", "multi_modal_data": {"image": PNG[:100]}}, params)


def test_cli_chat_attaches_the_image(gemma3, media_dir, reference, capsys):
    from ember.cli import main

    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, seed=0)
    prompt = {"prompt": "<bos><start_of_image>w10 w11", "multi_modal_data": {"image": RGB}}  # the image first
    expected = reference[0].generate(prompt, params, use_tqdm=False)[0].outputs[0].text
    capsys.readouterr()
    image = str(media_dir / "allowed" / "ok.png")
    argv = ["chat", "--model", gemma3, "--image", image, "--message", "w10 w11", "--device", DEVICE]
    argv += ["--dtype", "float32", "--kv-cache-memory", "0.01", "--max-model-len", "64", "--no-engine-process"]
    assert main([*argv, "--max-tokens", str(MAX_TOKENS), "--temperature", "0"]) == 0
    assert capsys.readouterr().out == expected + "\n"


def test_text_only_library_refuses_images(llama_dir):
    llm = LLM(str(llama_dir), device="cpu", kv_cache_memory=0.01, engine_process=False)
    with pytest.raises(ValueError, match="does not accept image input"):
        llm.chat(user(image_part(data_url(PNG))))
    llm.llm_engine.shutdown()


def test_tokenize_refuses_and_count_tokens_counts_images(server):
    r = server.post("/tokenize", {"model": "tiny", "messages": user(image_part(data_url(PNG)))})
    assert r.status_code == 400 and "/tokenize does not read images" in r.json()["error"]["message"], r.text
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data_url(PNG)[22:]}}
    messages = [{"role": "user", "content": [{"type": "text", "text": "w10 w11"}, image]}]
    r = server.post("/v1/messages/count_tokens", {"model": "tiny", "messages": messages})
    # <bos> w10 " " w11, then the image: \n\n <start_of_image> 4 x <image_soft_token> <end_of_image> \n\n
    assert r.status_code == 200 and r.json()["input_tokens"] == 4 + 4 + TOKENS_PER_IMAGE, r.text
