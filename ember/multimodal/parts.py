"""Image parts of chat messages. Every API's image part arrives here as OpenAI's `image_url` part
(`{"image_url": {"url": ...}}`, or vLLM's string form `{"image_url": "..."}`) or, from the library,
vLLM's `{"type": "image_pil", "image_pil": <PIL image>}`; the Messages and Responses protocol modules
map their own blocks onto `image_url`. `split_images` leaves the chat template a `{"type": "image"}`
part in each one's place (Hugging Face templates render it as the model's placeholder, Gemma 3's
`<start_of_image>`) and returns the images' sources in order, to load and pass as `multi_modal_data`.
"""

from __future__ import annotations

from typing import Any

from PIL import Image

from ember.multimodal.media import ImageSource, MediaConnector, to_rgb

IMAGE_PARTS = ("image_url", "image_pil")
NO_VISION = "this model does not accept image input"


def split_images(messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[ImageSource]]:
    """The messages with each image part replaced by `{"type": "image"}`, and the images' sources (a URL
    or a PIL image) in order; a ValueError naming the part when one is malformed."""
    out, sources = [], []
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list) or not any(_kind(p) in IMAGE_PARTS for p in content):
            out.append(message)
            continue
        parts = []
        for j, part in enumerate(content):
            if _kind(part) in IMAGE_PARTS:
                sources.append(_source(part, f"messages[{i}].content[{j}]"))
                part = {"type": "image"}
            parts.append(part)
        out.append({**message, "content": parts})
    return out, sources


def load_images(media: MediaConnector, sources: list[ImageSource]) -> list[Image.Image]:
    """The images the messages point to, decoded under `media`'s rules (URLs only: a message's string is
    never read as a bare path); a ValueError saying which image failed and why."""
    media.check_count(len(sources))
    images = []
    for k, source in enumerate(sources):
        try:
            images.append(to_rgb(source) if isinstance(source, Image.Image) else media.load_url(str(source)))
        except ValueError as e:
            raise ValueError(f"{e}" if len(sources) == 1 else f"image {k + 1} of {len(sources)}: {e}") from None
    return images


def _kind(part: Any) -> Any:
    return part.get("type") if isinstance(part, dict) else None


def _source(part: dict[str, Any], where: str) -> ImageSource:
    if part["type"] == "image_pil":
        image = part.get("image_pil")
        if not isinstance(image, Image.Image):
            raise ValueError(f"{where}.image_pil must be a PIL image")
        return image
    value = part.get("image_url")
    url = value.get("url") if isinstance(value, dict) else value
    if not isinstance(url, str) or not url:
        raise ValueError(f"{where}.image_url must be {{'url': '...'}} or a URL string")
    return url
