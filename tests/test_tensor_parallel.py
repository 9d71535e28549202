"""Tensor parallelism on CPU over gloo: TP=2 gives the same greedy tokens as TP=1 (and logprobs
within float32 rounding of a different summation order), for every architecture, GQA with fewer KV
heads than ranks, a vocabulary that does not split evenly, and GGUF weights kept quantized. Also:
a rank that dies ends the engine with a clear error, and shutdown ends every worker process."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
import torch
from conftest import ARCHS, inproc_core, make_checkpoint
from gguf import GGMLQuantizationType as QType
from test_gguf import _write_tiny
from test_server_robustness import _start_serve

from ember import LLM, SamplingParams
from ember.frontend.errors import EngineDeadError
from ember.model.hf_config import ModelConfig
from ember.model.sharding import ShardLayout
from ember.quant.formats import dequantize
from ember.quant.quantize import QUANTIZERS

PROMPTS = ["The quick brown fox jumps", "Paris is the capital of", "def add(a, b):\n", "你好，世界"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=1)


def _llm(model: str, tp: int, **kwargs) -> LLM:
    return LLM(
        model,
        tensor_parallel_size=tp,
        device="cpu",
        dtype="float32",
        kv_cache_memory=0.02,
        max_model_len=256,
        seed=0,
        **kwargs,
    )


def _greedy(model: str, tp: int) -> tuple[list[list[int]], list[list[float]]]:
    llm = _llm(model, tp)
    try:
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()
    tokens = [o.outputs[0].token_ids for o in outs]
    logprobs = [[lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)] for o in outs]
    return tokens, logprobs


# Logprob tolerance where int8 (GGUF Q8_0) layers run on CPU: with AVX512_BF16 they take bf16 arithmetic
# (x rounded to bf16, ember/ops/linear_native.py CPU_INT8_BF16), so the ranks' float32 summation order can
# move an activation by one bf16 step, ~4e-3 in a logprob (Phi-4-mini-like Q8_0, 2026-12-07). The tokens
# must still agree; the workers are spawned processes, so the arithmetic cannot be switched per test.
BF16_INT8_TOL = 1e-2


def _assert_same(model: str, tol: float = 1e-4) -> None:
    tokens1, lps1 = _greedy(model, 1)
    tokens2, lps2 = _greedy(model, 2)
    assert tokens2 == tokens1
    for a, b in zip(lps1, lps2):
        assert all(math.isclose(x, y, rel_tol=tol, abs_tol=tol) for x, y in zip(a, b)), (a, b)


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_tp2_matches_tp1(checkpoints, arch):
    _assert_same(str(checkpoints[arch]))


def test_tp2_fewer_kv_heads_than_ranks_and_uneven_vocab(tmp_path):
    """One KV head (replicated on both ranks) and 509 tokens (ranks hold 255 + 254 real rows)."""
    path = make_checkpoint(tmp_path / "mqa", "llama", num_key_value_heads=1, vocab_size=509)
    layout = ShardLayout.of(ModelConfig.from_hf_config(json.loads((path / "config.json").read_text())), rank=1, size=2)
    assert (layout.num_kv_heads, layout.kv_head_start, layout.vocab_rows) == (1, 0, 254)
    _assert_same(str(path))


def test_tp2_gguf_kept_quantized(tmp_path):
    """Quantized tensors split by rows (the Q8_0 embedding, Q4_0 q_proj, Q4_1 gate_proj) and by whole
    blocks of columns (Q8_0 down_proj, two blocks per rank).

    Not a row-parallel layer with one block per rank: on CPU, one int8 group per row takes the
    per-channel int8 kernel, which rounds activations to bf16, so TP=1 and TP=2 would differ by
    that rounding rather than by float32 summation order. Splitting columns is checked exactly below."""
    path = str(tmp_path / "tiny.gguf")
    _write_tiny(
        path,
        tensor_types={
            "blk.0.attn_q.weight": QType.Q4_0,
            "blk.1.ffn_gate.weight": QType.Q4_1,
            "blk.1.ffn_down.weight": QType.Q8_0,
        },
    )
    _assert_same(path, BF16_INT8_TOL)


def test_tp2_gguf_quantized_tied_head_with_an_odd_vocabulary(tmp_path):
    """269 tokens: the last rank's Q8_0 embedding / tied head holds a row fewer than the first's, so its
    logits are padded to the common width before the gather. (Only the vocabulary layers are quantized
    here: with int4 layers too, their bf16 activations turn float32 summation-order differences into
    logprob differences of ~1e-3.)"""
    path = str(tmp_path / "odd.gguf")
    _write_tiny(path, extra_tokens=("<extra>",))
    _assert_same(path)


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_quantized_weight_splits_exactly_on_group_boundaries(kind):
    """int4: groups of 128 (a split at 128 keeps whole groups and whole bytes); int8: one group per row,
    so only rows split (a GGUF's Q8_0 blocks of 32 columns split like int4's groups)."""
    w = QUANTIZERS[kind](torch.randn(48, 384))
    splits = [(0, 16, 16)] + ([(1, 128, 256), (1, 0, 128)] if kind == "int4" else [])
    for dim, start, length in splits:
        part = w.narrow(dim, start, length)
        assert torch.equal(dequantize(part), dequantize(w).narrow(dim, start, length))
    with pytest.raises(ValueError, match="splits on group boundaries"):
        w.narrow(1, 64, 192)


def test_model_that_does_not_split_is_rejected_before_any_process_starts(checkpoints):
    with pytest.raises(ValueError, match=r"tensor_parallel_size 3 does not divide .*num_attention_heads \(4\)"):
        _llm(str(checkpoints["llama"]), 3)


def test_shutdown_ends_workers_and_a_dead_rank_is_a_clear_error(checkpoints):
    llm = _llm(str(checkpoints["llama"]), 2, engine_process=False)  # white-box: the core's TP group here
    group = inproc_core(llm).tensor_parallel
    (worker,) = group._procs
    assert worker.is_alive()
    os.kill(worker.pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(EngineDeadError, match=r"tensor-parallel rank 1 \(pid \d+\) exited with code -9"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert time.monotonic() - start < 30
    llm.llm_engine.shutdown()
    assert not worker.is_alive()

    threads = torch.get_num_threads()
    llm = _llm(str(checkpoints["llama"]), 2, engine_process=False)
    (worker,) = inproc_core(llm).tensor_parallel._procs
    assert len(llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == GREEDY.max_tokens
    llm.llm_engine.shutdown()
    assert worker.exitcode == 0  # told to stop, it stopped by itself
    assert torch.get_num_threads() == threads  # the cores shared with the worker are given back


def _descendants(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        children = [int(p) for p in f.read().split()]
    return children + [d for c in children for d in _descendants(c)]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_server_with_tp2_answers_like_tp1_and_sigterm_ends_every_process(checkpoints):
    model = str(checkpoints["qwen3"])
    body = {"prompt": PROMPTS[1], "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    llm = _llm(model, 1)
    expected = (
        llm.generate([body["prompt"]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)[0]
        .outputs[0]
        .text
    )
    proc, url = _start_serve(model, "--tensor-parallel-size", "2", "--device", "cpu", "--dtype", "float32")
    try:
        children = _descendants(proc.pid)
        assert len(children) >= 2, "the engine core process and its worker rank (and a resource tracker)"
        r = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == expected
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        proc.kill()
    _, err = proc.communicate()
    assert "Traceback" not in err, err
    deadline = time.monotonic() + 10
    while any(_alive(c) for c in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(c) for c in children)


def test_torchrun_launch_matches_tp1(checkpoints):
    """Ranks started by torchrun (multi-node style, env:// rendezvous) instead of spawned by Ember."""
    flags = [
        "--model",
        str(checkpoints["llama"]),
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--kv-cache-memory",
        "0.02",
        "--max-tokens",
        "8",
        "--temperature",
        "0",
        PROMPTS[1],
    ]
    one = subprocess.run(
        [sys.executable, "-m", "ember.cli", "generate", *flags], capture_output=True, text=True, timeout=120
    )
    two = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "-m",
            "ember.cli",
            "generate",
            "--tensor-parallel-size",
            "2",
            *flags,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert one.returncode == 0 and two.returncode == 0, two.stderr
    assert one.stdout and two.stdout == one.stdout
