"""llama.cpp's `qwen3next` GGUF files (Qwen3-Next) in HF terms: what its converter (convert_hf_to_gguf.py,
Qwen3NextModel over Qwen2MoeModel) changes, undone here so ember/model/qwen3_next.py loads them as it
loads the HF checkpoint.

- `in_proj_qkvz` (grouped per key head: its q, k, then its value heads' v and z) is split into
  `attn_qkv` (every q, every k, every v) and `attn_gate` (every z); `merge_qkvz` interleaves them back.
  Both are read as floats (a quantized pair is decoded) since their rows are regrouped.
- `A_log` is stored as `ssm_a` = -exp(A_log); `dt_bias` as `ssm_dt.bias`; the convolution squeezed to
  [channels, kernel].
- Every (1 + w) RMSNorm is stored as 1 + w (the DeltaNet's own gated norm, `ssm_norm`, is not).
- The shared expert's sigmoid gate [1, hidden] comes as a vector.
- The layer pattern is `full_attention_interval`; the rotated share of a head `rope.dimension_count`.
"""

from __future__ import annotations

import numpy as np

from ember.model.gguf_tokenizer import GGUFMetadata

ARCH = "qwen3next"
LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",  # the query and its output gate per head, as HF's q_proj
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_qkv": "linear_attn.in_proj_qkv",  # not an HF name: merged with attn_gate into in_proj_qkvz
    "attn_gate": "linear_attn.in_proj_z",
    "ssm_ba": "linear_attn.in_proj_ba",
    "ssm_conv1d": "linear_attn.conv1d",
    "ssm_a": "linear_attn.A_log",
    "ssm_dt": "linear_attn.dt_bias",
    "ssm_norm": "linear_attn.norm",
    "ssm_out": "linear_attn.out_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
UNSUFFIXED = {"linear_attn.A_log", "linear_attn.dt_bias"}
MERGED = ("linear_attn.in_proj_qkv.weight", "linear_attn.in_proj_z.weight")


def config(meta: GGUFMetadata, head_dim: int) -> dict:
    """The HF config keys the common ones (ember/model/gguf.py) leave out."""
    inner = meta.require(f"{ARCH}.ssm.inner_size")
    v_heads = meta.require(f"{ARCH}.ssm.time_step_rank")
    return {
        "linear_num_key_heads": meta.require(f"{ARCH}.ssm.group_count"),
        "linear_num_value_heads": v_heads,
        "linear_key_head_dim": meta.require(f"{ARCH}.ssm.state_size"),
        "linear_value_head_dim": inner // v_heads,
        "linear_conv_kernel_dim": meta.require(f"{ARCH}.ssm.conv_kernel"),
        "full_attention_interval": meta.get(f"{ARCH}.full_attention_interval", 4),
        "partial_rotary_factor": meta.get(f"{ARCH}.rope.dimension_count", head_dim // 4) / head_dim,
        "shared_expert_intermediate_size": meta.get(f"{ARCH}.expert_shared_feed_forward_length", 0),
    }


def fix(name: str, w: np.ndarray) -> np.ndarray:
    """One decoded tensor (HF name) back to HF's values and shape."""
    if name.endswith(".A_log"):
        return np.log(-w)
    if name.endswith("conv1d.weight"):
        return w[:, None, :]
    if name.endswith("shared_expert_gate.weight"):
        return w.reshape(1, -1)
    if name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        return w - np.float32(1.0)
    return w


def merge_qkvz(qkv: np.ndarray, z: np.ndarray, hf_config: dict) -> np.ndarray:
    """attn_qkv [(2 Hk Dk + Hv Dv), hidden] and attn_gate [Hv Dv, hidden] -> in_proj_qkvz grouped per key head."""
    hk, dk = hf_config["linear_num_key_heads"], hf_config["linear_key_head_dim"]
    per_k = hf_config["linear_num_value_heads"] // hk * hf_config["linear_value_head_dim"]
    hidden = qkv.shape[-1]
    q, k, v = np.split(qkv, [hk * dk, 2 * hk * dk])
    parts = [q.reshape(hk, dk, hidden), k.reshape(hk, dk, hidden), v.reshape(hk, per_k, hidden)]
    return np.concatenate([*parts, z.reshape(hk, per_k, hidden)], axis=1).reshape(-1, hidden)
