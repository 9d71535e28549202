"""GGUF files of llama.cpp's `deepseek2` architecture (ember/model/gguf_moe.py), written from the tiny
DeepSeek checkpoints of tests/test_deepseek.py as llama.cpp's converter writes them: its names, metadata
(MQA key/value lengths, routing keys, YaRN's log multiplier), stacked experts, and kv_b_proj whole (older
converters) or split into attn_k_b (transposed per head) and attn_v_b (newer ones). Each loads as its
safetensors twin (the same weights, as the file's tensors decode) and generates the same greedy tokens and
logprobs; variants Ember does not read fail with a clear error.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
from conftest import (
    _DEEPSEEK_YARN,
    DEVICE,
    add_bpe_vocab,
    assert_same_outputs,
    gguf_writer,
    llama3_rope_freqs,
    make_checkpoint,
)
from conftest import write_gguf_and_twin as write_twin
from gguf import GGMLQuantizationType as QType
from safetensors.numpy import load_file
from test_new_archs import GREEDY, PROMPTS

from ember import LLM
from ember.errors import ModelLoadError
from ember.model.gguf import load_gguf
from ember.model.hf_config import ModelConfig
from ember.ops import linear_native

# llama.cpp keeps no mscale beside mscale_all_dim (it leaves the rotated channels unscaled): equal, as released
_YARN = {**_DEEPSEEK_YARN, "mscale": 1.0, "mscale_all_dim": 1.0}
_GLOBAL = {"model.embed_tokens.weight": "token_embd", "model.norm.weight": "output_norm", "lm_head.weight": "output"}
_LAYER = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.q_a_proj": "attn_q_a",
    "self_attn.q_a_layernorm": "attn_q_a_norm",
    "self_attn.q_b_proj": "attn_q_b",
    "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa",
    "self_attn.kv_a_layernorm": "attn_kv_a_norm",
    "self_attn.kv_b_proj": "attn_kv_b",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp",
    "mlp.shared_experts.gate_proj": "ffn_gate_shexp",
    "mlp.shared_experts.up_proj": "ffn_up_shexp",
    "mlp.shared_experts.down_proj": "ffn_down_shexp",
}
# (checkpoint, overrides, kv_b layout, dtype of the matrices: "q8_0" where whole blocks fit, else float32)
CASES = {
    "v2-lite-split-f32": ("deepseek-v2-lite", {}, "split", np.float32),
    "v2-whole-f16": ("deepseek-v2", {"rope_parameters": _YARN}, "whole", np.float16),
    "v3-split-f32": ("deepseek-v3", {"rope_parameters": _YARN}, "split", np.float32),
    "v3-whole-q8_0": ("deepseek-v3", {"rope_parameters": _YARN}, "whole", "q8_0"),
}


def _metadata(w, cfg: dict) -> None:
    """What DeepseekV2Model.set_gguf_parameters writes."""
    w.add_vocab_size(cfg["vocab_size"])
    rope = cfg["rope_parameters"]
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_rope_dimension_count(cfg["qk_rope_head_dim"])
    if rope["rope_type"] == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])
    if cfg["q_lora_rank"] is not None:
        w.add_q_lora_rank(cfg["q_lora_rank"])
    w.add_kv_lora_rank(cfg["kv_lora_rank"])
    w.add_key_length(cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"])  # MQA over the latent
    w.add_value_length(cfg["kv_lora_rank"])
    w.add_key_length_mla(cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"])
    w.add_value_length_mla(cfg["v_head_dim"])
    w.add_leading_dense_block_count(cfg["first_k_dense_replace"])
    w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    w.add_expert_count(cfg["n_routed_experts"])
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    w.add_expert_shared_count(cfg["n_shared_experts"])
    w.add_expert_weights_scale(cfg["routed_scaling_factor"])
    if cfg["norm_topk_prob"]:
        w.add_expert_weights_norm(True)
    if cfg["model_type"] == "deepseek_v3":
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    if cfg.get("n_group"):
        w.add_expert_group_count(cfg["n_group"])
        w.add_expert_group_used_count(cfg["topk_group"])


def _write(src: Path, path: Path, twin: Path, layout: str, dtype: type | str) -> None:
    cfg = json.loads((src / "config.json").read_text())
    w = gguf_writer(path, "deepseek2", {**cfg, "num_key_value_heads": 1})
    _metadata(w, cfg)
    add_bpe_vocab(w, src)
    w.add_tokenizer_pre("gpt-2")
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    heads, nope, rank = cfg["num_attention_heads"], cfg["qk_nope_head_dim"], cfg["kv_lora_rank"]
    decoded, experts = {}, {}

    def add(name: str, weight: np.ndarray) -> np.ndarray:
        if dtype == "q8_0" and weight.shape[-1] % 32 == 0 and weight.ndim > 1 and "ffn_gate_inp" not in name:
            data = gguf.quants.quantize(np.ascontiguousarray(weight), QType.Q8_0)
            w.add_tensor(name, data, raw_dtype=QType.Q8_0)
            return gguf.quants.dequantize(data, QType.Q8_0).reshape(weight.shape)
        stored = weight.astype(dtype) if weight.ndim > 1 and dtype != "q8_0" else weight
        w.add_tensor(name, stored)
        return stored.astype(np.float32)

    for name, weight in load_file(src / "model.safetensors").items():
        if name in _GLOBAL:
            decoded[name] = add(f"{_GLOBAL[name]}.weight", weight)
            continue
        _, _, layer, rest = name.split(".", 3)
        if ".experts." in rest:  # stacked [E, N, K] as the converter merges them, below
            _, _, expert, proj, _ = rest.split(".")
            experts.setdefault((layer, proj), {})[int(expert)] = name, weight
        elif rest.endswith("e_score_correction_bias"):
            decoded[name] = add(f"blk.{layer}.exp_probs_b.bias", weight)
        elif rest.startswith("self_attn.kv_b_proj") and layout == "split":
            kv_b = weight.reshape(heads, -1, rank)
            add(f"blk.{layer}.attn_k_b.weight", np.ascontiguousarray(kv_b[:, :nope].transpose(0, 2, 1)))
            add(f"blk.{layer}.attn_v_b.weight", np.ascontiguousarray(kv_b[:, nope:]))
            assert dtype != "q8_0", "Q8_0 blocks of 32 do not fit attn_k_b's 16-wide rows"
            decoded[name] = weight.astype(dtype).astype(np.float32)  # the same rounding, element by element
        else:
            decoded[name] = add(f"blk.{layer}.{_LAYER[rest.removesuffix('.weight')]}.weight", weight)
    for (layer, proj), by_expert in experts.items():
        names, weights = zip(*(by_expert[e] for e in sorted(by_expert)))
        stacked = add(f"blk.{layer}.ffn_{proj.removesuffix('_proj')}_exps.weight", np.stack(weights))
        decoded.update(zip(names, stacked))
    write_twin(w, src, twin, decoded)


def _generate(path: Path, quantization: str = "none") -> list:
    llm = LLM(
        str(path),
        device=DEVICE,
        dtype="float32",
        engine_process=False,
        kv_cache_memory=0.01,
        block_size=8,
        max_num_batched_tokens=16,
        quantization=quantization,
    )
    return llm.generate(PROMPTS, GREEDY, use_tqdm=False)


@pytest.mark.parametrize("case", CASES)
def test_deepseek2_file_gives_its_twins_tokens(tmp_path, monkeypatch, case):
    monkeypatch.setattr(linear_native, "CPU_INT8_BF16", False)  # Q8_0 in float32 arithmetic, as the float32 twin
    arch, overrides, layout, dtype = CASES[case]
    src = make_checkpoint(tmp_path / "hf", arch, **overrides)
    path, twin = tmp_path / "model.gguf", tmp_path / "twin"
    _write(src, path, twin, layout, dtype)
    cfg = load_gguf(str(path)).hf_config
    assert cfg["architectures"] == ["DeepseekV3ForCausalLM" if arch == "deepseek-v3" else "DeepseekV2ForCausalLM"]
    ours = ModelConfig.from_hf_config(cfg)
    theirs = ModelConfig.from_hf_config(json.loads((twin / "config.json").read_text()))
    assert (ours.moe, ours.rope_scaling) == (theirs.moe, theirs.rope_scaling)  # routing and YaRN as the checkpoint's
    quantization = "none"
    if dtype == "q8_0":  # kv_b_proj, o_proj and the experts stay quantized (the MLA decode absorbs kv_b as loaded)
        kinds = {name: type(t).__name__ for name, t in load_gguf(str(path)).tensors(keep_quantized=True)}
        assert kinds["model.layers.1.self_attn.kv_b_proj.weight"] == "QuantizedWeight"
        assert kinds["model.layers.1.mlp.experts.down_proj.weight"] == "QuantizedExperts"
        quantization = "gguf"
    assert_same_outputs(_generate(path, quantization), _generate(twin), abs=1e-4)


def _write_header(path: Path, tensors: dict[str, np.ndarray], **keys) -> None:
    """A one-layer deepseek2 header (the ranks, experts and routing of `keys`) with the given tensors."""
    w = gguf_writer(
        path,
        "deepseek2",
        dict(
            max_position_embeddings=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            rms_norm_eps=1e-6,
        ),
    )
    w.add_tokenizer_model("gpt2")
    w.add_token_list(["a", "b", "ab"])
    w.add_token_merges(["a b"])
    ranks = {"kv_lora_rank": 16, "rope_dimension_count": 8, "key_length": 24, "value_length": 16}
    for key, value in {**ranks, **keys}.items():
        getattr(w, f"add_{key}")(value)
    for name, value in tensors.items():
        w.add_tensor(name, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize(
    ("keys", "tensors", "match"),
    [
        ({}, {}, "a deepseek2 file without experts"),
        (
            {"expert_count": 4, "expert_used_count": 2, "expert_gating_func": gguf.ExpertGatingFuncType.SIGMOID},
            {},
            "expert_gating_func 2 without exp_probs_b",
        ),
        (
            {"expert_count": 4, "expert_used_count": 2},
            {"blk.0.exp_probs_b.bias": np.zeros(4, np.float32)},
            "expert_gating_func 1 with exp_probs_b",
        ),
        ({"expert_count": 4, "expert_used_count": 2, "nextn_predict_layers": 1}, {}, "multi-token prediction"),
        (
            {"expert_count": 4, "expert_used_count": 2},
            {"blk.0.attn_q_nope.weight": np.zeros((4, 4), np.float32)},
            "unexpected tensor 'blk.0.attn_q_nope.weight' for architecture 'deepseek2'",
        ),
    ],
)
def test_unsupported_deepseek2_variants_are_refused(tmp_path, keys, tensors, match):
    path = tmp_path / "bad.gguf"
    _write_header(path, tensors, **keys)
    with pytest.raises(ModelLoadError, match=match):
        load_gguf(str(path))


# --- llama4 ---------------------------------------------------------------------------------------

# The tiny Llama 4 checkpoint with what llama.cpp hard-codes for the architecture (ember/model/gguf_moe.py):
# chunks of 8192, every 4th layer NoPE, temperature tuning with floor_scale 8192 and attn_scale 0.1
_LLAMA4_FIXED = dict(attention_chunk_size=8192, floor_scale=8192, attn_scale=0.1, no_rope_layers=None)
_LLAMA4_LAYER = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "feed_forward.gate_proj": "ffn_gate",
    "feed_forward.up_proj": "ffn_up",
    "feed_forward.down_proj": "ffn_down",
    "feed_forward.router": "ffn_gate_inp",
    "feed_forward.shared_expert.gate_proj": "ffn_gate_shexp",
    "feed_forward.shared_expert.up_proj": "ffn_up_shexp",
    "feed_forward.shared_expert.down_proj": "ffn_down_shexp",
}


def _write_llama4(src: Path, path: Path, twin: Path, dtype: type | str) -> None:
    """As Llama4Model writes it: q/k rows unpermuted, gate_up split and transposed, llama3 as rope_freqs."""
    cfg = json.loads((src / "config.json").read_text())
    w = gguf_writer(path, "llama4", {**cfg, "intermediate_size": cfg["intermediate_size_mlp"]})
    w.add_vocab_size(cfg["vocab_size"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_rope_dimension_count(cfg["head_dim"])
    w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    w.add_expert_count(cfg["num_local_experts"])
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    w.add_interleave_moe_layer_step(cfg["interleave_moe_layer_step"])
    w.add_expert_feed_forward_length(cfg["intermediate_size"])
    add_bpe_vocab(w, src)
    w.add_tokenizer_pre("gpt-2")
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    w.add_tensor("rope_freqs.weight", llama3_rope_freqs(cfg["rope_parameters"], cfg["head_dim"]))
    decoded = {}

    def add(name: str, weight: np.ndarray) -> np.ndarray:
        """Store `weight` in the file (matrices as `dtype`, or Q8_0); what the stored tensor decodes to."""
        if weight.ndim == 1:
            w.add_tensor(name, weight)
            return weight
        if dtype == "q8_0":
            data = gguf.quants.quantize(np.ascontiguousarray(weight), QType.Q8_0)
            w.add_tensor(name, data, raw_dtype=QType.Q8_0)
            return gguf.quants.dequantize(data, QType.Q8_0).reshape(weight.shape)
        w.add_tensor(name, np.ascontiguousarray(weight.astype(dtype)))
        return weight.astype(dtype).astype(np.float32)

    for name, weight in load_file(src / "model.safetensors").items():
        if name in _GLOBAL:
            decoded[name] = add(f"{_GLOBAL[name]}.weight", weight)
            continue
        _, _, layer, rest = name.split(".", 3)
        if rest == "feed_forward.experts.gate_up_proj":  # [E, H, 2I] -> gate and up [E, I, H]
            gate, up = np.split(weight.transpose(0, 2, 1), 2, axis=1)
            parts = [add(f"blk.{layer}.ffn_{part}_exps.weight", x) for part, x in (("gate", gate), ("up", up))]
            decoded[name] = np.concatenate(parts, axis=1).transpose(0, 2, 1)
        elif rest == "feed_forward.experts.down_proj":  # [E, I, H] -> [E, H, I]
            decoded[name] = add(f"blk.{layer}.ffn_down_exps.weight", weight.transpose(0, 2, 1)).transpose(0, 2, 1)
        else:
            decoded[name] = add(f"blk.{layer}.{_LLAMA4_LAYER[rest.removesuffix('.weight')]}.weight", weight)
    decoded = {name: np.ascontiguousarray(x, dtype=np.float32) for name, x in decoded.items()}
    write_twin(w, src, twin, decoded)


@pytest.mark.parametrize("dtype", [np.float32, np.float16, "q8_0"])
def test_llama4_file_gives_its_twins_tokens(tmp_path, monkeypatch, dtype):
    """Q8_0: matrices and stacked experts stay quantized, except the q and k the load reorders; in float32
    arithmetic (CPU_INT8_BF16 off), as the float32 twin computes."""
    monkeypatch.setattr(linear_native, "CPU_INT8_BF16", False)
    src = make_checkpoint(tmp_path / "hf", "llama4", **_LLAMA4_FIXED)
    path, twin = tmp_path / "model.gguf", tmp_path / "twin"
    _write_llama4(src, path, twin, dtype)
    ours = ModelConfig.from_hf_config(load_gguf(str(path)).hf_config)
    theirs = ModelConfig.from_hf_config(json.loads((twin / "config.json").read_text()))
    for key in ("layer_types", "nope_layers", "attention_chunk_size", "attn_temperature", "moe", "weightless_qk_norm"):
        assert getattr(ours, key) == getattr(theirs, key), key
    # rope_freqs divide each frequency as llama3 scaling does, to float32 rounding
    assert ours.rope_scaling is not None and ours.rope_scaling["rope_type"] == "freq_factors"
    if dtype == "q8_0":
        kinds = {name: type(t).__name__ for name, t in load_gguf(str(path)).tensors(keep_quantized=True)}
        assert kinds["model.layers.0.self_attn.q_proj.weight"] == "ndarray"
        assert kinds["model.layers.0.self_attn.o_proj.weight"] == "QuantizedWeight"
        assert kinds["model.layers.1.mlp.experts.gate_proj.weight"] == "QuantizedExperts"
    quantization = "gguf" if dtype == "q8_0" else "none"
    assert_same_outputs(_generate(path, quantization), _generate(twin), abs=1e-4)


def test_llama4_rope_everywhere_variant_is_refused(tmp_path):
    src = make_checkpoint(tmp_path / "hf", "llama4", **_LLAMA4_FIXED)
    path = tmp_path / "model.gguf"
    cfg = json.loads((src / "config.json").read_text())
    w = gguf_writer(path, "llama4", {**cfg, "intermediate_size": cfg["intermediate_size_mlp"]})
    w.add_sliding_window(0)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(["a", "b", "ab"])
    w.add_token_merges(["a b"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError, match="sliding_window 0"):
        load_gguf(str(path))
