"""A thin tokenizer wrapper over `tokenizers.Tokenizer` that knows its special tokens and chat template.

Built by `ember.model.loader` from an HF directory or a GGUF vocabulary; nothing here imports
`transformers`.
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import tokenizers


class Tokenizer:
    def __init__(
        self,
        tok: tokenizers.Tokenizer,
        *,
        bos_token: str | None,
        eos_token: str | None,
        eos_token_ids: list[int],
        chat_template: str | None,
    ) -> None:
        self.tok = tok
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.eos_token_ids = list(dict.fromkeys(eos_token_ids))
        self.chat_template = chat_template
        added = tok.get_added_tokens_decoder()
        self.all_special_ids = sorted(i for i, t in added.items() if t.special)
        self._added_ids = set(added)
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        # The decoder's own JSON (what pickling it gives), not the whole tokenizer's: serialising and parsing
        # all of the default model's 49k-token vocabulary and merges for this cost 0.13 s of each build.
        self._byte_level = tok.decoder is not None and b'"ByteLevel"' in tok.decoder.__getstate__()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_pair(self, first: str, second: str) -> tuple[list[int], int | None]:
        """A text pair as the tokenizer's post-processor joins it (a cross-encoder's input), and where the
        second text's tokens (type 1) start: None where the tokenizer gives every token type 0 (RoBERTa)."""
        enc = self.tok.encode(first, second)
        start = next((i for i, t in enumerate(enc.type_ids) if t == 1), None)
        return enc.ids, start

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self.tok.id_to_token(token_id)

    def token_bytes(self, token_id: int) -> bytes:
        """The exact bytes one token stands for, even when it holds only part of a UTF-8 character
        (where decoding it alone would give U+FFFD): byte-level BPE pieces map back through GPT-2's
        byte alphabet, SentencePiece byte-fallback pieces are `<0xNN>`, and `▁` is a space."""
        piece = self.tok.id_to_token(token_id)
        if piece is None:
            return b""
        if token_id in self._added_ids:
            return piece.encode("utf-8")
        if self._byte_level:
            return bytes(_byte_decoder()[c] for c in piece)
        match = re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", piece)
        if match:
            return bytes([int(match.group(1), 16)])
        return piece.replace("\u2581", " ").encode("utf-8")

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        variables: dict[str, Any] | None = None,
        **extra: Any,
    ) -> str:
        """HF's call (keyword arguments reach the template as variables); `variables` carries them as a
        mapping, so a name such as `chat_template` or `messages` among them cannot clash with this
        method's own parameters."""
        template = chat_template or self.chat_template
        if template is None:
            raise ValueError("chat_template: this model has no chat template; pass one with --chat-template")
        # Imported on first use: the engine core builds a Tokenizer (the grammar's vocabulary) but renders
        # no template, and Jinja2's import cost its start-up 65 ms of CPU.
        from ember.chat_template import render_chat

        return render_chat(
            template,
            messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
            variables={**extra, **(variables or {})},
        )


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's bytes-to-unicode table: printable bytes stand for themselves, the other 68
    are shifted to code points from 256 on."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {chr(b): b for b in printable}
    shift = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + shift)] = b
            shift += 1
    return table
