"""From sampled token ids to what users see: text deltas, stop handling, `RequestOutput`s."""

from __future__ import annotations

from dataclasses import dataclass, field

from ember.engine.request import Logprob, Request, RequestStatus
from ember.sampling.params import SamplingParams
from ember.tokenizer import Tokenizer

# Prompt tokens decoded ahead of the output so leading spaces and merges render as in the full text.
_CONTEXT_TOKENS = 6


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    error: str | None = None  # set when the request failed inside the engine (finish_reason is then "abort")
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # None for the first prompt token


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


def check_stop_token(request: Request, token_id: int, max_model_len: int) -> RequestStatus | None:
    """Finish conditions that depend only on the token just sampled and the lengths."""
    params = request.sampling_params
    if request.num_output_tokens >= params.min_tokens:
        if not params.ignore_eos and token_id in request.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if token_id in params.stop_token_ids:
            request.stop_reason = token_id
            return RequestStatus.FINISHED_STOPPED
    if request.num_output_tokens >= request.max_tokens or request.num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH
    return None


def make_logprobs(tokenizer: Tokenizer | None, pairs: list[tuple[int, float]], sampled_rank: int
                  ) -> dict[int, Logprob]:
    """vLLM's shape: the sampled token (first pair) and the top-N, each with its rank by logprob."""
    def text(tid: int) -> str | None:
        return tokenizer.decode([tid], skip_special_tokens=False) if tokenizer else None

    sampled_id, sampled_lp = pairs[0]
    out = {sampled_id: Logprob(sampled_lp, sampled_rank, text(sampled_id))}
    for rank, (tid, lp) in enumerate(pairs[1:], start=1):
        out.setdefault(tid, Logprob(lp, rank, text(tid)))
    return out
