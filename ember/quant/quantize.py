"""Quantize dense checkpoint weights at load time (`--quantization int8|int4|fp8|ptpc_fp8`).

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


FP8_BLOCK = 128  # DeepSeek-V3's and Qwen3-FP8's weight_block_size [128, 128]; activations use 1 x 128
_TINY = torch.finfo(torch.float32).tiny


def fp8_scale(amax: torch.Tensor) -> torch.Tensor:
    """The scale that maps a block's largest magnitude to 448 (an all-zero block gets the smallest
    normal float, so its codes stay 0). The Triton activation quantizer computes the same value."""
    return (amax.float() / FP8_MAX).clamp_min(_TINY)


def to_e4m3(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x / scale saturated to +-448 (e4m3fn has no inf: a cast beyond it may give NaN)."""
    return (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def quantize_fp8(w: torch.Tensor, block: int = FP8_BLOCK) -> QuantizedWeight:
    """e4m3 with one scale per `block` x `block` tile (ragged tiles at the N and K edges get their
    own scale), the layout fp8 checkpoints (DeepSeek-V3, Qwen3-FP8) ship, whose GEMM reads one weight
    scale per K tile. It keeps an outlier from costing a whole row's range, but e4m3's error is set by
    its 3 mantissa bits wherever a value sits above the subnormals: over the default model's weights
    both layouts leave 2.6% RMS relative error, and its perplexity rises +9.7% blocked against +6.4%
    per channel (benchmarks/results/quality-smollm2-135m-instruct-cpu-bf16-fp8-2026-12-03.json)."""
    n, k = w.shape
    rows, cols = -(-n // block), -(-k // block)
    padded = F.pad(w.float(), (0, cols * block - k, 0, rows * block - n))
    tiles = padded.view(rows, block, cols, block)
    scales = fp8_scale(tiles.abs().amax(dim=(1, 3)))
    q = to_e4m3(tiles, scales[:, None, :, None]).view(rows * block, cols * block)[:n, :k].contiguous()
    return QuantizedWeight("fp8", q, scales, None, block, k, block_rows=block)


def quantize_fp8_per_channel(w: torch.Tensor) -> QuantizedWeight:
    """e4m3 with one scale per output channel, so each row's largest weight maps to 448."""
    scales = fp8_scale(w.float().abs().amax(dim=1, keepdim=True))
    return QuantizedWeight("fp8", to_e4m3(w, scales), scales, None, w.shape[1], w.shape[1])


def quantize_fp8_activations(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic activation scales for W8A8: each row's inputs in groups of `group_size` (a ragged last
    group included) -> e4m3 codes [M, K] and float32 scales [M, ceil(K / group_size)]. The weight's
    group size along K is the one to use: 128 for block-scaled weights, K (one scale per token) for
    per-channel ones. The reference of the Triton kernel, and the CPU emulation's quantizer."""
    m, k = x.shape
    groups = -(-k // group_size)
    padded = F.pad(x.float(), (0, groups * group_size - k)).view(m, groups, group_size)
    scales = fp8_scale(padded.abs().amax(dim=2))
    return to_e4m3(x, scales.repeat_interleave(group_size, 1)[:, :k]), scales


# --quantization methods -> quantizers. "fp8" is block-scaled, as fp8 checkpoints are stored today;
# "ptpc_fp8" (vLLM's name: per-token activation, per-channel weight scales) keeps one scale per row.
QUANTIZERS = {"int8": quantize_int8, "int4": quantize_int4, "fp8": quantize_fp8, "ptpc_fp8": quantize_fp8_per_channel}


# The method a `--quantization` method quantizes the LM head (and a tied embedding) with, where it differs:
# int4 keeps the LM head at int8, since its error lands directly on the logits, which is why llama.cpp's
# Q4 files also store output.weight at 6 bits or more.
LM_HEAD_METHODS = {"int4": "int8"}


def method_for(method: str, lm_head: bool) -> str:
    """The method `--quantization method` quantizes one layer with: the LM head's own where it has one."""
    return LM_HEAD_METHODS.get(method, method) if lm_head else method


def quantize(w: torch.Tensor, method: str) -> QuantizedWeight:
    return QUANTIZERS[method](w)
