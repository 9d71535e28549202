"""What the integer checkpoint formats share: int32 words holding several small codes, the affine
`(q - z) * s` they all dequantize by, and act-order group indices.

Every format here dequantizes as w = (q - z) * s with q, z small integers and s a 16-bit float
(fp16 or bf16, as AutoAWQ, GPTQ and llm-compressor save them). Ember's form is q * s + zeros, so
zeros = -z * s: q * s and z * s each need at most 8 + 11 significant bits, so both are exact in
float32, and so is their difference, which equals the exactly representable (q - z) * s. The
loaded weight is then bit for bit the format's own dequantization computed in float32. (A float32
scale, which no tool writes, would round the two products separately: within an ulp, not exact.)
"""

from __future__ import annotations

import torch

from ember.quant.formats import QuantizedWeight, pack_int4


def unpack_int32(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words -> their 32 / bits codes each (unsigned, lowest bits first), laid out along `dim`:
    element j * (32 / bits) + i of the result is code i of word j. int32 [.., M] -> int32 [.., M * 32 / bits]."""
    per_word = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device)
    words = packed.to(torch.int32).movedim(dim, -1)
    unpacked = (words.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return unpacked.reshape(*words.shape[:-1], words.shape[-1] * per_word).movedim(-1, dim)


def affine_weight(
    q: torch.Tensor, z: torch.Tensor, s: torch.Tensor, bits: int, group_size: int, in_perm: torch.Tensor | None = None
) -> QuantizedWeight:
    """Ember's form of w[n, k] = (q[n, k] - z[n, g]) * s[n, g], g = k // group_size, with unsigned
    `bits`-bit codes q [N, K] and integer zero points z [N, G] (exact: see the module docstring).

    4-bit codes stay unsigned nibbles with zeros = -z * s. 8-bit codes are stored signed, q - 128,
    with zeros = (128 - z) * s, which is None for symmetric files (every z = 128): those then take
    the per-channel int8 kernels."""
    s = s.float()
    if bits == 4:
        return QuantizedWeight("int4", pack_int4(q), s, -z.float() * s, group_size, q.shape[1], in_perm=in_perm)
    offset = 128 - z
    zeros = None if bool((offset == 0).all()) else offset.float() * s
    return QuantizedWeight("int8", (q - 128).to(torch.int8), s, zeros, group_size, q.shape[1], in_perm=in_perm)


def act_order(g_idx: torch.Tensor | None, in_features: int, group_size: int) -> torch.Tensor | None:
    """The column order that makes act-order groups contiguous, or None when they already are.

    GPTQ with desc_act quantizes columns in order of decreasing Hessian diagonal, so group j holds
    `group_size` columns scattered over K (`g_idx[k]` is column k's group). A stable sort by group
    gathers each group's columns; the codes are stored in that order and the layer gathers x to
    match. Groups of other sizes than group_size cannot be made contiguous: ValueError."""
    natural = torch.arange(in_features, dtype=torch.int64) // group_size
    if g_idx is None:
        return None
    g_idx = g_idx.to(torch.int64)
    if g_idx.shape != natural.shape:
        raise ValueError(f"g_idx has shape {tuple(g_idx.shape)}, expected ({in_features},)")
    if torch.equal(g_idx, natural):
        return None
    perm = torch.argsort(g_idx, stable=True)
    if not torch.equal(g_idx[perm], natural):
        raise ValueError(f"g_idx does not assign {group_size} columns to each group")
    return perm
