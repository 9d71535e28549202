"""A step with grammar masks is left open while its masks are filled: the runner queues its sampling
only once they are in, after the next step's inputs are prepared, and the core reads what the mask
thread fed the matchers only once it has fed them."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import Future
from dataclasses import replace

import jsonschema
import numpy as np
import pytest
import torch
from conftest import DEVICE, inproc_core
from schemas import SCHEMAS

from ember import LLM, SamplingParams, StructuredOutputsParams
from ember.core.grammar import GrammarManager
from ember.runner import model_runner
from ember.runner.warmup import warm_up_batches


def _only(tokens: list[int], vocab_size: int) -> torch.Tensor:
    """A bitmask allowing exactly one token per row."""
    words = np.zeros((len(tokens), (vocab_size + 31) // 32), dtype=np.uint32)
    for row, token in enumerate(tokens):
        words[row, token // 32] = np.uint32(1 << (token % 32))
    return torch.from_numpy(words.view(np.int32))


def _in_thread(fn) -> tuple[threading.Thread, list]:
    result: list = []
    thread = threading.Thread(target=lambda: result.append(fn()), daemon=True)
    thread.start()
    return thread, result


def test_masked_step_samples_once_its_masks_arrive_and_next_launch_prepares_first(llama_dir, monkeypatch):
    llm = LLM(str(llama_dir), device=DEVICE, dtype="float32", kv_cache_memory=0.05, engine_process=False)
    runner = inproc_core(llm).runner
    vocab = runner.model_config.vocab_size
    first, second = warm_up_batches(16, runner.kv_cache.num_blocks, 256, 2048, 512)[:2]
    free = [t for (t,) in runner.wait(runner.launch(first)).token_ids]  # one token per row without drafts
    forced = [(t + 1 + row) % vocab for row, t in enumerate(free)]  # never what the model picks itself

    masks: Future[torch.Tensor] = Future()
    pending = runner.launch(first, lambda requests: masks)  # returns with the masks still being filled
    waiter, result = _in_thread(lambda: runner.wait(pending))
    time.sleep(0.2)
    assert waiter.is_alive(), "the step sampled before its masks arrived"
    masks.set_result(_only(forced, vocab))
    waiter.join(30)
    assert result[0].token_ids == [[t] for t in forced]

    masks = Future()
    pending = runner.launch(first, lambda requests: masks)
    prepared_while_filling = []
    prepare = model_runner.prepare_step
    monkeypatch.setattr(
        model_runner,
        "prepare_step",
        lambda *a, **k: prepared_while_filling.append(not masks.done()) or prepare(*a, **k),
    )
    launcher, launched = _in_thread(lambda: runner.launch(second))
    time.sleep(0.2)
    assert prepared_while_filling == [True] and launcher.is_alive(), "the next step waited for the masks first"
    masks.set_result(_only(forced, vocab))
    launcher.join(30)
    assert runner.wait(pending).token_ids == [[t] for t in forced]
    assert len(runner.wait(launched[0]).token_ids) == len(second)

    # top-p renormalises over the allowed tokens: all of such a step's sampling waits for the mask
    top_p = SamplingParams(temperature=1.0, top_p=0.5, seed=7)
    filtered = replace(first, new_requests=[replace(r, sampling_params=top_p) for r in first.new_requests])
    masks = Future()
    pending = runner.launch(filtered, lambda requests: masks)
    masks.set_result(_only(forced, vocab))
    assert runner.wait(pending).token_ids == [[t] for t in forced]

    masks = Future()
    pending = runner.launch(first, lambda requests: masks)
    masks.set_exception(RuntimeError("the fill failed"))
    with pytest.raises(RuntimeError, match="the fill failed"):  # the step's failure, raised where it is collected
        runner.wait(pending)
    assert runner.wait(runner.launch(first)).token_ids == [[t] for t in free]


def test_core_reads_the_mask_threads_feeding_only_once_done(monkeypatch):
    """Async scheduling: the mask thread feeds each late token while the core collects the step that
    sampled it. A slow feed must not make the core feed the token a second time (or touch a matcher
    that the mask thread holds): every output still validates."""
    consume_all = GrammarManager.consume_all

    def slow(self, pairs):
        time.sleep(0.02)
        return consume_all(self, pairs)

    monkeypatch.setattr(GrammarManager, "consume_all", slow)
    llm = LLM(
        kv_cache_memory=0.25,
        max_model_len=1024,
        device=DEVICE,
        dtype="float32",
        engine_process=False,
        async_scheduling=True,
    )
    schemas = [SCHEMAS[i] for i in (0, 6, 11, 13)]
    params = [
        SamplingParams(temperature=0, max_tokens=64, structured_outputs=StructuredOutputsParams(json=s))
        for s in schemas
    ]
    outs = llm.generate([f"Item {i} as JSON:" for i in range(len(schemas))], params, use_tqdm=False)
    for out, schema in zip(outs, schemas):
        assert out.outputs[0].finish_reason == "stop", out.outputs[0]
        jsonschema.validate(json.loads(out.outputs[0].text), schema)
