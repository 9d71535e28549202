"""LoRA over HTTP: a request's `model` selects its adapter on completions and chat, /v1/models lists the
adapters with their parent, and POST /v1/load_lora_adapter and /v1/unload_lora_adapter (only with
runtime updating allowed) change what is served, with OpenAI-shaped errors."""

from __future__ import annotations

import pytest
from test_lora import ADAPTERS, GREEDY, PROMPTS, _llm, make_adapter
from test_server import MODEL, ServerThread, tiny_engine

from ember.cli import build_parser
from ember.server.args import resolve_args, settings_from_args

pytest.importorskip("peft")


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    """A base checkpoint, two adapters (name -> path) and the in-process engine's tokens for each prompt."""
    from conftest import make_checkpoint

    root = tmp_path_factory.mktemp("lora-server")
    base = make_checkpoint(root / "llama", "llama")
    paths = {}
    for i, name in enumerate(["all-r8", "qv-r4-rslora"]):
        rank, alpha, targets, rslora = ADAPTERS[name]
        paths[name] = make_adapter(base, root / name, rank, alpha, targets, rslora, seed=i)
    from ember import LoRARequest

    llm = _llm(base, max_loras=2)
    runs = [(None, None)] + [(n, LoRARequest(n, i + 1, str(p))) for i, (n, p) in enumerate(paths.items())]
    want = {
        name: [o.outputs[0].text for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=lora)]
        for name, lora in runs
    }
    return base, paths, want


def _server(base, paths, **settings) -> ServerThread:
    engine = tiny_engine(base, enable_lora=True, max_loras=2, max_model_len=256, engine_process=False)
    return ServerThread(engine, lora_modules=(("all-r8", str(paths["all-r8"])),), **settings)


def test_model_selects_the_adapter(adapters):
    base, paths, want = adapters
    with _server(base, paths) as s:
        models = s.client().models.list().data
        assert [(m.id, getattr(m, "parent", None)) for m in models] == [(MODEL, None), ("all-r8", MODEL)]
        for name in (MODEL, "all-r8"):
            out = s.client().completions.create(model=name, prompt=PROMPTS, max_tokens=16, temperature=0)
            assert out.model == name
            assert [c.text for c in sorted(out.choices, key=lambda c: c.index)] == want[None if name == MODEL else name]
        chat = s.post("/v1/chat/completions", {"model": "all-r8", "messages": [{"role": "user", "content": "hi"}]})
        assert chat.status_code == 200 and chat.json()["model"] == "all-r8"
        missing = s.post("/v1/completions", {"model": "nope", "prompt": "x"})
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
        # runtime updating is off: the endpoints are not there
        assert s.post("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "y"}).status_code == 404


def test_runtime_load_and_unload(adapters, tmp_path):
    base, paths, want = adapters
    with _server(base, paths, allow_runtime_lora_updating=True) as s:
        body = {"lora_name": "qv", "lora_path": str(paths["qv-r4-rslora"])}
        assert s.post("/v1/load_lora_adapter", body).status_code == 200
        again = s.post("/v1/load_lora_adapter", body)
        assert again.status_code == 400 and "already served" in again.json()["error"]["message"]
        out = s.client().completions.create(model="qv", prompt=PROMPTS, max_tokens=16, temperature=0)
        assert [c.text for c in sorted(out.choices, key=lambda c: c.index)] == want["qv-r4-rslora"]
        bad = s.post("/v1/load_lora_adapter", {"lora_name": "bad", "lora_path": str(tmp_path / "nowhere")})
        assert bad.status_code == 400 and "no such directory" in bad.json()["error"]["message"]
        assert bad.json()["error"]["type"] == "invalid_request_error"
        assert s.post("/v1/unload_lora_adapter", {"lora_name": "qv"}).status_code == 200
        gone = s.post("/v1/unload_lora_adapter", {"lora_name": "qv"})
        assert gone.status_code == 404 and gone.json()["error"]["type"] == "not_found_error"
        assert s.post("/v1/completions", {"model": "qv", "prompt": "x"}).status_code == 404
        assert [m.id for m in s.client().models.list().data] == [MODEL, "all-r8"]


def test_serve_flags(monkeypatch):
    def settings(*argv: str):
        return settings_from_args(resolve_args(build_parser("serve").parse_args(["serve", "m", *argv])))

    args, s = settings("--enable-lora", "--max-loras", "4", "--lora-modules", "a=/x", '{"name": "b", "path": "/y"}')
    assert args.enable_lora and args.max_loras == 4 and s.lora_modules == (("a", "/x"), ("b", "/y"))
    assert not s.allow_runtime_lora_updating
    assert settings("--enable-lora", "--allow-runtime-lora-updating")[1].allow_runtime_lora_updating
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "true")
    assert settings("--enable-lora")[1].allow_runtime_lora_updating
    with pytest.raises(ValueError, match="need --enable-lora"):
        settings("--lora-modules", "a=/x")


def test_load_and_unload_under_traffic(adapters):
    """Requests on the base and a served adapter keep running, and keep their answers, while another
    adapter is loaded, used and unloaded."""
    from concurrent.futures import ThreadPoolExecutor

    base, paths, want = adapters
    with _server(base, paths, allow_runtime_lora_updating=True) as s:

        def complete(model: str) -> list[str]:
            out = s.client().completions.create(model=model, prompt=PROMPTS, max_tokens=16, temperature=0)
            return [c.text for c in sorted(out.choices, key=lambda c: c.index)]

        with ThreadPoolExecutor(4) as pool:
            traffic = [pool.submit(complete, m) for m in [MODEL, "all-r8"] * 3]
            body = {"lora_name": "qv", "lora_path": str(paths["qv-r4-rslora"])}
            assert s.post("/v1/load_lora_adapter", body).status_code == 200
            assert complete("qv") == want["qv-r4-rslora"]
            assert s.post("/v1/unload_lora_adapter", {"lora_name": "qv"}).status_code == 200
            for model, future in zip([MODEL, "all-r8"] * 3, traffic):
                assert future.result() == want[None if model == MODEL else model]
