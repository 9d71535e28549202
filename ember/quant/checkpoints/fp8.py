"""Hugging Face fp8 checkpoints (`quant_method: fp8`), as DeepSeek-V3 and Qwen3-FP8 ship them.

Per linear layer: `weight` float8_e4m3fn [N, K] and, with `weight_block_size: [bn, bk]`,
`weight_scale_inv` float32 [ceil(N / bn), ceil(K / bk)] which multiplies the weight (despite its
name): w[n, k] = weight[n, k] * weight_scale_inv[n // bn, k // bk]. Without a block size (vLLM's
and AutoFP8's serialization) one `weight_scale` per tensor multiplies it. Activation scales
(`input_scale`, static activation schemes) are not read: Ember scales activations per token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ember.errors import ModelLoadError
from ember.quant.checkpoints.base import CheckpointFormat, check_shape
from ember.quant.formats import QuantizedWeight

_SCALES = ("weight_scale_inv", "weight_scale")


@dataclass(frozen=True)
class FP8Format(CheckpointFormat):
    block: tuple[int, int] | None = None  # (rows, columns) per scale; None: one scale per tensor

    def claims(self, suffix: str, is_fp8: bool) -> bool:
        return (suffix == "weight" and is_fp8) or suffix in (*_SCALES, "input_scale")

    def assemble(self, module: str, parts: dict[str, torch.Tensor]) -> QuantizedWeight:
        """Either scale name is read in either layout: some block-scaled files call theirs `weight_scale`."""
        scale = next((parts[name] for name in _SCALES if name in parts), None)
        if scale is None:
            raise KeyError(_SCALES[0] if self.block is not None else _SCALES[1])
        return fp8_weight(parts["weight"], scale, self.block)


def fp8_weight(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None) -> QuantizedWeight:
    """e4m3 codes times a float scale per (block_rows x group) block; block None: per output channel
    when `scale` has N rows, else one scale for the whole tensor (repeated per channel: exact)."""
    if weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"weight is {weight.dtype}, expected float8_e4m3fn")
    n, k = weight.shape
    scale = scale.float()
    if block is not None:
        rows, cols = block
        check_shape("weight scale", scale, (-(-n // rows), -(-k // cols)))
        return QuantizedWeight("fp8", weight, scale, None, cols, k, rows)
    if scale.numel() == 1:
        scale = scale.reshape(1, 1).expand(n, 1).contiguous()
    check_shape("weight_scale", scale, (n, 1))
    return QuantizedWeight("fp8", weight, scale, None, k, k)


def read(qcfg: dict[str, Any], source: str) -> FP8Format:
    block = qcfg.get("weight_block_size")
    if block is not None and not (
        isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)
    ):
        raise ModelLoadError(source, f"quantization_config.weight_block_size = {block!r}: expected [rows, columns]")
    return FP8Format("fp8", source, fp8=True, block=None if block is None else (block[0], block[1]))
