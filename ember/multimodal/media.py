"""Images from where a request points (a `data:` URL, an http(s) URL, a local `file://` path, raw bytes) to
decoded RGB Pillow images, or a ValueError that says what is wrong with the image. Everything a request
sends here is hostile until decoded, so each step is bounded before it runs:

- count: at most `max_images` per prompt (8; vLLM's `--limit-mm-per-prompt`), checked before any loads;
- bytes: at most `max_bytes` (20 MiB, OpenAI's own limit per image), counted while reading, before any
  decoding (a base64 string is measured before it is decoded);
- fetching: http(s) only, each redirect checked as the first URL is, hosts limited to
  `allowed_media_domains` when set (vLLM's flag: exact host names), a total time of `timeout_s` (5 s,
  vLLM's VLLM_IMAGE_FETCH_TIMEOUT) for the body;
- local files: only `file://` URLs under `allowed_local_media_path` (vLLM's flag; none without it),
  symbolic links resolved first, regular files only (a FIFO or /dev/zero never blocks or streams);
- pixels: the header's width x height against `max_pixels` (2^25, e.g. an 8K UHD frame; 128 MiB as
  RGBA) before the pixels are decoded, so a decompression bomb (a tiny file declaring a huge canvas)
  costs nothing; Pillow's own bomb check (at 179 M pixels) stays on behind it;
- formats: PNG, JPEG, WEBP, GIF (its first frame) and BMP, the only decoders Pillow tries; a data URL's
  MIME type must name the format its bytes decode as;
- decoding: the whole image is loaded here (`load()`), so a truncated file fails at the door rather than
  inside the engine, then made RGB as transformers' `convert_to_rgb` does (transparency over white).

Loading is synchronous (the server runs it in a worker thread, `LLM.chat` and `ember chat` in the caller's),
so fetching uses the standard library's urllib: `ember/http_client.py` is asyncio-only.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import stat
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlsplit

from PIL import Image, UnidentifiedImageError

if TYPE_CHECKING:
    from ember.config import EngineArgs

MAX_IMAGE_BYTES = 20 * 1024 * 1024
# Images one prompt may carry: each is held decoded (up to max_pixels x 3 bytes, 96 MiB) until it is
# preprocessed, so 8 bound a request's images to 768 MiB (vLLM's default limit is 999).
MAX_IMAGES_PER_PROMPT = 8
MAX_IMAGE_PIXELS = 1 << 25
FETCH_TIMEOUT_S = 5.0
# Pillow's format names, each with the MIME types a data URL may give it.
FORMATS: dict[str, tuple[str, ...]] = {
    "PNG": ("image/png",),
    "JPEG": ("image/jpeg", "image/jpg"),
    "WEBP": ("image/webp",),
    "GIF": ("image/gif",),
    "BMP": ("image/bmp", "image/x-ms-bmp"),
}
_MIME_TYPES = {mime for mimes in FORMATS.values() for mime in mimes}
_READ_CHUNK = 1 << 16

# What a request or a caller may give as an image: a URL (or, from the library, a path), bytes, or a
# Pillow image already decoded.
ImageSource = str | bytes | Image.Image


@dataclass(frozen=True)
class MediaConnector:
    """Where images may come from, and the limits on each (vLLM's `MediaConnector`, with limits)."""

    allowed_local_media_path: str = ""  # "" (vLLM's default): no file:// URL is read
    allowed_media_domains: tuple[str, ...] | None = None  # None: any host
    max_images: int = MAX_IMAGES_PER_PROMPT  # vLLM's --limit-mm-per-prompt '{"image": N}'
    max_bytes: int = MAX_IMAGE_BYTES
    max_pixels: int = MAX_IMAGE_PIXELS
    timeout_s: float = FETCH_TIMEOUT_S

    @classmethod
    def of(cls, args: EngineArgs) -> MediaConnector:
        limits = args.limit_mm_per_prompt if isinstance(args.limit_mm_per_prompt, dict) else {}
        domains = args.allowed_media_domains
        return cls(
            args.allowed_local_media_path,
            None if domains is None else tuple(domains),
            limits.get("image", MAX_IMAGES_PER_PROMPT),
        )

    def check_count(self, n: int) -> None:
        """Before loading any: a request's images are held decoded until preprocessed, so their number
        bounds its memory."""
        if n > self.max_images:
            raise ValueError(
                f"multi_modal_data: {n} images, more than the limit of {self.max_images} per prompt "
                "(--limit-mm-per-prompt)"
            )

    def load_url(self, url: str) -> Image.Image:
        """An image from a request's URL: `data:`, `http(s)://` or `file://` (under the allowed path)."""
        if not isinstance(url, str) or not url:
            raise ValueError("image_url: expected a non-empty URL string")
        scheme = url.split(":", 1)[0].lower() if ":" in url else ""
        if scheme == "data":
            data, mime = self._data_url(url)
            return decode_image(data, self.max_pixels, mime)
        if scheme in ("http", "https"):
            return decode_image(self._fetch(url), self.max_pixels)
        if scheme == "file":
            return decode_image(self._local_file(url), self.max_pixels)
        raise ValueError(f"image_url: {_short(url)} is not a data:, http(s):// or file:// URL")

    def load(self, source: Any) -> Image.Image:
        """An image from the library's caller: a Pillow image (loaded and made RGB), bytes, a URL as
        `load_url` reads it, or a bare path, read directly: the caller names its own file (a URL in a
        message, which may come from anyone, needs `allowed_local_media_path`)."""
        if isinstance(source, Image.Image):
            return to_rgb(source)
        if isinstance(source, (bytes, bytearray, memoryview)):
            data = bytes(source)
            if len(data) > self.max_bytes:
                raise ValueError(f"image: {len(data)} bytes, more than the limit of {self.max_bytes}")
            return decode_image(data, self.max_pixels)
        if isinstance(source, str) and (source.startswith("data:") or "://" in source):
            return self.load_url(source)
        if isinstance(source, (str, os.PathLike)):
            return decode_image(self._read_file(os.fspath(source)), self.max_pixels)
        raise ValueError(f"image: expected a PIL image, bytes, a path or a URL, got {type(source).__name__}")

    def _data_url(self, url: str) -> tuple[bytes, str]:
        """`data:<mime>;base64,<data>`: the bytes and the MIME type, its size checked before decoding."""
        header, sep, payload = url[len("data:") :].partition(",")
        if not sep:
            raise ValueError("image_url: a data URL needs a ',' between its header and its data")
        params = header.split(";")
        mime = params[0].strip().lower()
        if "base64" not in (p.strip().lower() for p in params[1:]):
            raise ValueError("image_url: a data URL's image must be base64-encoded (data:<mime type>;base64,...)")
        if mime not in _MIME_TYPES:
            raise ValueError(f"image_url: data URL MIME type {mime or '(none)'!r} is not one of {sorted(_MIME_TYPES)}")
        if len(payload) // 4 * 3 > self.max_bytes:
            raise ValueError(f"image_url: the data URL holds more than the limit of {self.max_bytes} bytes")
        try:
            return base64.b64decode(payload, validate=True), mime
        except (binascii.Error, ValueError) as e:
            raise ValueError(f"image_url: the data URL's data is not valid base64 ({e})") from None

    def check_remote(self, url: str) -> None:
        """A ValueError unless `url` is http(s) to an allowed host (also each redirect's target)."""
        parts = urlsplit(url)
        if parts.scheme.lower() not in ("http", "https") or not parts.hostname:
            raise ValueError(f"image_url: {_short(url)} is not an http(s) URL with a host")
        domains = self.allowed_media_domains
        if domains is not None and parts.hostname.lower() not in {d.lower() for d in domains}:
            raise ValueError(
                f"image_url: host {parts.hostname!r} is not among the allowed media domains "
                f"(--allowed-media-domains {' '.join(domains)})"
            )

    def _fetch(self, url: str) -> bytes:
        self.check_remote(url)
        opener = urllib.request.build_opener(_CheckedRedirects(self.check_remote))
        deadline = time.monotonic() + self.timeout_s
        try:
            with opener.open(urllib.request.Request(url, headers={"User-Agent": "ember"}), timeout=self.timeout_s) as r:
                declared = r.headers.get("Content-Length")
                if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
                    raise ValueError(
                        f"image_url: {_short(url)} is {declared} bytes, more than the limit of {self.max_bytes}"
                    )
                return _read_bounded(r.read1, self.max_bytes, deadline, f"image_url: {_short(url)}")
        except urllib.error.HTTPError as e:
            raise ValueError(f"image_url: fetching {_short(url)} failed: HTTP {e.code} {e.reason}") from None
        except urllib.error.URLError as e:
            raise ValueError(f"image_url: fetching {_short(url)} failed: {e.reason}") from None
        except (TimeoutError, OSError) as e:  # a socket timeout, a reset connection
            raise ValueError(f"image_url: fetching {_short(url)} failed: {type(e).__name__}: {e}") from None

    def _local_file(self, url: str) -> bytes:
        if not self.allowed_local_media_path:
            raise ValueError(
                "image_url: file:// URLs are not read unless the server allows a directory (--allowed-local-media-path)"
            )
        parts = urlsplit(url)
        if parts.netloc not in ("", "localhost"):
            raise ValueError(f"image_url: a file:// URL must name a local path, got host {parts.netloc!r}")
        path = os.path.realpath(unquote(parts.path))
        root = os.path.realpath(self.allowed_local_media_path)
        if os.path.commonpath([root, path]) != root:
            raise ValueError(f"image_url: {_short(url)} is outside the allowed local media path")
        return self._read_file(path)

    def _read_file(self, path: str) -> bytes:
        try:
            if not stat.S_ISREG(os.stat(path).st_mode):
                raise ValueError(f"image: {path} is not a regular file")
            with open(path, "rb") as f:
                data = f.read(self.max_bytes + 1)
        except OSError as e:
            raise ValueError(f"image: cannot read {path}: {e.strerror or e}") from None
        if len(data) > self.max_bytes:
            raise ValueError(f"image: {path} is more than the limit of {self.max_bytes} bytes")
        return data


class _CheckedRedirects(urllib.request.HTTPRedirectHandler):
    """Follow a redirect only to where the first URL could have pointed (scheme and allowed domains)."""

    def __init__(self, check: Any) -> None:
        self.check = check

    def redirect_request(self, req: Any, fp: Any, code: int, msg: str, headers: Any, newurl: str) -> Any:
        self.check(newurl)
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def _read_bounded(read1: Any, limit: int, deadline: float, what: str) -> bytes:
    chunks, size = [], 0
    while chunk := read1(_READ_CHUNK):
        size += len(chunk)
        if size > limit:
            raise ValueError(f"{what} is more than the limit of {limit} bytes")
        if time.monotonic() > deadline:
            raise ValueError(f"{what} took longer than the fetch timeout")
        chunks.append(chunk)
    return b"".join(chunks)


def decode_image(data: bytes, max_pixels: int, mime: str | None = None) -> Image.Image:
    """`data` decoded whole as RGB, or a ValueError: empty, not an accepted format, a MIME type that names
    another format, more pixels than `max_pixels` (checked from the header, before decoding), truncated
    or corrupt."""
    if not data:
        raise ValueError("image: the image is empty (0 bytes)")
    accepted = ", ".join(FORMATS)
    try:
        image = Image.open(io.BytesIO(data), formats=list(FORMATS))
    except UnidentifiedImageError:
        raise ValueError(f"image: not an image in an accepted format ({accepted})") from None
    except Image.DecompressionBombError as e:
        raise ValueError(f"image: too many pixels ({e})") from None
    except Exception as e:  # noqa: BLE001 - a hostile header can raise anything from a decoder plugin
        raise ValueError(f"image: cannot read the image header ({type(e).__name__}: {e})") from None
    fmt = image.format or "?"
    if mime is not None and mime not in FORMATS.get(fmt, ()):
        raise ValueError(f"image_url: the data URL says {mime!r}, but its bytes are a {fmt} image")
    width, height = image.size
    if width < 1 or height < 1:
        raise ValueError(f"image: {width}x{height} pixels, an image has none")
    if width * height > max_pixels:
        raise ValueError(f"image: {width}x{height} pixels, more than the limit of {max_pixels}")
    try:
        image.load()  # the first frame, whole: a truncated or corrupt file fails here
    except Exception as e:  # noqa: BLE001 - decoders raise OSError, SyntaxError, struct.error, ... on bad data
        raise ValueError(f"image: the {fmt} data is truncated or corrupt ({type(e).__name__}: {e})") from None
    return to_rgb(image)


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB as transformers' `convert_to_rgb` makes it: any transparency composited over white."""
    if image.mode == "RGB":
        return image
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    return image.convert("RGB")


def _short(url: str) -> str:
    """A URL as an error message quotes it: a data URL's payload would fill the message."""
    return repr(url if len(url) <= 200 else url[:200] + "...")
