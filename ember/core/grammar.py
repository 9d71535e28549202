"""The engine core's side of structured output: llguidance matchers and the per-step token masks.

`GrammarManager` builds llguidance's view of the vocabulary when the first constrained request
arrives (a core that never gets one never builds a tokenizer), from what loading the weights read
(`ModelFiles.model_info`: the GGUF vocabulary or config.json, so no file is parsed twice; see
`GrammarManager` for the cost). The vocabulary is kept per process, keyed by the files it came from,
so a second core on the same model (tests, benchmarks, a restarted `LLM`) gets it at once. Each
distinct grammar is compiled once and every request gets a copy of the compiled matcher
(`LLMatcher.deep_copy`, far cheaper than compiling).

Masks: a step's bitmask (one bit per vocabulary entry, int32 words, llguidance's layout) is filled
by llguidance's own thread pool (`LLExecutor`, no GIL) from a worker thread started before the
model's forward, so on a GPU it overlaps the queued forward and on the CPU torch's kernels (which
release the GIL too). Under async scheduling the mask of step N+1 needs step N's token while step N
may still run: the worker first waits for step N's end (`before`, given by the core), feeds its
tokens to the matchers (`MaskFill.fed`), then fills the masks, all while the GPU runs N+1's forward
and the core collects step N and prepares N+2; only sampling waits for the mask (the model runner
leaves the step open until then). So constrained requests keep two steps in flight instead of
making the core step one at a time as penalties do.
"""

from __future__ import annotations

import functools
import os
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ember.config import LoadConfig
from ember.model.files import ModelInfo, load_model_info, model_path
from ember.sampling.structured import (
    GRAMMAR_FAILED,
    StructuredOutputsParams,
    grammar_source,
    ll_vocabulary,
    matcher_error,
    new_matcher,
)

if TYPE_CHECKING:
    import llguidance

MAX_COMPILED = 512  # distinct grammars kept compiled (LRU); one is tens of KiB to a few MiB
MAX_VOCABULARIES = 4  # llguidance vocabularies kept per process (LRU); tens of MiB for a 152k vocabulary

_vocabularies: OrderedDict[tuple, llguidance.LLTokenizer] = OrderedDict()
_vocabularies_lock = threading.Lock()


def _ll_tokenizer(
    load: LoadConfig, vocab_size: int, model_info: Callable[[], ModelInfo] | None = None
) -> llguidance.LLTokenizer:
    """llguidance's vocabulary, from this process's cache when the same files gave it before, else from
    `model_info`'s tokenizer (by default, read from the model's files)."""
    key = _vocabulary_key(load, vocab_size)
    with _vocabularies_lock:
        cached = _vocabularies.get(key) if key is not None else None
        if cached is not None and key is not None:
            _vocabularies.move_to_end(key)
            return cached
    tokenizer = _build_ll_tokenizer(model_info or functools.partial(load_model_info, load), vocab_size)
    if key is not None:
        with _vocabularies_lock:
            _vocabularies[key] = tokenizer
            if len(_vocabularies) > MAX_VOCABULARIES:
                _vocabularies.popitem(last=False)
    return tokenizer


def _vocabulary_key(load: LoadConfig, vocab_size: int) -> tuple | None:
    """What the vocabulary is built from: the model (its EOS ids), the tokenizer file as it is now (path,
    size, modification time) and the logits' width; None when that file cannot be found (no caching:
    the build then says what is missing)."""
    try:
        path, _ = model_path(load)
        source = load.tokenizer or path
        file = os.path.join(source, "tokenizer.json") if os.path.isdir(source) else source
        stat = os.stat(file)
    except (OSError, ValueError):
        return None
    return os.path.realpath(path), os.path.realpath(file), stat.st_size, stat.st_mtime_ns, vocab_size


def _build_ll_tokenizer(model_info: Callable[[], ModelInfo], vocab_size: int) -> llguidance.LLTokenizer:
    """A ValueError (the request's failure, never the core's) when the model has no usable tokenizer."""
    try:
        tokenizer = model_info().tokenizer
        if tokenizer is None:
            raise ValueError("this model was loaded without a tokenizer")
        return ll_vocabulary(tokenizer, vocab_size)
    except Exception as e:
        raise ValueError(f"structured_outputs: no vocabulary for grammars ({e})") from e


@dataclass
class MaskFill:
    """A step's bitmask, being filled by the mask thread. `fed` is done once the late tokens have been
    fed to their matchers (`start_masks`' `before`): only then may the core read what feeding them
    gave, and it must not touch those matchers at all until `bitmask` is done (llguidance raises
    "Already mutably borrowed" for a matcher another thread is filling)."""

    fed: Future[torch.Tensor]
    bitmask: Future[torch.Tensor]


class GrammarManager:
    """The vocabulary is built for the first constrained request, not at start: a core that never gets
    one saves the build (the core's CPU time to 3 s after /health 200 fell from 2.4-2.5 s to 2.0-2.1 s,
    default model on CPU), and that request waits for it instead (0.28 s at load 4.6 on 2 cores).

    `model_info` builds the tokenizer from what the core read with the weights (`ModelFiles.model_info`):
    for a GGUF file, the vocabulary it kept, which measured cheaper than reading the file once more:
    0.28 s against 0.32 s for tokenizer and vocabulary (medians of 5, 2026-12-05). The vocabulary's
    strings are kept as the file's bytes until then (`gguf_reader.StringArray`: 1.5 MiB instead of
    8.5 MiB of strings), so this first build also decodes them. Without it (tests, benchmarks) the
    model's files are read again. llguidance itself is imported with the first grammar too."""

    def __init__(self, load: LoadConfig, vocab_size: int, model_info: Callable[[], ModelInfo] | None = None) -> None:
        self.vocab_size = vocab_size
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="ember-grammar")
        self._build_vocabulary = functools.partial(_ll_tokenizer, load, vocab_size, model_info)
        self._vocabulary_built: Future[llguidance.LLTokenizer] | None = None
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()

    def matcher(self, params: StructuredOutputsParams) -> llguidance.LLMatcher:
        """A fresh matcher for a request; a ValueError when its grammar cannot be compiled.

        Copies of one compiled matcher share its lexer behind a lock held for a whole mask (llguidance's
        `deep_copy` clones the matcher, not the lexer), so one grammar's masks fill one at a time however
        many threads the pool has. Compiling a matcher per request of a grammar instead (up to the
        pool's size) was tried and not kept: every compiled matcher's lexer starts cold, and at 256
        requests over the 20 test schemas on 2 cores with 2 mask threads the first 64 steps took 184-198
        ms of mask fill against 141-142 with one compile per grammar; warm, 127 and 166 against 157 and
        155 (2026-12-07). One hot grammar still fills its masks on one thread at a time."""
        source = grammar_source(params)
        compiled = self._compiled.get(source)
        if compiled is None:
            compiled = new_matcher(self._vocabulary(), source)
            if compiled.is_error():
                raise ValueError(f"structured_outputs.{params.kind}: {matcher_error(compiled)}")
            self._compiled[source] = compiled
            if len(self._compiled) > MAX_COMPILED:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(source)
        return compiled.deep_copy()

    @functools.cached_property
    def _executor(self) -> llguidance.LLExecutor:
        """llguidance's thread pool, started with the first mask (llguidance is imported no sooner)."""
        import llguidance

        return llguidance.LLExecutor()

    def _vocabulary(self) -> llguidance.LLTokenizer:
        """The vocabulary, built by the first call in the mask thread (idle until the first constrained
        request) and kept, or its failure kept: every later request gets the same ValueError."""
        if self._vocabulary_built is None:
            self._vocabulary_built = self._worker.submit(self._build_vocabulary)
        return self._vocabulary_built.result()

    def start_masks(
        self,
        matchers: list[llguidance.LLMatcher | None],
        before: Callable[[], None] | None = None,
        drafts: list[list[int]] | None = None,
    ) -> MaskFill | None:
        """Start filling the bitmask rows of a batch (all ones where a request has no matcher), after
        running `before` (which feeds the late tokens) in the same worker thread; None when no row is
        constrained. A request has one row, and one more after each of its `drafts` (speculative
        decoding: llguidance computes the mask after each draft and leaves the matcher as it was)."""
        drafts = drafts or [[] for _ in matchers]
        first = [0]
        for d in drafts:
            first.append(first[-1] + 1 + len(d))
        rows = [(m, first[i], drafts[i]) for i, m in enumerate(matchers) if m is not None]
        if not rows:
            return None
        constrained = {r + j for _, r, d in rows for j in range(1 + len(d))}
        fed = self._worker.submit(self._prepare, constrained, first[-1], before)
        return MaskFill(fed, self._worker.submit(self._fill, rows, fed))

    def _prepare(self, constrained: set[int], num_rows: int, before: Callable[[], None] | None) -> torch.Tensor:
        words = (self.vocab_size + 31) // 32
        # llguidance writes every row it is given (stopped and failed matchers included), so only the
        # free rows need filling: at 256 constrained rows of a 152k vocabulary that skips 4.9 MB per step.
        # Through numpy: torch's indexed fill took 7.3-7.7 ms for a step's free rows and left its thread
        # pool spinning, which made the mask fill after it 2.6x slower (numpy: 0.05 ms; 2 cores, 2026-12-07).
        bitmask = torch.empty((num_rows, words), dtype=torch.int32, pin_memory=torch.cuda.is_available())
        if len(constrained) < num_rows:
            bitmask.numpy()[[i for i in range(num_rows) if i not in constrained]] = -1
        if before is not None:
            before()
        return bitmask

    def _fill(
        self, rows: list[tuple[llguidance.LLMatcher, int, list[int]]], prepared: Future[torch.Tensor]
    ) -> torch.Tensor:
        bitmask = prepared.result()  # its failure (the late tokens could not be read) is the fill's too
        ptr, row_bytes, num_rows = bitmask.data_ptr(), bitmask.shape[1] * 4, bitmask.shape[0]
        drafted = [row for row in rows if row[2]]  # llguidance refuses an empty draft list
        if drafted:
            self._executor.unsafe_compute_mask_ptr_with_draft_token(drafted, ptr, row_bytes, num_rows)
        if len(drafted) < len(rows):
            plain = [(m, r) for m, r, d in rows if not d]
            self._executor.unsafe_compute_mask_ptr(plain, ptr, row_bytes, num_rows)
        return bitmask

    def consume_all(self, pairs: list[tuple[llguidance.LLMatcher, int]]) -> list[str | None]:
        """Feed one token to each matcher, in llguidance's thread pool without the GIL; each matcher's
        error text after it (None while it can go on), as `consume` gives it. The Python loop of
        `consume` calls it replaces held the GIL for ~0.6 ms per step at 256 JSON-schema requests in
        the mask thread, while the main thread needed it to launch the step."""
        if pairs:
            self._executor.consume_token_par(pairs)
        return [_failure(matcher, token) for matcher, token in pairs]

    def shutdown(self) -> None:
        self._worker.shutdown(wait=False, cancel_futures=True)


def consume(matcher: llguidance.LLMatcher, token: int) -> str | None:
    """Feed a sampled token; the error text when the grammar cannot continue (a dead end, or a token
    that slipped past the mask). A matcher in error stays so: feeding it again repeats the error."""
    return _failure(matcher, token, matcher.consume_token(token))


def _failure(matcher: llguidance.LLMatcher, token: int, accepted: bool = True) -> str | None:
    if accepted and not matcher.is_error():
        return None
    return f"{GRAMMAR_FAILED}: {matcher_error(matcher) or f'token {token} is not allowed'}"
