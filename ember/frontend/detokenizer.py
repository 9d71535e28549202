"""Token ids to text, one token at a time, as the front end receives them from the engine core."""

from __future__ import annotations

from ember.frontend.content_filter import ContentFilter
from ember.sampling.params import SamplingParams
from ember.tokenizer import Tokenizer

Finish = tuple[str, str | None]  # (finish reason, stop reason) when the text itself ends a sequence

# Prompt tokens decoded ahead of the output so leading spaces and merges render as in the full text.
_CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    """Decodes one token at a time and never emits half of a multi-byte character.

    Text is decoded over a sliding window of tokens (`prefix_offset:`) and only the part beyond
    what the window's head already produced is new; a trailing U+FFFD means the last token ended
    mid-character, so the text waits for the next token. While stop strings are possible, the
    last `len(longest stop) - 1` characters are held back so a stop string is never streamed. With a
    content filter, the text that could still become a blocked phrase is held back too, and a blocked
    phrase ends the text before it (finish reason "content_filter"), whatever `min_tokens` says.
    """

    def __init__(
        self,
        tokenizer: Tokenizer | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        content_filter: ContentFilter | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.content_filter = content_filter
        self.skip_special = params.skip_special_tokens
        assert isinstance(params.stop, list)  # SamplingParams.__post_init__ normalises it to a list
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
        self.safe_end: int | None = None if content_filter is None else 0  # the content filter's limit

    def _decode(self, ids: list[int]) -> str:
        assert self.tokenizer is not None  # its callers return early without a tokenizer
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special)

    def update(self, token_id: int) -> Finish | None:
        """Add one generated token; returns ("stop", the stop string) or ("content_filter", None) when
        its text completed a stop string or a blocked phrase (the text then ends before it)."""
        self.num_output_tokens += 1
        if self.tokenizer is None:
            return None
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        new = self._decode(self.ids[self.prefix_offset :])
        if len(new) <= len(prefix) or new.endswith("\ufffd"):
            return None
        delta = new[len(prefix) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        since = len(self.text)
        self.text += delta
        stop = self._find_stop(since)
        if self.content_filter is not None:
            scan = self.content_filter.scan(self.text, since)
            self.safe_end = scan.safe_end
            if scan.blocked_at is not None and (stop is None or scan.blocked_at < stop[0]):
                self.text = self.text[: scan.blocked_at]
                return "content_filter", None
        if stop is None:
            return None
        self.text = self.text[: stop[0]]
        return "stop", stop[1]

    def blocked_alternatives(self, token_ids: list[int]) -> set[int]:
        """Those of `token_ids` whose text, had one of them come next, would complete a blocked phrase:
        the logprob alternatives a filtered answer must not show. A token's text is what `update` would
        add: decoded in context, so it completes a character whose bytes are pending and keeps a
        SentencePiece word's leading space. Per token, a decode of a few tokens and a scan of a few
        normalised characters: with top_logprobs 20, about 60 us a position on English text and 85 us on
        Russian (the logprob entries themselves, without a filter, 40 us); nothing without a filter."""
        if self.tokenizer is None or self.content_filter is None or not token_ids:
            return set()
        context = self.ids[self.prefix_offset :]
        before = len(self._decode(self.ids[self.prefix_offset : self.read_offset]))
        texts = [self._decode(context + [t])[before:].rstrip("\ufffd") for t in token_ids]
        blocked = self.content_filter.completes_phrase(self.text, texts)
        return {t for t, b in zip(token_ids, blocked) if b}

    def _find_stop(self, since: int) -> tuple[int, str] | None:
        """Where the text ends for the first stop string the new text completed, and that string."""
        if not self.stop or self.num_output_tokens < self.min_tokens:
            return None
        search_from = max(0, since - self.hold_back)
        found = [(self.text.find(s, search_from), s) for s in self.stop]
        found = [(pos, s) for pos, s in found if pos >= 0]
        if not found:
            return None
        pos, stop = min(found)
        return (pos + len(stop) if self.include_stop else pos), stop

    def flush(self) -> None:
        """At the end, emit whatever a last incomplete character left waiting."""
        if self.tokenizer is not None and self.read_offset < len(self.ids):
            prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
            self.text += self._decode(self.ids[self.prefix_offset :])[len(prefix) :]
            self.read_offset = len(self.ids)

    def take_delta(self, finished: bool) -> str:
        limit = len(self.text) - self.hold_back
        if self.safe_end is not None:
            limit = min(limit, self.safe_end)
        end = len(self.text) if finished else max(self.emitted, limit)
        delta = self.text[self.emitted : end]
        self.emitted = end
        return delta
