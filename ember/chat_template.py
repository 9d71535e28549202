"""Jinja2 chat templates, rendered the way Hugging Face's `apply_chat_template` renders them.

Templates come from model files (tokenizer_config.json, chat_template.jinja, GGUF metadata), so
they are untrusted: they run in Jinja's immutable sandbox.
"""

from __future__ import annotations

import json
import os
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

ROLES = ("system", "user", "assistant", "tool", "developer")
# What `render_chat` itself gives every template; a request's extra variables (`chat_template_kwargs`)
# may not replace them.
RESERVED_VARIABLES = frozenset({"messages", "add_generation_prompt", "bos_token", "eos_token"})


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def load_chat_template(value: str) -> str:
    """`--chat-template` accepts a file path or the template text itself."""
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if "{" not in value:
        raise ValueError(f"chat_template: {value!r} is neither a file nor a Jinja2 template")
    return value


def normalize_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Check roles and flatten OpenAI-style text parts to plain text. A message with image placeholders
    (`{"type": "image"}`, left by ember.multimodal.parts) keeps its parts, as Hugging Face templates
    read them: each image part becomes the model's image token where the template writes it."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list")
    out = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise ValueError(f"messages[{i}] must be an object with 'role' and 'content'")
        role = msg.get("role")
        if role not in ROLES:
            raise ValueError(f"messages[{i}].role must be one of {ROLES}, got {role!r}")
        content = msg.get("content")
        if isinstance(content, list):
            for j, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else None
                if not (kind == "image" or (kind == "text" and isinstance(part.get("text"), str))):
                    raise ValueError(
                        f"messages[{i}].content[{j}] must be {{'type': 'text', 'text': ...}} or an image "
                        "placeholder {'type': 'image'}"
                    )
            if all(part["type"] == "text" for part in content):
                content = "".join(part["text"] for part in content)
        elif content is None:
            content = ""
        elif not isinstance(content, str):
            raise ValueError(f"messages[{i}].content must be a string or a list of text parts")
        out.append({**msg, "content": content})
    return out


def render_chat(
    template: str,
    messages: list[dict[str, Any]],
    *,
    add_generation_prompt: bool,
    bos_token: str | None,
    eos_token: str | None,
    variables: dict[str, Any] | None = None,
) -> str:
    """The conversation as the template writes it; `variables` (tools, a request's chat_template_kwargs)
    reach the template beside the standard ones. Any failure is a ValueError: the template is untrusted
    code running over the request's values, so whatever it raises (a TemplateError, or a TypeError from
    `"a" + 1` over a value the request chose) is that request's error, not the server's."""
    variables = variables or {}
    clash = sorted(RESERVED_VARIABLES & variables.keys())
    if clash:
        raise ValueError(f"chat_template_kwargs: {', '.join(clash)} cannot be given; the server sets them")
    try:
        return _compile(template).render(
            messages=normalize_messages(messages),
            add_generation_prompt=add_generation_prompt,
            bos_token=bos_token or "",
            eos_token=eos_token or "",
            **variables,
        )
    except jinja2.exceptions.TemplateError as e:
        raise ValueError(f"chat template failed: {e}") from e
    except ValueError:
        raise
    except Exception as e:
        raise ValueError(f"chat template failed: {type(e).__name__}: {e}") from e
