"""DeepSeek-V2 / V2-Lite / V3: multi-head latent attention over the paged latent cache, and DeepSeek's MoE
(shared experts, grouped routing), against transformers.

The tiny checkpoints (tests/conftest.py: deepseek-v2-lite, deepseek-v2, deepseek-v3) are built with
transformers' own DeepseekV2/V3 classes: a 32-wide latent and 8 rotated channels per token, values
(24) wider than the unrotated keys (16), YaRN with mscale_all_dim on V2 and V3, V3's routing bias drawn
non-zero. Greedy tokens equal transformers' in float32 with top-5 logprobs within 2e-3, for a batch of
prompts of different lengths with chunked prefill and the prefix cache (the last three prompts share 20
tokens, so a later request's prefill reads its prefix's latents from blocks another one wrote).
The Triton MLA decode kernel runs against its float64 reference (the interpreter without a GPU), over
float and e4m3 rows. The fp8 latent cache (`kv_cache_dtype="fp8"`) equals a float32 cache holding the
e4m3-rounded rows, stays close to the float32 cache, and holds twice a bf16 cache's blocks.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import DEVICE, KERNEL_DEVICE, inproc_core, make_checkpoint
from test_hf_equality import assert_output_matches, hf_references
from test_new_archs import GREEDY, NUM_TOKENS, PROMPTS

from ember import LLM, SamplingParams
from ember.kernels.mla_decode import (
    mla_decode_attention,
    mla_decode_attention_ref,
    store_latent,
    store_latent_ref,
)
from ember.kernels.mla_prep import mla_prep
from ember.kernels.rmsnorm import rms_norm
from ember.kernels.rotary import apply_rotary
from ember.model.hf_config import GroupedRouting, ModelConfig
from ember.model.layers import RotaryEmbedding
from ember.model.mla import MLAttention
from ember.model.moe import SparseMoeBlock
from ember.ops.mla import MlaShape, TorchMLA, TritonMLA
from ember.ops.moe import route_grouped
from ember.quant.formats import FP8_DTYPE
from ember.quant.kv_scale import dequantize_kv, quantize_kv

ARCHS = ("deepseek-v2-lite", "deepseek-v2", "deepseek-v3")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("deepseek")
    return {arch: make_checkpoint(root / arch, arch) for arch in ARCHS}


@pytest.fixture(scope="module")
def references(checkpoints) -> dict[str, list[tuple[list[int], torch.Tensor]]]:
    return hf_references(checkpoints, PROMPTS, NUM_TOKENS)


def _llm(path: Path, **kwargs) -> LLM:
    args = {"kv_cache_memory": 0.01, "block_size": 8, "max_num_batched_tokens": 16, "dtype": "float32", **kwargs}
    return LLM(str(path), device=DEVICE, engine_process=False, **args)


@pytest.mark.parametrize("arch", ARCHS)
def test_matches_transformers(checkpoints, references, arch):
    llm = _llm(checkpoints[arch])
    layers = inproc_core(llm).runner.model.model.layers
    assert all(isinstance(layer.self_attn, MLAttention) for layer in layers)
    assert [isinstance(layer.mlp, SparseMoeBlock) for layer in layers] == [False, True, True]  # first_k_dense_replace
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    for prompt, out, (tokens, logprobs) in zip(PROMPTS, outs, references[arch]):
        assert_output_matches(out.outputs[0], tokens, logprobs, prompt)
    # the shared prefix's blocks were found in the cache (a second round is no stricter test: one of these
    # prompts meets two candidates 2e-7 apart in logprob, which summing in another order may swap)
    assert llm.llm_engine.scheduler_stats().prefix_cache_hits > 0


def test_latent_cache_is_one_row_per_token(checkpoints):
    """No separate K and V: one [blocks, block_size, 1, kv_lora_rank + rope] tensor per layer, and the
    pool sized by its bytes."""
    llm = _llm(checkpoints["deepseek-v3"], kv_cache_memory=0.001)
    runner = inproc_core(llm).runner
    cfg = json.loads((checkpoints["deepseek-v3"] / "config.json").read_text())
    width = cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]
    bytes_per_block = cfg["num_hidden_layers"] * 8 * width * 4
    assert runner.kv_cache.bytes_per_block == bytes_per_block
    assert runner.kv_cache.num_blocks == int(0.001 * 2**30 // bytes_per_block)
    for attn in runner.model.attention_layers():
        assert attn.cache is not None and tuple(attn.cache.shape) == (runner.kv_cache.num_blocks, 8, 1, width)


def test_preempted_requests_recompute(checkpoints, references):
    """Blocks for about two sequences at once: requests are preempted and recomputed from the latents."""
    arch = "deepseek-v3"  # (V2-Lite's longest prompt meets a near-tie that another batching may swap)
    cfg = json.loads((checkpoints[arch] / "config.json").read_text())
    block_bytes = cfg["num_hidden_layers"] * 8 * (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]) * 4
    llm = _llm(
        checkpoints[arch], kv_cache_memory=14 * block_bytes / 2**30, max_model_len=96, enable_prefix_caching=False
    )
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert llm.llm_engine.scheduler_stats().num_preemptions > 0
    for prompt, out, (tokens, logprobs) in zip(PROMPTS, outs, references[arch]):
        assert_output_matches(out.outputs[0], tokens, logprobs, prompt)


# --- the fp8 latent cache ---------------------------------------------------------------------------


def _e4m3_rounded(store, scale: float):
    """An MLA implementation's store that writes its rows as an fp8 cache with `scale` reads them back,
    into a float cache (of scale 1.0)."""

    def rounded(self, rows, cache, slot_mapping, kv_scale):
        as_read = dequantize_kv(quantize_kv(rows[:, None], FP8_DTYPE, scale), scale, rows.dtype)[:, 0]
        store(self, as_read, cache, slot_mapping, kv_scale)

    return rounded


@pytest.mark.parametrize("kv_scale", [1.0, 0.37])
def test_fp8_latent_cache_reads_back_what_it_stored(checkpoints, monkeypatch, kv_scale):
    """`kv_cache_dtype="fp8"` gives the tokens and logprobs of a float32 cache whose rows were rounded to
    e4m3 (by the layers' scale, the engine's 1.0 or another) as they were stored: the decode (absorbed)
    and the prefill chunks that decompress cached latents (a later chunk's context, the shared prefix's
    blocks) all dequantize what they read, and nothing else changes. A scale set after start-up runs
    eagerly: a CUDA graph keeps the host float it was captured with."""
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=5)
    path = checkpoints["deepseek-v3"]
    llm = _llm(path, kv_cache_dtype="fp8", enforce_eager=kv_scale != 1.0)
    for attn in inproc_core(llm).runner.model.attention_layers():
        assert attn.cache.dtype == FP8_DTYPE
        attn.kv_scale = kv_scale
    fp8 = llm.generate(PROMPTS, params, use_tqdm=False)
    assert llm.llm_engine.scheduler_stats().prefix_cache_hits > 0
    for impl in (TorchMLA, TritonMLA):
        monkeypatch.setattr(impl, "store", _e4m3_rounded(impl.store, kv_scale))
    monkeypatch.setattr(TritonMLA, "prepare", TorchMLA.prepare)  # the fused prep stores without `store`
    emulated = _llm(path).generate(PROMPTS, params, use_tqdm=False)
    for a, b in zip(fp8, emulated):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert {t: v.logprob for t, v in la.items()} == pytest.approx(
                {t: v.logprob for t, v in lb.items()}, abs=1e-5
            )


# |logprob difference| of every prompt token, fp8 latent cache against float32, over PROMPTS: measured on
# CPU, mean 0.024 / 0.046 / 0.045 and worst 0.07 / 0.40 / 0.28 for V2-Lite / V2 / V3 (the MoE routing turns
# a few small differences into another expert; the tiny Llama's fp8 KV cache: worst 0.12)
FP8_MEAN_LOGPROB_ERROR, FP8_WORST_LOGPROB_ERROR = 0.08, 0.8


@pytest.mark.parametrize("arch", ARCHS)
def test_fp8_latent_cache_stays_close_to_float32(checkpoints, arch):
    """The cost of quantizing the latents: e4m3 keeps 3 mantissa bits (a relative error of up to 1/16 per
    value), which the decompression and attention average. Teacher-forced (prompt logprobs) over chunked
    prefills, so no near-tie's greedy divergence hides a difference; a wrong scale or a missing
    dequantization costs whole nats."""
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    runs = [
        _llm(checkpoints[arch], kv_cache_dtype=kv).generate(PROMPTS, params, use_tqdm=False) for kv in ("auto", "fp8")
    ]
    errors = torch.tensor(
        [
            abs(ref[tok].logprob - got[tok].logprob)
            for a, b in zip(*runs)
            for ref, got in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:])
            for tok in ref
        ]
    )
    assert errors.mean() <= FP8_MEAN_LOGPROB_ERROR and errors.max() <= FP8_WORST_LOGPROB_ERROR, (
        errors.mean(),
        errors.max(),
    )


def test_fp8_latent_cache_holds_twice_the_tokens_of_bf16(checkpoints):
    """One byte a value: the pool's bytes per block are half a bf16 cache's, so the same memory holds
    twice the blocks (and tokens)."""
    path = checkpoints["deepseek-v3"]
    cfg = json.loads((path / "config.json").read_text())
    values_per_block = cfg["num_hidden_layers"] * 8 * (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"])
    pools = {
        kv: inproc_core(_llm(path, dtype="bfloat16", kv_cache_dtype=kv, kv_cache_memory=0.001)).runner.kv_cache
        for kv in ("auto", "fp8")
    }
    assert pools["auto"].bytes_per_block == 2 * values_per_block and pools["fp8"].bytes_per_block == values_per_block
    assert pools["auto"].num_blocks == int(0.001 * 2**30 // (2 * values_per_block))
    assert pools["fp8"].num_blocks == int(0.001 * 2**30 // values_per_block)
    assert pools["fp8"].num_blocks in (2 * pools["auto"].num_blocks, 2 * pools["auto"].num_blocks + 1)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_triton_path_matches_torch_path(checkpoints, monkeypatch, kv_cache_dtype):
    """The engine on the kernels (the MLA decode kernel and latent store, the fused MoE with DeepSeek's
    routing) gives the PyTorch path's tokens and logprobs, with a chunked prefill and decodes, over a
    float32 or an fp8 latent cache."""
    from ember.ops import registry as backend

    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=2)
    path = checkpoints["deepseek-v3"]
    torch_outs = _llm(path, kv_cache_dtype=kv_cache_dtype).generate(PROMPTS[2:4], params, use_tqdm=False)
    monkeypatch.setattr(backend, "FORCE_TRITON", True)
    triton_outs = _llm(path, kv_cache_dtype=kv_cache_dtype).generate(PROMPTS[2:4], params, use_tqdm=False)
    for a, b in zip(torch_outs, triton_outs):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert {t: v.logprob for t, v in la.items()} == pytest.approx(
                {t: v.logprob for t, v in lb.items()}, abs=1e-3
            )


def test_multi_token_prediction_layer_is_skipped(checkpoints, tmp_path):
    """A layer past num_hidden_layers (DeepSeek-V3's release ships its MTP module as model.layers.61) is
    not loaded, as transformers skips it."""
    from safetensors.torch import load_file, save_file

    d = shutil.copytree(checkpoints["deepseek-v3"], tmp_path / "mtp")
    tensors = load_file(d / "model.safetensors")
    tensors.update({k.replace(".layers.2.", ".layers.3."): v.clone() for k, v in tensors.items() if ".layers.2." in k})
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    ours, plain = (_llm(p).generate(PROMPTS[:1], params, use_tqdm=False) for p in (d, checkpoints["deepseek-v3"]))
    assert ours[0].outputs[0].token_ids == plain[0].outputs[0].token_ids


def test_dummy_weights_run(checkpoints):
    llm = _llm(checkpoints["deepseek-v3"], load_format="dummy")
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    assert len(llm.generate(PROMPTS[:2], params, use_tqdm=False)[1].outputs[0].token_ids) == 3


def test_prefill_attention_leaves_out_cudnn(checkpoints, monkeypatch):
    """The prefill's attention runs with cuDNN's backend off (it builds a graph per prompt length on the
    host: ember.ops.mla.PREFILL_BACKENDS), both with and without cached context, and only there."""
    import ember.ops.mla as mla

    seen, sdpa = [], mla.F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        seen.append((torch.backends.cuda.cudnn_sdp_enabled(), "attn_mask" in kwargs))
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(mla.F, "scaled_dot_product_attention", spy)
    _llm(checkpoints["deepseek-v3"]).generate(PROMPTS, SamplingParams(max_tokens=2), use_tqdm=False)
    assert {masked for _, masked in seen} == {False, True}  # a first chunk and a later one over its context
    assert not any(enabled for enabled, _ in seen)
    assert torch.backends.cuda.cudnn_sdp_enabled()


# --- configuration -----------------------------------------------------------------------------------


def _v3_config(**overrides) -> dict:
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "vocab_size": 64,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 128,
        "kv_lora_rank": 16,
        "q_lora_rank": 24,
        "qk_nope_head_dim": 8,
        "qk_rope_head_dim": 4,
        "v_head_dim": 8,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 16,
        **overrides,
    }


def test_config_reads_deepseek_v3_as_released():
    """DeepSeek-V3's config.json keys: YaRN with mscale = mscale_all_dim (so no cos/sin scale, but a softmax
    scale of mscale(40)^2 / sqrt(192)), noaux_tc over 8 groups, 3 dense layers, one latent KV head."""
    yarn = {
        "type": "yarn",
        "factor": 40,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32,
        "beta_slow": 1,
    }
    cfg = ModelConfig.from_hf_config(
        _v3_config(
            qk_nope_head_dim=128,
            qk_rope_head_dim=64,
            rope_scaling=yarn,
            topk_method="noaux_tc",
            n_group=8,
            topk_group=4,
            n_routed_experts=256,
            num_experts_per_tok=8,
            first_k_dense_replace=3,
            max_position_embeddings=163840,
        )
    )
    assert cfg.mla is not None and cfg.moe is not None and cfg.moe.grouped is not None
    assert cfg.head_dim == 64 and cfg.num_key_value_heads == 4 and cfg.mla.cache_dim == 16 + 64
    assert cfg.rope_scaling is not None and cfg.rope_scaling["attention_factor"] == 1.0
    mscale = 0.1 * torch.log(torch.tensor(40.0)).item() + 1.0
    assert cfg.mla.softmax_scale == pytest.approx(192**-0.5 * mscale**2)
    assert cfg.moe.dense_layers == (0, 1, 2) and cfg.moe.renormalize
    assert cfg.moe.grouped == GroupedRouting(sigmoid=True, n_group=8, topk_group=4, scaling=2.5, score_bias=True)
    assert cfg.moe.shared_expert_intermediate_size == 16


@pytest.mark.parametrize(
    "overrides,message",
    [
        ({"topk_method": "group_limited_greedy"}, "topk_method 'group_limited_greedy' is not supported"),
        ({"n_group": 3}, "n_group 3 / topk_group 4 do not fit 8 experts"),
        ({"n_group": 8, "topk_group": 1}, "noaux_tc scores a group by its best two experts"),
        ({"attention_bias": True}, "attention_bias: biases are not supported"),
    ],
)
def test_unsupported_variants_name_the_field(overrides, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf_config(_v3_config(**overrides))


# --- routing -------------------------------------------------------------------------------------------


def test_grouped_routing_keeps_only_the_best_groups():
    """V3: groups ranked by their best two biased scores; the weights are the unbiased sigmoid scores."""
    logits = torch.tensor([[0.0, 0.1, 3.0, 2.9, -1.0, -1.0, 5.0, -5.0]])
    bias = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.0, -10.0, 0.0])
    routing = GroupedRouting(sigmoid=True, n_group=4, topk_group=1, scaling=2.0, score_bias=True)
    weights, ids = route_grouped(logits, 2, True, routing, bias)
    assert sorted(ids[0].tolist()) == [2, 3]  # group 1; expert 6's bias sinks group 3
    s = logits[0, [2, 3]].sigmoid()
    torch.testing.assert_close(weights[0].sort().values, (2.0 * s / s.sum()).sort().values)
    # V2's group_limited_greedy: a group's score is its best expert's softmax probability
    v2 = GroupedRouting(sigmoid=False, n_group=4, topk_group=2)
    weights, ids = route_grouped(logits, 3, False, v2)
    assert sorted(ids[0].tolist()) == [2, 3, 6]
    torch.testing.assert_close(weights[0].sum(), logits.softmax(-1)[0, [2, 3, 6]].sum())


# --- the Triton MLA decode kernel --------------------------------------------------------------------


def _decode_inputs(
    lens: list[int], num_blocks: int, block_size: int, heads: int, width: int, dtype: torch.dtype, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Block tables over shuffled blocks, random queries and the lengths of sequences of `lens` rows."""
    per_seq = -(-max(lens) // block_size)
    tables = torch.randperm(num_blocks, generator=gen)[: len(lens) * per_seq].view(len(lens), per_seq)
    q = torch.randn(len(lens), heads, width, generator=gen).to(dtype).to(KERNEL_DEVICE)
    return tables.to(torch.int32).to(KERNEL_DEVICE), q, torch.tensor(lens, dtype=torch.int32, device=KERNEL_DEVICE)


@pytest.mark.parametrize("num_splits", [1, 3, None])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_lora,rope,heads,block_size", [(32, 8, 4, 8), (48, 16, 20, 16)])
def test_mla_decode_kernel_matches_reference(kv_lora, rope, heads, block_size, dtype, num_splits):
    """Sequences of 1 to 70 rows spread over shuffled blocks; more heads than one program holds; widths
    that are no power of two; a zero-length (padded) row gives zeros."""
    gen = torch.Generator().manual_seed(kv_lora + heads)
    lens = [1, 70, 17, 33, 0]
    width, num_blocks = kv_lora + rope, 48
    cache = torch.randn(num_blocks, block_size, 1, width, generator=gen).to(dtype).to(KERNEL_DEVICE)
    tables, q, seq_lens = _decode_inputs(lens, num_blocks, block_size, heads, width, dtype, gen)
    scale = width**-0.5
    out = mla_decode_attention(q, cache, tables, seq_lens, scale, kv_lora, num_splits=num_splits, max_seq_len=70)
    ref = mla_decode_attention_ref(q, cache, tables, seq_lens, scale, kv_lora)
    tol = {"atol": 2e-4, "rtol": 2e-4} if dtype == torch.float32 else {"atol": 3e-2, "rtol": 3e-2}
    assert out.shape == (len(lens), heads, kv_lora) and out.dtype == dtype
    torch.testing.assert_close(out[:-1].double(), ref[:-1], **tol)
    assert torch.equal(out[-1].float(), torch.zeros(heads, kv_lora, device=KERNEL_DEVICE))


# Near amax / 448 for the rows below (as a calibrated scale would be, so the largest values saturate) and
# no power of two (so scaling rounds); as a layer's float, and as the one "KV head"'s float32 tensor.
FP8_ROW_SCALES = [0.0123, "tensor"]


def _kv_scale(scale: float | str) -> float | torch.Tensor:
    return torch.tensor([0.0091], device=KERNEL_DEVICE) if scale == "tensor" else scale


@pytest.mark.parametrize("kv_scale", FP8_ROW_SCALES)
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mla_decode_kernel_reads_fp8_rows(dtype, num_splits, kv_scale):
    """Fresh random e4m3 rows (a few saturated) against the float64 reference over the same rows
    dequantized, with and without splits; bf16 queries multiply in fp16 (kv_dot_dtype)."""
    kv_lora, rope, heads, block_size = 48, 16, 20, 16
    gen = torch.Generator().manual_seed(7 + num_splits)
    lens = [1, 70, 17, 0]
    width, num_blocks = kv_lora + rope, 24
    kv_scale = _kv_scale(kv_scale)
    rows = torch.randn(num_blocks, block_size, 1, width, generator=gen) * 2
    cache = quantize_kv(rows.to(KERNEL_DEVICE), FP8_DTYPE, kv_scale)
    assert cache.float().abs().max() == 448  # some rows saturate
    tables, q, seq_lens = _decode_inputs(lens, num_blocks, block_size, heads, width, dtype, gen)
    scale = width**-0.5
    out = mla_decode_attention(q, cache, tables, seq_lens, scale, kv_lora, num_splits=num_splits, kv_scale=kv_scale)
    ref = mla_decode_attention_ref(q, cache, tables, seq_lens, scale, kv_lora, kv_scale)
    tol = {"atol": 2e-4, "rtol": 2e-4} if dtype == torch.float32 else {"atol": 3e-2, "rtol": 3e-2}
    assert out.shape == (len(lens), heads, kv_lora) and out.dtype == dtype
    torch.testing.assert_close(out[:-1].double(), ref[:-1], **tol)
    assert torch.equal(out[-1].float(), torch.zeros(heads, kv_lora, device=KERNEL_DEVICE))


def test_mla_decode_kernel_refuses_mismatched_caches():
    q = torch.zeros(1, 2, 40, device=KERNEL_DEVICE)
    table, lens = torch.zeros(1, 1, dtype=torch.int32, device=KERNEL_DEVICE), torch.ones(1, dtype=torch.int32)
    cache = torch.zeros(2, 8, 1, 40, device=KERNEL_DEVICE)
    with pytest.raises(ValueError, match="only fp8 may differ"):
        mla_decode_attention(q.bfloat16(), cache, table, lens.to(KERNEL_DEVICE), 0.1, 32)
    with pytest.raises(ValueError, match="only to fp8 caches"):
        mla_decode_attention(q, cache, table, lens.to(KERNEL_DEVICE), 0.1, 32, kv_scale=0.5)


def test_store_latent_skips_padding():
    gen = torch.Generator().manual_seed(1)
    rows = torch.randn(5, 40, generator=gen).to(KERNEL_DEVICE)
    slots = torch.tensor([3, -1, 17, 0, -1], dtype=torch.int64, device=KERNEL_DEVICE)
    cache, ref = (torch.zeros(4, 8, 1, 40, device=KERNEL_DEVICE) for _ in range(2))
    store_latent(rows, cache, slots)
    store_latent_ref(rows, ref, slots)
    assert torch.equal(cache, ref)


@pytest.mark.parametrize("kv_scale", FP8_ROW_SCALES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_latent_fp8_rounds_like_the_torch_path(dtype, kv_scale):
    """The kernel, its reference and TorchMLA's store write the same e4m3 bits: rounded to nearest even,
    saturated at +-448 (never NaN), signed zeros and subnormals kept."""
    gen = torch.Generator().manual_seed(2)
    kv_scale = _kv_scale(kv_scale)
    rows = (torch.randn(6, 40, generator=gen) * 3).to(dtype)
    rows[2, :9] = torch.tensor([1e4, -1e4, float("inf"), float("-inf"), -0.0, 1e-6, -1e-6, 3e-5, -7e-5]).to(dtype)
    slots = torch.tensor([3, -1, 17, 0, -1, 30], dtype=torch.int64)
    before = quantize_kv(torch.randn(4, 8, 1, 40, generator=gen), FP8_DTYPE, _cpu(kv_scale))
    cache, ref = (before.to(KERNEL_DEVICE, copy=True) for _ in range(2))
    store_latent(rows.to(KERNEL_DEVICE), cache, slots.to(KERNEL_DEVICE), kv_scale)
    store_latent_ref(rows.to(KERNEL_DEVICE), ref, slots.to(KERNEL_DEVICE), kv_scale)
    torch_path, keep = before.clone(), slots >= 0  # the PyTorch path is never given padding slots
    TorchMLA(MlaShape(FP8_DTYPE, 4, 32, 8, 8)).store(rows[keep], torch_path, slots[keep], _cpu(kv_scale))
    bits = [t.cpu().view(torch.uint8) for t in (cache, ref, torch_path)]
    assert torch.equal(bits[0], bits[1]) and torch.equal(bits[0], bits[2])
    assert not torch.equal(bits[0], before.view(torch.uint8))  # the rows did land
    stored = cache.cpu().view(-1, 40).float()
    assert torch.equal(stored[int(slots[2]), :4], torch.tensor([448.0, -448.0, 448.0, -448.0]))
    assert not stored.isnan().any()


def _cpu(scale: float | torch.Tensor) -> float | torch.Tensor:
    return scale.cpu() if isinstance(scale, torch.Tensor) else scale


# --- the fused MLA prep: latent norm, rotary and store in one kernel ------------------------------------


def _prep_unfused(
    positions: torch.Tensor,
    q_pe: torch.Tensor,
    kv: torch.Tensor,
    rope: RotaryEmbedding,
    weight: torch.Tensor,
    cache: torch.Tensor,
    slots: torch.Tensor,
    kv_scale: float | torch.Tensor,
    interleaved: bool,
) -> torch.Tensor:
    """The Triton path's separate ops, as MLAttention ran them before the fused kernel."""
    rope_dim = q_pe.shape[-1]
    latent, k_pe = kv.split([kv.shape[1] - rope_dim, rope_dim], dim=-1)
    latent = rms_norm(latent.contiguous(), weight, 1e-6)
    k_pe = k_pe.unsqueeze(1)
    if interleaved:
        perm = torch.cat([torch.arange(0, rope_dim, 2), torch.arange(1, rope_dim, 2)]).to(KERNEL_DEVICE)
        q_pe, k_pe = q_pe[..., perm], k_pe[..., perm]
    q_pe, k_pe = apply_rotary(positions, q_pe.contiguous(), k_pe.contiguous(), rope.cos, rope.sin)
    store_latent(torch.cat([latent, k_pe.squeeze(1)], dim=-1), cache, slots, kv_scale)
    return q_pe


@pytest.mark.parametrize("cache_kind", ["model", "fp8", "fp8-tensor"])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,nope,rope_dim,kv_lora", [(3, 16, 8, 40), (16, 128, 64, 512)])
def test_mla_prep_kernel_matches_unfused_ops(heads, nope, rope_dim, kv_lora, dtype, interleaved, cache_kind):
    """The fused prep's rotated queries and cache (every byte, padding slots untouched) equal the separate
    norm, de-interleave, rotary and store kernels' bit for bit: strided views of the projections' outputs,
    heads and a latent width that are no power of two or DeepSeek-V2-Lite's, YaRN tables, e4m3 rows that
    saturate."""
    gen = torch.Generator().manual_seed(3)
    tokens = 5
    scaling = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=16, attention_factor=1.2)
    scaling.update(beta_fast=32.0, beta_slow=1.0, truncate=True)
    rope = RotaryEmbedding(rope_dim, 64, 10000.0, scaling).to(KERNEL_DEVICE)
    q = torch.randn(tokens, heads * (nope + rope_dim), generator=gen).to(dtype).to(KERNEL_DEVICE)
    q_pe = q.view(tokens, heads, nope + rope_dim)[..., nope:]
    kv = (torch.randn(tokens, kv_lora + rope_dim + 4, generator=gen) * 3).to(dtype).to(KERNEL_DEVICE)
    kv = kv[:, : kv_lora + rope_dim]  # rows strided like a wider projection's
    weight = (torch.randn(kv_lora, generator=gen) * 4).to(dtype).to(KERNEL_DEVICE)
    positions = torch.tensor([0, 7, 63, 12, 30], device=KERNEL_DEVICE)
    slots = torch.tensor([3, -1, 17, 0, 30], dtype=torch.int64, device=KERNEL_DEVICE)
    kv_scale = 1.0 if cache_kind == "model" else _kv_scale(0.0123 if cache_kind == "fp8" else "tensor")
    before = torch.randn(4, 8, 1, kv_lora + rope_dim, generator=gen).to(dtype)
    if cache_kind != "model":
        before = quantize_kv(before, FP8_DTYPE, _cpu(kv_scale))
    fused, unfused = (before.to(KERNEL_DEVICE, copy=True) for _ in range(2))
    cos, sin_signed = rope.full_tables(rope_dim)
    out = mla_prep(positions, q_pe, kv, cos, sin_signed, weight, 1e-6, fused, slots, kv_scale, interleaved)
    ref = _prep_unfused(positions, q_pe, kv, rope, weight, unfused, slots, kv_scale, interleaved)
    assert out.shape == (tokens, heads, rope_dim) and out.is_contiguous()
    assert torch.equal(out.cpu().view(torch.uint8), ref.cpu().view(torch.uint8))
    assert torch.equal(fused.cpu().view(torch.uint8), unfused.cpu().view(torch.uint8))
    assert not torch.equal(fused.cpu().view(torch.uint8), before.view(torch.uint8))  # the rows did land
    if cache_kind != "model":
        assert fused.float().abs().max() == 448  # some values saturate


def test_mla_prep_kernel_refuses_mismatched_inputs():
    q_pe = torch.zeros(2, 3, 8, device=KERNEL_DEVICE)
    kv, weight = torch.zeros(2, 48, device=KERNEL_DEVICE), torch.ones(40, device=KERNEL_DEVICE)
    cos = torch.zeros(16, 8, device=KERNEL_DEVICE)
    positions, slots = (torch.zeros(2, dtype=torch.int64, device=KERNEL_DEVICE) for _ in range(2))
    cache = torch.zeros(2, 8, 1, 48, device=KERNEL_DEVICE)
    with pytest.raises(ValueError, match="kv \\[T, 48\\]"):
        mla_prep(positions, q_pe, kv[:, :40], cos, cos, weight, 1e-6, cache, slots)
    with pytest.raises(ValueError, match="of torch.float32 or fp8"):
        mla_prep(positions, q_pe, kv, cos, cos, weight, 1e-6, cache.bfloat16(), slots)
    with pytest.raises(ValueError, match="only to fp8 caches"):
        mla_prep(positions, q_pe, kv, cos, cos, weight, 1e-6, cache, slots, kv_scale=0.5)
