"""llama.cpp's `deepseek2` files (DeepSeek-V2, V2-Lite, V3; ember/model/mla.py) and `llama4` files (Llama 4's
text model; ember/model/llama4.py) in the names and config keys of the transformers checkpoints they were
converted from. Names are gguf-py's tensor_mapping run backwards.

deepseek2 (DeepseekV2ForCausalLM / DeepseekV3ForCausalLM). What llama.cpp's converter (convert_hf_to_gguf.py,
DeepseekV2Model) changes on the way, and what Ember undoes:
- kv_b_proj [H * (nope + v), L]: older converters store it whole (attn_kv_b); newer ones split it per head
  into attn_k_b, each head's key rows transposed ([H, L, nope]), and attn_v_b ([H, v, L]) for llama.cpp's
  absorbed decode. `join_kv_b` puts the two back together; both forms load.
- The rotated channels are stored as the checkpoint has them: llama.cpp rotates deepseek2 in adjacent pairs
  (its "norm" rope), which is DeepSeek's own order (MlaConfig.rope_interleave), so there is nothing to undo.
- The MLA cache is written as MQA with one KV head: `head_count_kv` is 1 and, in newer files, `key_length` /
  `value_length` are the latent's widths, the per-head ones `key_length_mla` / `value_length_mla`.
- YaRN keeps `yarn_log_multiplier` = 0.1 * mscale_all_dim and no mscale: llama.cpp leaves the rotated
  channels unscaled, as transformers does where mscale equals mscale_all_dim (every released config), so
  Ember reads both as the one value.
- The multi-token-prediction layer is not converted.

Routing is what llama.cpp reads from the file: `expert_gating_func` sigmoid with `exp_probs_b` is V3's
(noaux_tc), softmax (the default, for files older than the key) is V2's, group-limited where
`expert_group_count` > 1 (transformers' group_limited_greedy; V3 files without the key route over all
experts, as llama.cpp does, i.e. one group); `expert_weights_norm` and `expert_weights_scale` are
norm_topk_prob and routed_scaling_factor.

llama4 (Llama4ForCausalLM). The converter (Llama4Model) keeps q and k rows as transformers has them (its
undo_permute is off: llama.cpp rotates adjacent pairs, as Llama 4 does), splits gate_up_proj into ffn_gate_exps
and ffn_up_exps, and writes llama3 rope scaling as the `rope_freqs` tensor (each frequency's divisor), read
here as rope type "freq_factors". llama.cpp's llama-model.cpp hard-codes what the file does not carry, and
Ember assumes the same: chunked attention in chunks of 8192 on the rope layers, every 4th layer NoPE (global,
with temperature tuning: floor_scale 8192, attn_scale 0.1), the QK L2 norm except on the 128-expert model
(Maverick, whose config turns it off), sigmoid routing applied to the expert's input. A file with
`llama4.attention.sliding_window` 0 (llama.cpp's rope-everywhere variant) is refused.
"""

from __future__ import annotations

import numpy as np

from ember.errors import ModelLoadError
from ember.model.gguf_tokenizer import GGUFMetadata

_SOFTMAX, _SIGMOID = 1, 2  # llama.cpp's llama_expert_gating_func_type, as `{arch}.expert_gating_func` stores it

LAYER_TENSORS = {
    "deepseek2": {
        "attn_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm",
        "attn_q": "self_attn.q_proj",
        "attn_q_a": "self_attn.q_a_proj",
        "attn_q_a_norm": "self_attn.q_a_layernorm",
        "attn_q_b": "self_attn.q_b_proj",
        "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
        "attn_kv_a_norm": "self_attn.kv_a_layernorm",
        "attn_kv_b": "self_attn.kv_b_proj",
        "attn_k_b": "self_attn.kv_b_proj",  # with attn_v_b: join_kv_b
        "attn_v_b": "self_attn.kv_b_proj",
        "attn_output": "self_attn.o_proj",
        "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
        "ffn_gate_inp": "mlp.gate",
        "exp_probs_b": "mlp.gate.e_score_correction_bias",  # stored as exp_probs_b.bias
        "ffn_gate_exps": "mlp.experts.gate_proj",
        "ffn_up_exps": "mlp.experts.up_proj",
        "ffn_down_exps": "mlp.experts.down_proj",
        "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
        "ffn_up_shexp": "mlp.shared_experts.up_proj",
        "ffn_down_shexp": "mlp.shared_experts.down_proj",
    },
}
_LLAMA4_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
LAYER_TENSORS["llama4"] = _LLAMA4_LAYER_TENSORS
UNSUFFIXED = {"mlp.gate.e_score_correction_bias"}
# Tensors decoded to float even where they could stay quantized: llama4.checkpoint_tensors reorders the rope
# layers' q and k rows within each head, which it does on dense tensors only.
DENSE_TENSORS = {"llama4": ("attn_q", "attn_k")}
# llama.cpp's fixed Llama 4 facts (llama-model.cpp), as transformers' Llama4TextConfig keys
_LLAMA4_FIXED = {
    "attention_chunk_size": 8192,
    "no_rope_layer_interval": 4,
    "attn_temperature_tuning": True,
    "floor_scale": 8192,
    "attn_scale": 0.1,
}
SPLIT_KV_B = ("attn_k_b", "attn_v_b")


def join_kv_b(k_b: np.ndarray, v_b: np.ndarray, heads: int, kv_lora_rank: int) -> np.ndarray:
    """transformers' kv_b_proj [H * (nope + v), L] from the converter's attn_k_b [H, L, nope] (each head's
    key rows transposed) and attn_v_b [H, v, L]."""
    k = k_b.reshape(heads, kv_lora_rank, -1).swapaxes(1, 2)
    v = v_b.reshape(heads, -1, kv_lora_rank)
    return np.concatenate([k, v], axis=1).reshape(-1, kv_lora_rank)


def deepseek2_config(meta: GGUFMetadata, tensor_names: set[str], rope_scaling: dict | None) -> dict:
    """DeepseekV2Config's / DeepseekV3Config's keys, from a deepseek2 file's metadata and tensor names
    (the rest, common to every decoder, gguf._hf_config reads; `rope_scaling` its reading of the rope keys)."""
    arch = "deepseek2"
    experts = meta.get(f"{arch}.expert_count")
    if not experts:
        raise ModelLoadError(meta.path, "a deepseek2 file without experts (Ember reads DeepSeek's MoE models only)")
    if meta.get(f"{arch}.nextn_predict_layers"):
        raise ModelLoadError(meta.path, "deepseek2.nextn_predict_layers: multi-token prediction is not supported")
    gating = meta.get(f"{arch}.expert_gating_func", _SOFTMAX)
    score_bias = any(name.endswith(".exp_probs_b.bias") for name in tensor_names)
    if gating not in (_SOFTMAX, _SIGMOID) or (gating == _SIGMOID) != score_bias:
        raise ModelLoadError(
            meta.path,
            f"expert_gating_func {gating} {'with' if score_bias else 'without'} exp_probs_b: Ember reads softmax "
            "routing (DeepSeek-V2) and sigmoid routing with its correction bias (DeepSeek-V3)",
        )
    v3 = gating == _SIGMOID
    rope_dim = meta.require(f"{arch}.rope.dimension_count")
    # newer converters: key_length / value_length are the latent's (MQA), the per-head widths *_mla
    key = meta.get(f"{arch}.attention.key_length_mla") or meta.require(f"{arch}.attention.key_length")
    value = meta.get(f"{arch}.attention.value_length_mla") or meta.require(f"{arch}.attention.value_length")
    groups = meta.get(f"{arch}.expert_group_count", 1)
    config = {
        "architectures": ["DeepseekV3ForCausalLM" if v3 else "DeepseekV2ForCausalLM"],
        "q_lora_rank": meta.get(f"{arch}.attention.q_lora_rank"),
        "kv_lora_rank": meta.require(f"{arch}.attention.kv_lora_rank"),
        "qk_rope_head_dim": rope_dim,
        "qk_nope_head_dim": key - rope_dim,
        "v_head_dim": value,
        "n_routed_experts": experts,
        "num_experts_per_tok": meta.require(f"{arch}.expert_used_count"),
        "moe_intermediate_size": meta.require(f"{arch}.expert_feed_forward_length"),
        "n_shared_experts": meta.get(f"{arch}.expert_shared_count", 0),
        "first_k_dense_replace": meta.get(f"{arch}.leading_dense_block_count", 0),
        "norm_topk_prob": bool(meta.get(f"{arch}.expert_weights_norm", False)),
        "routed_scaling_factor": float(meta.get(f"{arch}.expert_weights_scale", 1.0)),
        "topk_method": "noaux_tc" if v3 else "group_limited_greedy" if groups > 1 else "greedy",
        "n_group": groups,
        "topk_group": meta.get(f"{arch}.expert_group_used_count", groups),
        "rope_interleave": True,
    }
    log_mul = meta.get(f"{arch}.rope.scaling.yarn_log_multiplier")
    if rope_scaling is not None and rope_scaling["rope_type"] == "yarn" and log_mul:
        m = log_mul / 0.1
        config["rope_scaling"] = {**rope_scaling, "mscale": m, "mscale_all_dim": m}
    return config


def llama4_config(meta: GGUFMetadata) -> dict:
    """Llama4TextConfig's keys of a llama4 file beside the common ones gguf._hf_config reads: its MoE keys
    and llama.cpp's fixed facts (see the module docstring; its rope_freqs: gguf._rope_freqs_scaling)."""
    arch = "llama4"
    if meta.get(f"{arch}.attention.sliding_window") == 0:
        raise ModelLoadError(meta.path, "llama4.attention.sliding_window 0 (rope in every layer) is not supported")
    experts = meta.require(f"{arch}.expert_count")
    config = {
        "architectures": ["Llama4ForCausalLM"],
        "intermediate_size_mlp": meta.require(f"{arch}.feed_forward_length"),
        "intermediate_size": meta.require(f"{arch}.expert_feed_forward_length"),
        "num_local_experts": experts,
        "num_experts_per_tok": meta.require(f"{arch}.expert_used_count"),
        "interleave_moe_layer_step": meta.require(f"{arch}.interleave_moe_layer_step"),
        "use_qk_norm": experts != 128,
        **_LLAMA4_FIXED,
    }
    return config
