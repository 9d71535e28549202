"""The core's grammar side (`GrammarManager`): the per-process vocabulary cache and a step's bitmask, whose
constrained rows are llguidance's own masks and whose free rows allow every token."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from schemas import SCHEMAS

from ember.config import EngineArgs
from ember.core import grammar
from ember.core.grammar import GrammarManager
from ember.runner.step_timer import StepTimer
from ember.sampling.structured import StructuredOutputsParams


@pytest.fixture(scope="module")
def manager(default_tokenizer):
    m = GrammarManager(EngineArgs().load_config(), default_tokenizer.vocab_size)
    yield m
    m.shutdown()


def test_vocabulary_is_built_once_per_tokenizer_file(tmp_path, default_tokenizer):
    default_tokenizer.tok.save(str(tmp_path / "tokenizer.json"))
    load, vocab = EngineArgs(tokenizer=str(tmp_path)).load_config(), default_tokenizer.vocab_size
    first = grammar._ll_tokenizer(load, vocab)
    assert grammar._ll_tokenizer(load, vocab) is first
    assert grammar._ll_tokenizer(load, vocab + 32) is not first  # another logits width: another vocabulary
    stat = os.stat(tmp_path / "tokenizer.json")
    os.utime(tmp_path / "tokenizer.json", ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # the file changed
    assert grammar._ll_tokenizer(load, vocab) is not first


def test_tokenizer_dir_takes_the_models_eos_from_its_config(tmp_path, default_tokenizer):
    """A config-only model (`--load-format dummy`) with `--tokenizer DIR`: the EOS ids come from the
    model's config.json, as far as the tokenizer has them, and grammars get a vocabulary from them (an
    empty EOS list once aborted every structured request of such a model)."""
    from ember.model.files import load_model_info

    model, tok = tmp_path / "model", tmp_path / "tok"
    model.mkdir(), tok.mkdir()
    eos = default_tokenizer.eos_token_ids[0]
    (model / "config.json").write_text(json.dumps({"eos_token_id": [eos, 10**6]}))
    default_tokenizer.tok.save(str(tok / "tokenizer.json"))
    load = EngineArgs(model=str(model), load_format="dummy", tokenizer=str(tok)).load_config()
    assert load_model_info(load).eos_token_ids == [eos]  # 10**6 is past this vocabulary: dropped
    grammar._ll_tokenizer(load, default_tokenizer.vocab_size)
    no_tokenizer = EngineArgs(model=str(model), load_format="dummy").load_config()
    assert load_model_info(no_tokenizer).eos_token_ids == [eos, 10**6]


def test_missing_tokenizer_is_the_requests_error_not_cached(tmp_path):
    load = EngineArgs(tokenizer=str(tmp_path)).load_config()  # no tokenizer.json there
    for _ in range(2):
        with pytest.raises(ValueError, match="structured_outputs: no vocabulary"):
            grammar._ll_tokenizer(load, 100)


def test_step_bitmask_rows(manager, default_tokenizer):
    """Free rows allow everything; constrained rows, fresh, part-way, finished or failed, hold exactly
    what the matcher's own mask says."""
    fresh = manager.matcher(StructuredOutputsParams(json=SCHEMAS[0]))
    partway = manager.matcher(StructuredOutputsParams(json=SCHEMAS[0]))
    for token in default_tokenizer.encode('{"', add_special_tokens=False):
        assert partway.consume_token(token)
    done = manager.matcher(StructuredOutputsParams(choice=["yes", "no"]))
    for token in default_tokenizer.encode("yes", add_special_tokens=False):
        assert done.consume_token(token)
    failed = manager.matcher(StructuredOutputsParams(choice=["yes", "no"]))
    failed.consume_token(default_tokenizer.encode("maybe", add_special_tokens=False)[0])
    assert done.is_accepting() and failed.is_error()
    rows = [None, fresh, None, partway, done, failed, None]
    bitmask = manager.start_masks(rows).bitmask.result().numpy()
    words = bitmask.shape[1]
    for row, matcher in enumerate(rows):
        expected = (
            np.full(words, -1, np.int32)
            if matcher is None
            else np.frombuffer(matcher.compute_bitmask(), np.int32)[:words]
        )
        assert np.array_equal(bitmask[row], expected), row
    assert manager.start_masks([None, None]) is None


class _At:
    """A completed CUDA event's stand-in: a time in ms on the GPU's clock."""

    def __init__(self, ms: float) -> None:
        self.ms = ms

    def elapsed_time(self, later: _At) -> float:
        return later.ms - self.ms


def test_step_timer_counts_the_gpus_wait_for_masks():
    """Idle between steps, busy within them, and the part of busy spent waiting for the masks (zero when
    they came before the forward ended)."""
    timer = StepTimer()
    timer.finished(_At(0), _At(10), (_At(6), _At(8.5)))  # the masks came 2.5 ms after the forward
    timer.finished(_At(12), _At(20), (_At(15), _At(15)))  # ready in time
    timer.finished(_At(20), _At(25))  # no constrained request
    assert (timer.busy_s, timer.idle_s, timer.mask_wait_s) == pytest.approx((0.023, 0.002, 0.0025))
