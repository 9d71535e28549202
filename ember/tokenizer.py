"""A thin tokenizer wrapper over `tokenizers.Tokenizer` that knows its special tokens and chat template.

Built by `ember.model.loader` from an HF directory or a GGUF vocabulary; nothing here imports
`transformers`.
"""

from __future__ import annotations

from typing import Any

import tokenizers

from ember.chat_template import render_chat


class Tokenizer:
    def __init__(self, tok: tokenizers.Tokenizer, *, bos_token: str | None, eos_token: str | None,
                 eos_token_ids: list[int], chat_template: str | None) -> None:
        self.tok = tok
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.eos_token_ids = list(dict.fromkeys(eos_token_ids))
        self.chat_template = chat_template
        added = tok.get_added_tokens_decoder()
        self.all_special_ids = sorted(i for i, t in added.items() if t.special)
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self.tok.id_to_token(token_id)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            chat_template: str | None = None, **extra: Any) -> str:
        template = chat_template or self.chat_template
        if template is None:
            raise ValueError("chat_template: this model has no chat template; pass one with --chat-template")
        return render_chat(template, messages, add_generation_prompt=add_generation_prompt,
                           bos_token=self.bos_token, eos_token=self.eos_token, **extra)
