"""A GGUF file's key/value fields and vocabulary (no torch, no `tokenizers`).

llama.cpp stores the vocabulary, merges (or SentencePiece scores), special-token kinds and the
pre-tokenizer's name in the file's metadata; `GGUFVocab.build` turns them back into the HF tokenizer
the model was trained with (ember.model.gguf_tokenizer_build). The front end builds it (it tokenizes
and detokenizes); the engine core reads the vocabulary with the weights and builds the tokenizer only
for its first structured-output request, so it imports `tokenizers` only then (~20 ms of its start
and 1.8 MiB of its RSS when ready, 2-core EPYC, 2026-12-07).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ember.errors import ModelLoadError
from ember.model.gguf_reader import GGUFFile, GGUFFormatError
from ember.model.reads import BUILT_TOKENIZER, PARSED_GGUF, logged_read

if TYPE_CHECKING:
    import tokenizers


class GGUFMetadata:
    """Access to GGUF key/value fields, raising ModelLoadError that names the file."""

    def __init__(self, path: str, fields: dict[str, Any], reader: GGUFFile | None = None) -> None:
        self.path = path
        self.reader = reader
        self.fields = fields

    def get(self, key: str, default: Any = None) -> Any:
        return self.fields.get(key, default)

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise ModelLoadError(self.path, f"GGUF metadata lacks {key!r}")
        return value

    def tokenizer_part(self) -> GGUFMetadata:
        """The `tokenizer.*` keys alone, without the file (its memory map stays mapped as long as the
        reader lives): what a vocabulary keeps, so that the engine core can build the tokenizer long
        after its weights are loaded and the file closed."""
        return GGUFMetadata(self.path, {k: v for k, v in self.fields.items() if k.startswith("tokenizer.")})


def open_gguf(path: str, lazy_strings: bool = False) -> GGUFMetadata:
    """`lazy_strings`: the vocabulary's strings decoded only when read (see StringArray)."""
    try:
        with logged_read(PARSED_GGUF, path):
            reader = GGUFFile(path, lazy_strings)
        return GGUFMetadata(path, reader.fields, reader)
    except (GGUFFormatError, OSError) as exc:
        raise ModelLoadError(path, f"not a valid GGUF file ({type(exc).__name__}: {exc})") from exc


@dataclass
class GGUFVocab:
    """The special tokens and template of a GGUF vocabulary; `build()` makes the tokenizer itself."""

    meta: GGUFMetadata
    tokens: Sequence[str]
    model: str
    bos_id: int | None
    eos_id: int | None
    eos_token_ids: list[int]
    add_bos_token: bool
    chat_template: str | None

    @classmethod
    def read(cls, meta: GGUFMetadata) -> GGUFVocab:
        tokens: Sequence[str] = meta.require("tokenizer.ggml.tokens")
        model = meta.require("tokenizer.ggml.model")
        eos_ids = [
            token_id
            for key in ("eos_token_id", "eot_token_id", "eom_token_id")
            if (token_id := meta.get(f"tokenizer.ggml.{key}")) is not None
        ]
        return cls(
            meta.tokenizer_part(),
            tokens,
            model,
            meta.get("tokenizer.ggml.bos_token_id"),
            meta.get("tokenizer.ggml.eos_token_id"),
            list(dict.fromkeys(eos_ids)),
            bool(meta.get("tokenizer.ggml.add_bos_token", model == "llama")),
            meta.get("tokenizer.chat_template"),
        )

    @property
    def bos_token(self) -> str | None:
        return self.tokens[self.bos_id] if self.bos_id is not None else None

    @property
    def eos_token(self) -> str | None:
        return self.tokens[self.eos_id] if self.eos_id is not None else None

    def build(self) -> tokenizers.Tokenizer:
        from ember.model.gguf_tokenizer_build import build_tokenizer

        with logged_read(BUILT_TOKENIZER, self.meta.path):
            return build_tokenizer(self.meta, self.model, self.tokens, self.bos_id if self.add_bos_token else None)
