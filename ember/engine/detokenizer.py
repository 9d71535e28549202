"""Token ids to text, one token at a time, as the front end receives them from the engine core."""

from __future__ import annotations

from ember.sampling.params import SamplingParams
from ember.tokenizer import Tokenizer

# Prompt tokens decoded ahead of the output so leading spaces and merges render as in the full text.
_CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    """Decodes one token at a time and never emits half of a multi-byte character.

    Text is decoded over a sliding window of tokens (`prefix_offset:`) and only the part beyond
    what the window's head already produced is new; a trailing U+FFFD means the last token ended
    mid-character, so the text waits for the next token. While stop strings are possible, the
    last `len(longest stop) - 1` characters are held back so a stop string is never streamed.
    """

    def __init__(self, tokenizer: Tokenizer | None, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.skip_special = params.skip_special_tokens
        self.stop = params.stop
        self.include_stop = params.include_stop_str_in_output
        self.min_tokens = params.min_tokens
        self.hold_back = max((len(s) for s in self.stop), default=1) - 1
        self.ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.read_offset = len(self.ids)
        self.prefix_offset = max(self.read_offset - _CONTEXT_TOKENS + 1, 0)
        self.num_output_tokens = 0
        self.text = ""
        self.emitted = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special)

    def update(self, token_id: int) -> str | None:
        """Add one generated token; returns the stop string it completed, if any."""
        self.num_output_tokens += 1
        if self.tokenizer is None:
            return None
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        new = self._decode(self.ids[self.prefix_offset:])
        if len(new) <= len(prefix) or new.endswith("\ufffd"):
            return None
        delta = new[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += delta
        if not self.stop or self.num_output_tokens < self.min_tokens:
            return None
        search_from = max(0, len(self.text) - len(delta) - self.hold_back)
        found = [(self.text.find(s, search_from), s) for s in self.stop]
        found = [(pos, s) for pos, s in found if pos >= 0]
        if not found:
            return None
        pos, stop = min(found)
        self.text = self.text[: pos + len(stop) if self.include_stop else pos]
        return stop

    def flush(self) -> None:
        """At the end, emit whatever a last incomplete character left waiting."""
        if self.tokenizer is not None and self.read_offset < len(self.ids):
            prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
            self.text += self._decode(self.ids[self.prefix_offset:])[len(prefix):]
            self.read_offset = len(self.ids)

    def take_delta(self, finished: bool) -> str:
        end = len(self.text) if finished else max(self.emitted, len(self.text) - self.hold_back)
        delta = self.text[self.emitted:end]
        self.emitted = end
        return delta
