"""Quantize dense checkpoint weights at load time (`--quantization int8|int4|fp8`).

Round-to-nearest everywhere: no calibration data exists at load, and per-channel int8 and
group-128 int4 lose little on LLM weights without it (measured in benchmarks/quality.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ember.quant.formats import FP8_DTYPE, FP8_MAX, QuantizedWeight, pack_int4

INT4_GROUP_SIZE = 128


def quantize_int8(w: torch.Tensor) -> QuantizedWeight:
    """Symmetric per output channel: q in -127..127 (no -128, so the range is symmetric)."""
    w = w.float()
    scales = (w.abs().amax(dim=1, keepdim=True) / 127.0).clamp_min(torch.finfo(torch.float32).tiny)
    q = torch.round(w / scales).clamp_(-127, 127).to(torch.int8)
    return QuantizedWeight("int8", q, scales, None, w.shape[1], w.shape[1])


def quantize_int4(w: torch.Tensor, group_size: int = INT4_GROUP_SIZE) -> QuantizedWeight:
    """Asymmetric per group of `group_size` inputs: w ~ q * scale + min, q in 0..15.

    A K that is not a multiple of the group size gets a shorter last group (its padding never
    reaches the codes).
    """
    n, k = w.shape
    groups = -(-k // group_size)
    padded = F.pad(w.float(), (0, groups * group_size - k), mode="replicate").view(n, groups, group_size)
    lo, hi = padded.amin(dim=2), padded.amax(dim=2)
    scales = ((hi - lo) / 15.0).clamp_min(torch.finfo(torch.float32).tiny)
    q = torch.round((padded - lo[:, :, None]) / scales[:, :, None]).clamp_(0, 15)
    return QuantizedWeight("int4", pack_int4(q.view(n, -1)[:, :k]), scales, lo, group_size, k)


def quantize_fp8(w: torch.Tensor) -> QuantizedWeight:
    """e4m3 with one scale per output channel, so each row's largest weight maps to 448."""
    w = w.float()
    scales = (w.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny)
    q = (w / scales).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return QuantizedWeight("fp8", q, scales, None, w.shape[1], w.shape[1])


QUANTIZERS = {"int8": quantize_int8, "int4": quantize_int4, "fp8": quantize_fp8}


def quantize(w: torch.Tensor, kind: str) -> QuantizedWeight:
    return QUANTIZERS[kind](w)
