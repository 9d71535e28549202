"""Front end, output side: the engine core's token ids become what users see.

Per request (`RequestState`): incremental detokenization, stop strings and blocked phrases (a hit
ends the sequence here and asks the core to abort it), logprobs with their token texts, and
`RequestOutput`s whose deltas cover everything since the previous one, so a consumer that reads
late gets one output for several steps instead of a queue of them. `OutputProcessor` routes each step's
`EngineCoreOutputs` to its requests and counts what the metrics need.
"""

from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass, field

from ember.frontend.content_filter import ContentFilter
from ember.frontend.detokenizer import Finish, IncrementalDetokenizer
from ember.frontend.metrics import IterationStats
from ember.messages import EngineCoreOutput, EngineCoreOutputs, Logprobs
from ember.sampling.params import SamplingParams
from ember.tokenizer import Tokenizer

logger = logging.getLogger("ember")


@dataclass
class Logprob:
    logprob: float
    rank: int
    decoded_token: str | None = None


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


@dataclass
class RequestMetrics:
    """Per-request figures, as vLLM's `RequestOutput.metrics`: timing, and speculative decoding's drafts
    over all of the request's sequences."""

    arrival_time: float
    first_token_time: float | None = None  # time.monotonic() of the first generated token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def acceptance_rate(self) -> float | None:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None


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
    metrics: RequestMetrics | None = None
    embedding: list[float] | None = None  # a pooling request's vector, once finished ([score]: a score request)


@dataclass
class EmbeddingOutput:
    """vLLM's `EmbeddingOutput`: the pooled vector."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    """vLLM's `EmbeddingRequestOutput`, what `LLM.embed` returns per prompt."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True

    @classmethod
    def of(cls, out: RequestOutput) -> EmbeddingRequestOutput:
        return cls(out.request_id, EmbeddingOutput(_pooled(out, "an embedding")), out.prompt_token_ids, out.finished)


@dataclass
class ScoringOutput:
    """vLLM's `ScoringOutput`: one pair's score (a decoder reranker's P(true token))."""

    score: float


@dataclass
class ScoringRequestOutput:
    """vLLM's `ScoringRequestOutput`, what `LLM.score` returns per pair."""

    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]
    finished: bool = True

    @classmethod
    def of(cls, out: RequestOutput) -> ScoringRequestOutput:
        """A finished score request's output: its pooled value is the one float."""
        return cls(out.request_id, ScoringOutput(_pooled(out, "a score")[0]), out.prompt_token_ids, out.finished)


def _pooled(out: RequestOutput, what: str) -> list[float]:
    """A pooling request's vector, or the error it ended with instead."""
    if out.embedding is None:
        raise RuntimeError(f"request {out.request_id} ended without {what}: {out.error or 'aborted'}")
    return out.embedding


def child_request_id(request_id: str, index: int, n: int) -> str:
    """The engine core's id for sequence `index` of a request with `n` sequences."""
    return request_id if n == 1 else f"{request_id}#{index}"


class _Sequence:
    """One of a request's n sequences, as the front end accumulates it.

    Under a content filter, token ids and logprobs are released only as far as their text was (a
    token's decoded text in its logprobs would otherwise show a held-back phrase), a sequence the
    filter ended keeps only the tokens whose text lies wholly before the cut, and a position's logprobs
    leave out the alternatives that would have completed a blocked phrase.
    """

    def __init__(
        self,
        index: int,
        tokenizer: Tokenizer | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        content_filter: ContentFilter | None = None,
    ) -> None:
        self.index = index
        self.detok = IncrementalDetokenizer(tokenizer, prompt_token_ids, params, content_filter)
        self.filtered = content_filter is not None
        self.token_ids: list[int] = []
        self.text_ends: list[int] = []  # under a content filter: the text's length after each token
        self.logprobs: list[dict[int, Logprob]] | None = [] if params.logprobs is not None else None
        self.cumulative_logprob = 0.0
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.num_emitted = 0
        self.last_token_time: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def finish(self, reason: str, stop_reason: int | str | None = None) -> None:
        self.finish_reason, self.stop_reason = reason, stop_reason
        self.detok.flush()

    def add(
        self, token_id: int, logprobs: dict[int, Logprob] | None, logprob: float, detokenize: bool
    ) -> Finish | None:
        """Append one token; returns how its text ended the sequence (a stop string or a blocked phrase),
        if it did. A stop token (EOS or one of `stop_token_ids`) is not detokenized: its text never
        appears, as in vLLM."""
        self.token_ids.append(token_id)
        if logprobs is not None and self.logprobs is not None:
            if self.filtered and len(logprobs) > 1:
                logprobs = self._without_blocked_alternatives(token_id, logprobs)
            self.logprobs.append(logprobs)
            self.cumulative_logprob += logprob
        finish = self.detok.update(token_id) if detokenize else None
        if finish is not None and finish[0] == "content_filter":
            self._keep_tokens(self._tokens_within(len(self.detok.text)))
        elif self.filtered:
            self.text_ends.append(len(self.detok.text))
        return finish

    def _without_blocked_alternatives(self, token_id: int, logprobs: dict[int, Logprob]) -> dict[int, Logprob]:
        """This position's logprobs less the alternatives whose text, after the text so far, would hold a
        blocked phrase (the detokenizer's `blocked_alternatives`). The chosen token needs no check: its
        entry is kept only while its text lies before any cut."""
        dropped = self.detok.blocked_alternatives([t for t in logprobs if t != token_id])
        return {t: lp for t, lp in logprobs.items() if t not in dropped} if dropped else logprobs

    def _tokens_within(self, end: int) -> int:
        """How many tokens have all their text in `text[:end]`: up to the one that reached `end`, not the
        pieces of a character after it (a byte of it would show in chat logprobs' `bytes`)."""
        count = bisect.bisect_left(self.text_ends, end)
        return count + 1 if end > 0 and count < len(self.text_ends) and self.text_ends[count] == end else count

    def _logprobs_within(self, visible: int) -> list[dict[int, Logprob]] | None:
        """The released tokens' logprobs; the list itself when all are released (no copy per output
        of a long stream: only a content filter holds tokens back)."""
        if self.logprobs is None or visible == len(self.logprobs):
            return self.logprobs
        return self.logprobs[:visible]

    def _keep_tokens(self, count: int) -> None:
        del self.token_ids[count:]
        if self.logprobs is not None:
            del self.logprobs[count:]
            self.cumulative_logprob = sum(next(iter(d.values())).logprob for d in self.logprobs)

    def output(self) -> CompletionOutput:
        finished = self.finished
        text = self.detok.text if finished else self.detok.text[: self.detok.emitted]
        delta_text = self.detok.take_delta(finished)
        visible = len(self.token_ids)
        if self.filtered and not finished:
            visible = self._tokens_within(self.detok.emitted)
        delta_tokens = self.token_ids[self.num_emitted : visible]
        self.num_emitted = max(self.num_emitted, visible)
        return CompletionOutput(
            index=self.index,
            text=text,
            token_ids=self.token_ids[:visible],
            cumulative_logprob=self.cumulative_logprob if self.logprobs is not None else None,
            logprobs=self._logprobs_within(visible),
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            delta_text=delta_text,
            delta_token_ids=delta_tokens,
        )


class RequestState:
    """A request between its arrival and its final output: n sequences, prompt logprobs, timings."""

    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        tokenizer: Tokenizer | None,
        arrival_time: float,
        content_filter: ContentFilter | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.tokenizer = tokenizer
        self.arrival_time = arrival_time
        self.seqs = [_Sequence(i, tokenizer, prompt_token_ids, params, content_filter) for i in range(params.n)]
        self.prompt_logprobs: list[dict[int, Logprob] | None] | None = (
            [None] if params.prompt_logprobs is not None else None
        )
        self.num_cached_tokens = 0
        self.error: str | None = None
        self.first_token_time: float | None = None
        self.num_draft_tokens = self.num_accepted_tokens = 0
        self.embedding: list[float] | None = None

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.seqs)

    def child_ids(self, unfinished_only: bool = False) -> list[str]:
        n = len(self.seqs)
        return [
            child_request_id(self.request_id, s.index, n) for s in self.seqs if not (unfinished_only and s.finished)
        ]

    def abort(self, error: str | None = None) -> None:
        """End every unfinished sequence (client gone, core failure); `error` marks a failure."""
        if error is not None and self.error is None:
            self.error = error
        for s in self.seqs:
            if not s.finished:
                s.finish("abort")

    def output(self) -> RequestOutput:
        """Everything since the previous output, as one RequestOutput."""
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[s.output() for s in self.seqs],
            finished=self.finished,
            num_cached_tokens=self.num_cached_tokens,
            error=self.error,
            prompt_logprobs=self.prompt_logprobs,
            metrics=RequestMetrics(
                self.arrival_time, self.first_token_time, self.num_draft_tokens, self.num_accepted_tokens
            ),
            embedding=self.embedding,
        )

    def update(self, seq: _Sequence, out: EngineCoreOutput, now: float, stats: IterationStats) -> bool:
        """Apply one core output to one sequence; True when its text hit a stop string or a blocked phrase
        (the core must then abort it)."""
        self.num_cached_tokens = max(self.num_cached_tokens, out.num_cached_tokens)
        self.num_draft_tokens += out.num_draft_tokens
        self.num_accepted_tokens += out.num_accepted_tokens
        if out.embedding is not None:
            self.embedding = out.embedding
        if out.new_prompt_logprobs is not None and self.prompt_logprobs is not None:
            self.prompt_logprobs += self._logprob_dicts(out.new_prompt_logprobs)
        if out.new_token_ids:
            self._count_tokens(seq, len(out.new_token_ids), now, stats)
        logprobs = self._logprob_dicts(out.new_logprobs) if out.new_logprobs is not None else None
        last = len(out.new_token_ids) - 1
        for i, token in enumerate(out.new_token_ids):
            lp = out.new_logprobs.logprobs[i][0] if out.new_logprobs is not None else 0.0
            finish = seq.add(
                token,
                logprobs[i] if logprobs is not None else None,
                lp,
                detokenize=not (i == last and out.finish_reason == "stop"),
            )
            if finish is not None:
                seq.finish(*finish)
                return out.finish_reason is None
        if out.error is not None:
            self.error = out.error
        if out.finish_reason is not None:
            seq.finish(out.finish_reason, out.stop_reason)
        return False

    def _count_tokens(self, seq: _Sequence, count: int, now: float, stats: IterationStats) -> None:
        stats.num_generation_tokens += count
        if self.first_token_time is None:
            self.first_token_time = now
            stats.ttfts.append(now - self.arrival_time)
            stats.num_prompt_tokens += len(self.prompt_token_ids)
        elif seq.last_token_time is not None:
            stats.itls.append(now - seq.last_token_time)
        seq.last_token_time = now

    def _logprob_dicts(self, lps: Logprobs) -> list[dict[int, Logprob]]:
        return [
            _logprob_dict(self.tokenizer, ids, values, rank)
            for ids, values, rank in zip(lps.token_ids, lps.logprobs, lps.ranks)
        ]


def _logprob_dict(
    tokenizer: Tokenizer | None, ids: list[int], values: list[float], chosen_rank: int
) -> dict[int, Logprob]:
    """vLLM's shape: the chosen token (first) and the top-N, each with its rank by logprob."""

    def text(tid: int) -> str | None:
        return tokenizer.decode([tid], skip_special_tokens=False) if tokenizer else None

    out = {ids[0]: Logprob(values[0], chosen_rank, text(ids[0]))}
    for rank, (tid, lp) in enumerate(zip(ids[1:], values[1:]), start=1):
        out.setdefault(tid, Logprob(lp, rank, text(tid)))
    return out


@dataclass
class ProcessedOutputs:
    changed: list[RequestState]  # requests with something new, in the order their outputs came
    to_abort: list[str]  # core request ids whose text hit a stop string or a blocked phrase
    stats: IterationStats


class OutputProcessor:
    def __init__(self) -> None:
        self.requests: dict[str, RequestState] = {}
        self._children: dict[str, tuple[RequestState, _Sequence]] = {}

    def add(self, state: RequestState) -> None:
        if state.request_id in self.requests:
            raise ValueError(f"request_id {state.request_id!r} is already in use")
        self.requests[state.request_id] = state
        for child_id, seq in zip(state.child_ids(), state.seqs):
            self._children[child_id] = (state, seq)

    def abort(
        self, request_id: str, now: float, error: str | None = None
    ) -> tuple[RequestState | None, list[str], IterationStats]:
        """End a request here; returns it, the core ids the core must abort, and the sequences it ended."""
        stats = IterationStats()
        state = self.requests.pop(request_id, None)
        if state is None:
            return None, [], stats
        running = state.child_ids(unfinished_only=True)
        for child_id in state.child_ids():
            self._children.pop(child_id, None)
        state.abort(error)
        stats.finished += [("abort", now - state.arrival_time)] * len(running)
        return state, running, stats

    def process(self, outputs: EngineCoreOutputs) -> ProcessedOutputs:
        stats = IterationStats()
        changed: dict[str, RequestState] = {}
        to_abort: list[str] = []
        for out in outputs.outputs:
            entry = self._children.get(out.request_id)
            if entry is None:  # aborted here while the core was still stepping it
                continue
            state, seq = entry
            changed[state.request_id] = state
            try:
                if state.update(seq, out, outputs.timestamp, stats):
                    to_abort.append(out.request_id)
            except Exception as e:  # one request's output failed: fail only that request
                logger.exception("request %s failed while processing its output", state.request_id)
                _, running, ended = self.abort(state.request_id, outputs.timestamp, f"{type(e).__name__}: {e}")
                to_abort += running
                stats.finished += ended.finished
                continue
            if seq.finished:
                assert seq.finish_reason is not None  # what `finished` means
                del self._children[out.request_id]
                stats.finished.append((seq.finish_reason, outputs.timestamp - state.arrival_time))
                if state.finished:
                    del self.requests[state.request_id]
        return ProcessedOutputs(list(changed.values()), to_abort, stats)
