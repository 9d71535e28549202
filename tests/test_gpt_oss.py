"""gpt-oss (GptOssForCausalLM) against transformers, from bf16/float32 safetensors and from OpenAI's
MXFP4 expert format.

The tiny checkpoint (tests/conftest.py "gpt-oss") alternates sliding (8 keys) and full layers, has
attention sinks, q/k/v/o biases, YaRN rope, and 4 experts with biases and a clamped SwiGLU whose limit
(1.0) the activations cross; its biases and sinks are redrawn large so that each of them moves the
logits. Every context outgrows the window. Greedy tokens equal transformers' in float32 with top-5
logprobs within 2e-3: alone, batched with chunked prefill, from the prefix cache, under preemption.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from conftest import (
    DEVICE,
    add_bpe_vocab,
    assert_same_outputs,
    gguf_writer,
    inproc_core,
    make_checkpoint,
    write_gguf_and_twin,
)
from gguf import GGMLQuantizationType as QType
from safetensors.torch import load_file, save_file
from test_hf_equality import hf_references
from test_new_archs import GREEDY, NUM_TOKENS, PROMPTS, SCENARIOS, assert_scenario_matches

from ember import LLM, SamplingParams
from ember.model.hf_config import ModelConfig
from ember.model.layers import RotaryEmbedding
from ember.model.moe import SparseMoeBlock
from ember.quant.experts import QuantizedExperts, dequantize_experts


def _config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return _checkpoint(tmp_path_factory.mktemp("gpt-oss") / "gpt-oss")


def _checkpoint(path: Path, **overrides) -> Path:
    path = make_checkpoint(path, "gpt-oss", **overrides)
    tensors = load_file(path / "model.safetensors")
    gen = torch.Generator().manual_seed(1)
    for name, t in tensors.items():
        if name.endswith(("_bias", ".bias", ".sinks")):
            tensors[name] = torch.randn(t.shape, generator=gen) * (1.0 if name.endswith(".sinks") else 0.3)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def references(checkpoint) -> list[tuple[list[int], torch.Tensor]]:
    return hf_references({"gpt-oss": checkpoint}, PROMPTS, NUM_TOKENS)["gpt-oss"]


def _block_bytes(block_size: int) -> int:
    return 2 * 3 * block_size * 2 * 16 * 4  # K+V, layers, block, KV heads, head_dim, float32


def _llm(path: Path, **args) -> LLM:
    return LLM(str(path), device=DEVICE, dtype="float32", engine_process=False, **{"kv_cache_memory": 0.02, **args})


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_matches_transformers(checkpoint, references, scenario):
    args = dict(SCENARIOS[scenario])
    if scenario == "preempted":  # 14 blocks of 8 hold about two of these sequences at once
        args["kv_cache_memory"] = 14 * _block_bytes(8) / 2**30
    llm = _llm(checkpoint, **args)
    model = inproc_core(llm).runner.model
    assert [layer.self_attn.sliding_window for layer in model.model.layers] == [8, None, 8]
    assert all(isinstance(layer.mlp, SparseMoeBlock) for layer in model.model.layers)
    assert_scenario_matches(llm, scenario, references)


def test_sinks_change_the_output(checkpoint, references, tmp_path):
    """The references depend on the sinks: with every sink at -inf (no sink) the tokens differ."""
    d = shutil.copytree(checkpoint, tmp_path / "no-sinks")
    tensors = load_file(d / "model.safetensors")
    save_file(
        {n: torch.full_like(t, -1e4) if n.endswith(".sinks") else t for n, t in tensors.items()},
        d / "model.safetensors",
        metadata={"format": "pt"},
    )
    outs = _llm(d).generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] != [tokens for tokens, _ in references]


def test_yarn_table_is_transformers():
    """cos/sin of YaRN (with and without truncation, and an explicit attention_factor) bit for bit as
    transformers' rotary embedding computes them."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding

    for rope in (
        {"factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False},
        {"factor": 8.0},
        {"factor": 4.0, "attention_factor": 1.25, "beta_fast": 16.0, "beta_slow": 2.0},
    ):
        params = {"rope_type": "yarn", "rope_theta": 150000.0, "original_max_position_embeddings": 64, **rope}
        hf_cfg = GptOssConfig(
            head_dim=16, hidden_size=64, num_attention_heads=4, max_position_embeddings=512, rope_parameters=params
        )
        positions = torch.arange(300)[None]
        cos, sin = GptOssRotaryEmbedding(hf_cfg)(torch.zeros(1, dtype=torch.float32), positions)
        cfg = ModelConfig.from_hf_config({**hf_cfg.to_dict(), "architectures": ["GptOssForCausalLM"]})
        ours = RotaryEmbedding(16, 300, cfg.rope_theta, cfg.rope_scaling)
        assert torch.equal(ours.cos[:, :8], cos[0]) and torch.equal(ours.sin[:, :8], sin[0]), rope


def test_tp2_matches_tp1(checkpoint):
    """Heads (and their sinks) and every expert's intermediate rows split over two ranks; the o_proj and
    down biases are added by rank 0 alone."""
    from test_tensor_parallel import _assert_same

    _assert_same(str(checkpoint))


# --- MXFP4 experts (quantization_config.quant_method = "mxfp4") ------------------------------------

FP4_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def _pack_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[E, N, K] float -> (blocks uint8 [E, N, K/32, 16], scales uint8 [E, N, K/32], the value they
    hold) in OpenAI's published layout (transformers' integrations/mxfp4.py decodes it): a shared
    power-of-two per 32 inputs (e8m0, bias 127), each value the nearest e2m1 code, element 2j in the
    low and 2j + 1 in the high nibble of byte j."""
    e, n, k = w.shape
    groups = w.reshape(e, n, k // 32, 32)
    exponent = torch.floor(torch.log2(groups.abs().amax(-1).clamp(min=1e-30))) - 2  # amax / 2^e in [4, 8)
    scaled = groups / torch.exp2(exponent)[..., None]
    codes = (scaled[..., None] - FP4_VALUES).abs().argmin(-1).to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    value = FP4_VALUES[codes.long()] * torch.exp2(exponent)[..., None]
    return blocks, (exponent + 127).to(torch.uint8), value.reshape(e, n, k)


@pytest.fixture(scope="module")
def mxfp4_pair(checkpoint, tmp_path_factory) -> tuple[Path, Path]:
    """The checkpoint with MXFP4 experts, and its twin holding what they decode to (transformers' layout)."""
    root = tmp_path_factory.mktemp("mxfp4")
    mxfp4, twin = shutil.copytree(checkpoint, root / "mxfp4"), shutil.copytree(checkpoint, root / "twin")
    tensors = load_file(checkpoint / "model.safetensors")
    packed, decoded = {}, {}
    for name, t in tensors.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales, value = _pack_mxfp4(t.transpose(1, 2).contiguous())  # stored [E, out, in]
            packed |= {f"{name}_blocks": blocks.reshape(*blocks.shape[:2], -1, 16), f"{name}_scales": scales}
            decoded[name] = value.transpose(1, 2).contiguous()
        else:
            packed[name] = decoded[name] = t
    save_file(packed, mxfp4 / "model.safetensors", metadata={"format": "pt"})
    save_file(decoded, twin / "model.safetensors", metadata={"format": "pt"})
    (mxfp4 / "config.json").write_text(
        json.dumps(
            {
                **_config(checkpoint),
                "quantization_config": {
                    "quant_method": "mxfp4",
                    "modules_to_not_convert": [
                        "model.layers.*.self_attn",
                        "model.layers.*.mlp.router",
                        "model.embed_tokens",
                        "lm_head",
                    ],
                },
            }
        )
    )
    return mxfp4, twin


def test_mxfp4_decodes_as_transformers(mxfp4_pair):
    """Ember's MXFP4 decode (the GGUF MXFP4 decoder after re-laying the blocks out) equals
    transformers' own dequantization of the same tensors, which equals the packer's values."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from ember.model.gpt_oss import mxfp4_experts

    mxfp4, twin = mxfp4_pair
    packed, decoded = load_file(mxfp4 / "model.safetensors"), load_file(twin / "model.safetensors")
    for proj in ("gate_up_proj", "down_proj"):
        name = f"model.layers.1.mlp.experts.{proj}"
        blocks, scales = packed[f"{name}_blocks"], packed[f"{name}_scales"]
        hf = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, in, out]
        assert torch.equal(hf, decoded[name])
        ours = mxfp4_experts(blocks, scales)
        assert (ours.kind, ours.group_size) == ("int8", 32)
        assert torch.equal(dequantize_experts(ours), hf.transpose(1, 2))


def test_mxfp4_checkpoint_matches_its_decoded_twin(mxfp4_pair):
    """Loaded weights equal the decoded reference exactly (gate and up de-interleaved, kept quantized),
    and the model gives the twin's tokens and logprobs."""
    mxfp4, twin = mxfp4_pair
    decoded = load_file(twin / "model.safetensors")
    outputs = []
    for path in (mxfp4, twin):
        llm = _llm(path, block_size=8, max_num_batched_tokens=16)
        experts = inproc_core(llm).runner.model.model.layers[2].mlp.experts
        assert isinstance(experts.w13, QuantizedExperts) == isinstance(experts.w2, QuantizedExperts) == (path == mxfp4)
        w13 = dequantize_experts(experts.w13) if path == mxfp4 else experts.w13.data
        gate_up = decoded["model.layers.2.mlp.experts.gate_up_proj"]
        assert torch.equal(w13, torch.cat([gate_up[..., 0::2], gate_up[..., 1::2]], dim=-1).transpose(1, 2))
        outputs.append(llm.generate(PROMPTS[::2], GREEDY, use_tqdm=False))
    for a, b in zip(*outputs):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert {t: v.logprob for t, v in x.items()} == pytest.approx({t: v.logprob for t, v in y.items()}, abs=1e-5)


def test_mxfp4_unpaired_blocks_are_named(mxfp4_pair, tmp_path):
    mxfp4, _ = mxfp4_pair
    d = shutil.copytree(mxfp4, tmp_path / "broken")
    tensors = load_file(d / "model.safetensors")
    del tensors["model.layers.0.mlp.experts.down_proj_scales"]
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="down_proj_blocks has no model.layers.0.mlp.experts.down_proj_scales"):
        _llm(d)


# --- GGUF: llama.cpp's gpt-oss architecture --------------------------------------------------------

_GGUF_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "self_attn.sinks": "attn_sinks.weight",
    "mlp.router.weight": "ffn_gate_inp.weight",
    "mlp.router.bias": "ffn_gate_inp.bias",
    **{
        f"self_attn.{p}_proj.{s}": f"attn_{g}.{s}"
        for p, g in (("q", "q"), ("k", "k"), ("v", "v"), ("o", "output"))
        for s in ("weight", "bias")
    },
}
_GGUF_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
# experts as llama.cpp's converter writes OpenAI's checkpoints: MXFP4 (down here in Q8_0, a second format)
_EXPERT_TYPES = {"ffn_gate_exps": QType.MXFP4, "ffn_up_exps": QType.MXFP4, "ffn_down_exps": QType.Q8_0}


def _quantized(w, name: str, weight: np.ndarray) -> np.ndarray:
    """Write an expert tensor [E, N, K] quantized; return what it decodes to."""
    qtype = _EXPERT_TYPES[name.split(".")[2]]
    data = gguf.quants.quantize(weight, qtype)
    w.add_tensor(name, data, raw_dtype=qtype)
    return gguf.quants.dequantize(data, qtype).reshape(weight.shape)


def _write_gguf(src: Path, path: Path, twin: Path) -> None:
    """The checkpoint as llama.cpp's converter writes gpt-oss (gate_up split into gate and up, experts
    transposed to [E, out, in], quantized); at twin the HF checkpoint of what the file decodes to."""
    cfg = _config(src)
    rope = cfg["rope_parameters"]
    w = gguf_writer(path, "gpt-oss", cfg)
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_vocab_size(cfg["vocab_size"])
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(rope["factor"])
    w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    w.add_sliding_window(cfg["sliding_window"])
    w.add_expert_count(cfg["num_local_experts"])
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    w.add_expert_feed_forward_length(cfg["intermediate_size"])
    add_bpe_vocab(w, src)
    w.add_tokenizer_pre("gpt-2")
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    decoded = {}
    for name, t in load_file(src / "model.safetensors").items():
        weight = t.float().numpy()
        if name in _GGUF_GLOBAL:
            w.add_tensor(_GGUF_GLOBAL[name], weight)
            decoded[name] = weight
            continue
        _, _, layer, rest = name.split(".", 3)
        blk = f"blk.{layer}"
        if rest == "mlp.experts.gate_up_proj":  # [E, H, 2I], gate and up interleaved
            gate = _quantized(
                w, f"{blk}.ffn_gate_exps.weight", np.ascontiguousarray(weight[..., 0::2].transpose(0, 2, 1))
            )
            up = _quantized(w, f"{blk}.ffn_up_exps.weight", np.ascontiguousarray(weight[..., 1::2].transpose(0, 2, 1)))
            decoded[name] = np.stack([gate, up], axis=-1).transpose(0, 2, 1, 3).reshape(weight.shape).copy()
        elif rest == "mlp.experts.down_proj":  # [E, I, H]
            down = _quantized(w, f"{blk}.ffn_down_exps.weight", np.ascontiguousarray(weight.transpose(0, 2, 1)))
            decoded[name] = down.transpose(0, 2, 1).copy()
        elif rest == "mlp.experts.gate_up_proj_bias":
            w.add_tensor(f"{blk}.ffn_gate_exps.bias", np.ascontiguousarray(weight[:, 0::2]))
            w.add_tensor(f"{blk}.ffn_up_exps.bias", np.ascontiguousarray(weight[:, 1::2]))
            decoded[name] = weight
        elif rest == "mlp.experts.down_proj_bias":
            w.add_tensor(f"{blk}.ffn_down_exps.bias", weight)
            decoded[name] = weight
        else:
            w.add_tensor(f"{blk}.{_GGUF_LAYER[rest]}", weight)
            decoded[name] = weight
    write_gguf_and_twin(w, src, twin, decoded)


@pytest.fixture(scope="module")
def gguf_pair(tmp_path_factory) -> tuple[Path, Path]:
    """Experts of 32 rows and 64 inputs: whole MXFP4 / Q8_0 blocks of 32. The SwiGLU limit is the
    released models' 7.0, which llama.cpp fixes (a GGUF file does not carry it)."""
    root = tmp_path_factory.mktemp("gpt-oss-gguf")
    pair = root / "gpt-oss.gguf", root / "twin"
    _write_gguf(_checkpoint(root / "src", swiglu_limit=7.0), *pair)
    return pair


def test_gguf_matches_its_dequantized_twin(gguf_pair):
    path, twin = gguf_pair
    outputs = []
    for model in (path, twin):
        llm = _llm(model, block_size=8, max_num_batched_tokens=16)
        model_config = inproc_core(llm).runner.model.config
        twin_config = ModelConfig.from_hf_config(_config(twin))
        for key in (
            "architecture",
            "moe",
            "layer_types",
            "sliding_window",
            "rope_theta",
            "rope_scaling",
            "attention_sinks",
            "o_proj_bias",
            "attention_bias",
        ):
            assert getattr(model_config, key) == getattr(twin_config, key), key
        experts = inproc_core(llm).runner.model.model.layers[1].mlp.experts
        if model == path:  # MXFP4 gate/up and Q8_0 down both kept as exact int8 codes per 32
            assert (experts.w13.kind, experts.w13.group_size, experts.w2.kind) == ("int8", 32, "int8")
        outputs.append(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    for a, b in zip(*outputs):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert {t: v.logprob for t, v in x.items()} == pytest.approx({t: v.logprob for t, v in y.items()}, abs=1e-5)


# --- the GPU path (every Triton kernel; through the interpreter on CPU) -----------------------------


@pytest.mark.parametrize("model", ["bf16-checkpoint", "mxfp4"])
def test_triton_path_matches_torch_path(checkpoint, mxfp4_pair, monkeypatch, model):
    """The engine on the kernels (sinks in decode and prefill attention, the fused MoE's biases and
    clamped SwiGLU, dense and MXFP4-as-int8 experts) gives the PyTorch path's tokens and logprobs, with
    a prefill chunk and decodes past the 8-key window."""
    from ember.ops import registry as backend

    path = checkpoint if model == "bf16-checkpoint" else mxfp4_pair[0]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=2)

    def run() -> list:
        return _llm(path, kv_cache_memory=0.01, max_num_batched_tokens=16).generate(
            PROMPTS[2:3], params, use_tqdm=False
        )

    torch_outs = run()
    monkeypatch.setattr(backend, "FORCE_TRITON", True)
    assert_same_outputs(torch_outs, run(), abs=1e-3)


def test_dummy_weights_run(checkpoint):
    """--load-format dummy (the benchmark configs' path) fills sinks and expert biases too."""
    llm = _llm(checkpoint, kv_cache_memory=0.01, load_format="dummy")
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    assert len(llm.generate(PROMPTS[:2], params, use_tqdm=False)[1].outputs[0].token_ids) == 4
    assert not any(p.is_meta for p in inproc_core(llm).runner.model.parameters())
