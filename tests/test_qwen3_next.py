"""Qwen3-Next (hybrid Gated DeltaNet / gated attention, shared-expert MoE) against transformers.

A tiny random checkpoint: 4 layers, 3 linear-attention then 1 full-attention (layer_types), hidden 64,
2 key heads serving 4 value heads in the DeltaNet, 4 experts (top 2, renormalised) with a shared
expert, one dense layer (mlp_only_layers), a quarter of each attention head rotated. Norm weights,
dt_bias and the gated norm are drawn away from their identity init so a mistaken (1 + w) or a dropped
gate shows. Greedy tokens equal transformers' in float32 (top-5 logprobs within 2e-3): prompts of
different lengths batched together, with a prompt split over many steps (the conv and recurrent state
carried between chunks), with requests finishing at different times so their state slots are reused,
and under preemption. The GPU's path (the Triton prefill and decode kernels among the other kernels)
runs through Triton's interpreter, the prefill kernel is held to the chunked rule, and the chunked rule
to the token-by-token rule across chunk splits.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from conftest import BASE, DEVICE, _train_tokenizer, inproc_core
from test_hf_equality import assert_output_matches, hf_greedy
from test_new_archs import GREEDY, NUM_TOKENS

from ember import LLM, SamplingParams
from ember.ops import gated_delta

CONFIG = dict(
    BASE,
    num_hidden_layers=4,
    layer_types=["linear_attention"] * 3 + ["full_attention"],
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=32,
    norm_topk_prob=True,
    mlp_only_layers=[1],
)


def _prompts() -> list[dict]:
    """Lengths from 1 token to past two of the delta rule's 64-token chunks."""
    rng = random.Random(7)
    return [{"prompt_token_ids": [rng.randint(5, 430) for _ in range(n)]} for n in (1, 5, 19, 70, 150)]


PROMPTS = _prompts()


def _make_checkpoint(path: Path) -> Path:
    import transformers

    cfg = transformers.Qwen3NextConfig(**CONFIG)
    torch.manual_seed(0)
    model = transformers.Qwen3NextForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.15 if "embed" in name or "lm_head" in name else 0.08)
            elif name.endswith("linear_attn.norm.weight") or name.endswith("dt_bias"):
                p.uniform_(0.5, 1.5)
            elif name.endswith("norm.weight"):  # (1 + w) norms
                p.uniform_(-0.4, 0.4)
    model.save_pretrained(path)
    _train_tokenizer(path, cfg.vocab_size)
    return path


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return _make_checkpoint(tmp_path_factory.mktemp("qwen3next") / "qwen3-next")


@pytest.fixture(scope="module")
def references(checkpoint) -> list[tuple[list[int], torch.Tensor]]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).to(DEVICE)
    return [hf_greedy(hf, p["prompt_token_ids"], NUM_TOKENS) for p in PROMPTS]


def _llm(path: Path, **kwargs) -> LLM:
    args = {"kv_cache_memory": 0.02, "block_size": 8, **kwargs}
    return LLM(str(path), device=DEVICE, dtype="float32", engine_process=False, **args)


@pytest.mark.parametrize(
    "engine",
    [
        {"max_num_batched_tokens": 512},  # every prompt whole in one step, batched
        {"max_num_batched_tokens": 16},  # the long prompts in 16-token chunks over many steps
    ],
    ids=["batched", "chunked"],
)
def test_matches_transformers(checkpoint, references, engine):
    llm = _llm(checkpoint, **engine)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    for prompt, out, (tokens, logprobs) in zip(PROMPTS, outs, references):
        assert_output_matches(out.outputs[0], tokens, logprobs, prompt)
    assert not inproc_core(llm).block_manager.enable_prefix_caching


def test_slots_reused_as_requests_finish(checkpoint, references):
    """Five requests of different lengths through two slots: each new one takes the slot a finished one
    freed (the runner hears of a finish with the next step), and its state starts from zeros there."""
    llm = _llm(checkpoint, max_num_seqs=2, max_num_batched_tokens=32)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=5) for n in (3, 24, 9, 24, 24)]
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    for prompt, out, p, (tokens, _) in zip(PROMPTS, outs, params, references):
        assert out.outputs[0].token_ids == tokens[: p.max_tokens], f"prompt {prompt!r}"
    assert inproc_core(llm).runner.linear_state.slots.num_slots == 2


def test_preempted_requests_recompute(checkpoint, references):
    """A KV cache too small for every request at once: preempted requests free their slot and restart."""
    block_bytes = 2 * 8 * 2 * 16 * 4  # K and V of one attention layer: 8 tokens, 2 KV heads of 16, float32
    llm = _llm(checkpoint, kv_cache_memory=14 * block_bytes / 2**30, max_model_len=96, max_num_batched_tokens=64)
    outs = llm.generate(PROMPTS[:4], GREEDY, use_tqdm=False)
    assert llm.llm_engine.scheduler_stats().num_preemptions > 0
    for prompt, out, (tokens, logprobs) in zip(PROMPTS, outs, references):
        assert_output_matches(out.outputs[0], tokens, logprobs, prompt)


def test_chunked_rule_equals_recurrent_across_splits():
    """The chunked delta rule from a carried state equals the token-by-token rule, however the sequence is split."""
    torch.manual_seed(0)
    t, hk, hv, d = 100, 2, 4, 16
    q, k = torch.randn(1, t, hk, d), torch.randn(1, t, hk, d)
    v = torch.randn(1, t, hv, d)
    g, beta = -torch.rand(1, t, hv), torch.rand(1, t, hv)
    state = torch.zeros(1, hv, d, d)
    ref, ref_state = gated_delta.recurrent(q, k, v, g, beta, state)
    outs = []
    for lo, hi in ((0, 7), (7, 71), (71, 100)):
        out, state = gated_delta.chunked(q[:, lo:hi], k[:, lo:hi], v[:, lo:hi], g[:, lo:hi], beta[:, lo:hi], state)
        outs.append(out)
    torch.testing.assert_close(torch.cat(outs, dim=1), ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(state, ref_state, atol=1e-4, rtol=1e-4)


def test_triton_recurrent_kernel_matches_reference():
    """The Triton decode launch (the interpreter without a GPU) against its PyTorch reference and against
    the PyTorch path the CPU takes: outputs and the pool's states, grouped heads, a fresh sequence, and
    value heads split over two channel blocks."""
    from conftest import KERNEL_DEVICE

    from ember.kernels.gated_delta import fused_recurrent_gated_delta_ref

    torch.manual_seed(0)
    b, hk, hv, kd, vd, slots_n = 3, 2, 4, 16, 80, 5
    dev = KERNEL_DEVICE
    q, k = torch.randn(b, hk, kd, device=dev), torch.randn(b, hk, kd, device=dev)
    v = torch.randn(b, hv, vd, device=dev)
    g, beta = -torch.rand(b, hv, device=dev), torch.rand(b, hv, device=dev)
    pool = torch.randn(slots_n, hv, kd, vd, device=dev)
    slots = torch.tensor([4, 0, 2], device=dev)
    fresh = torch.tensor([False, True, False], device=dev)
    starts = torch.arange(b + 1, dtype=torch.int32, device=dev)  # one token a sequence, as a step's decodes
    ref_pool, torch_pool = pool.clone(), pool.clone()
    out = gated_delta.TritonRecurrent()(q, k, v, g, beta, pool, slots, fresh, starts)
    ref = fused_recurrent_gated_delta_ref(q, k, v, g, beta, ref_pool, slots, fresh)
    path = gated_delta.TorchRecurrent()(q, k, v, g, beta, torch_pool, slots, fresh, starts)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pool, ref_pool, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, path, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pool, torch_pool, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("carried", [False, True], ids=["fresh", "carried"])
def test_triton_prefill_kernel_matches_chunked_rule(carried):
    """The Triton prefill kernel (the interpreter without a GPU) against the chunked rule the CPU runs, one
    sequence at a time: four sequences of 1, 3, 1 and 9 tokens in one launch, grouped heads, value heads
    split over two channel blocks, the pool's states from its slots (or zeros where fresh) and back; one
    slot is left alone. Then the same chunks again from the states the first left behind."""
    from conftest import KERNEL_DEVICE

    from ember.kernels.gated_delta import prefill_gated_delta

    torch.manual_seed(0)
    lens, hk, hv, kd, vd, slots_n = (1, 3, 1, 9), 2, 4, 16, 80, 5
    t, dev = sum(lens), KERNEL_DEVICE
    q, k = torch.randn(t, hk, kd, device=dev), torch.randn(t, hk, kd, device=dev)
    v = torch.randn(t, hv, vd, device=dev)
    g, beta = -torch.rand(t, hv, device=dev), torch.rand(t, hv, device=dev)
    pool = torch.randn(slots_n, hv, kd, vd, device=dev)
    slots = torch.tensor([4, 0, 2, 1], device=dev)
    fresh = torch.tensor([not carried, True, not carried, False], device=dev)
    starts = [0, 1, 4, 5, 14]
    before, torch_pool = pool.clone(), pool.clone()
    for _ in range(2):  # the second round starts from the first's states
        out = prefill_gated_delta(q, k, v, g, beta, pool, slots, fresh, torch.tensor(starts, device=dev))
        host = torch.tensor(starts)
        ref = gated_delta.TorchChunkedPrefill()(q, k, v, g, beta, torch_pool, slots, fresh, host, starts)
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(pool, torch_pool, atol=1e-4, rtol=1e-4)
        fresh = torch.zeros_like(fresh)
    assert torch.equal(pool[3], before[3])


def test_triton_path_matches_transformers(checkpoint, references, monkeypatch):
    """The GPU's kernels (FORCE_TRITON: paged attention, fused MoE, the delta rule's prefill and decode kernels) through
    Triton's interpreter on CPU: the same greedy tokens as transformers (fewer tokens, for time)."""
    from ember.ops import registry

    monkeypatch.setattr(registry, "FORCE_TRITON", True)
    llm = _llm(checkpoint, max_num_batched_tokens=32)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outs = llm.generate(PROMPTS[1:4], params, use_tqdm=False)
    for prompt, out, (tokens, _) in zip(PROMPTS[1:4], outs, references[1:4]):
        assert out.outputs[0].token_ids == tokens[:6], f"prompt {prompt!r}"


def test_speculative_decoding_is_refused(checkpoint):
    """The recurrent state has no rollback past rejected drafts: refused by name, before anything loads."""
    with pytest.raises(ValueError, match="speculative decoding is not supported for Qwen3NextForCausalLM"):
        _llm(checkpoint, speculative_config={"method": "ngram", "num_speculative_tokens": 2})
