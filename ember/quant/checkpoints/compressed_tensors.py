"""compressed-tensors checkpoints, as llm-compressor writes them (`quant_method: compressed-tensors`).

`config_groups` map module names (`targets`: "Linear", exact names, or "re:" regular expressions)
to a weight scheme; modules in `ignore` stay unquantized. Two storage formats are read:

- `pack-quantized` (W4A16, W8A16): `weight_packed` int32 [N, ceil(K * bits / 32)], each word
  holding 32 / bits consecutive input columns' codes, lowest bits first, stored as the signed
  value plus 2^(bits-1); `weight_scale` [N, G] (G = 1 for the channel strategy); asymmetric
  schemes add `weight_zero_point`, signed, packed the same way along N: int32 [ceil(N * bits / 32), G];
  `weight_shape` holds [N, K]; group act-order adds `weight_g_idx`. w = (q - zero_point) * scale.
- `float-quantized` (FP8): `weight` float8_e4m3fn [N, K] and `weight_scale` per tensor, per
  channel [N, 1] or per block [ceil(N / bn), ceil(K / bk)] (`block_structure: [bn, bk]`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

from ember.errors import ModelLoadError
from ember.quant.checkpoints.base import CheckpointFormat, check_shape
from ember.quant.checkpoints.fp8 import fp8_weight
from ember.quant.checkpoints.packing import act_order, affine_weight, unpack_int32
from ember.quant.formats import QuantizedWeight

FORMATS = ("pack-quantized", "float-quantized")
_INT_STRATEGIES = ("group", "channel")
_FLOAT_STRATEGIES = ("tensor", "channel", "block")
_PARTS = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx", "input_scale")


@dataclass(frozen=True)
class Scheme:
    """One config group's weight quantization."""

    targets: tuple[str, ...]
    format: str
    bits: int
    symmetric: bool
    strategy: str
    group_size: int | None
    block: tuple[int, int] | None


@dataclass(frozen=True)
class CompressedTensorsFormat(CheckpointFormat):
    schemes: tuple[Scheme, ...] = ()
    ignore: tuple[str, ...] = ()

    def claims(self, suffix: str, is_fp8: bool) -> bool:
        return (suffix == "weight" and is_fp8) or suffix in _PARTS

    def assemble(self, module: str, parts: dict[str, torch.Tensor]) -> QuantizedWeight:
        scheme = self.scheme(module)
        if scheme.format == "float-quantized":
            return fp8_weight(parts["weight"], parts["weight_scale"], scheme.block)
        return _packed_weight(scheme, parts)

    def scheme(self, module: str) -> Scheme:
        """The group targeting `module`; as vLLM resolves overlaps, the first group whose target names
        the module or matches it with an "re:" pattern, else the first targeting the class "Linear"."""
        if any(_match_rank(module, t) is not None for t in self.ignore):
            raise ValueError("stored quantized, but quantization_config.ignore lists it")
        matches = [
            (rank, i)
            for i, scheme in enumerate(self.schemes)
            for t in scheme.targets
            if (rank := _match_rank(module, t)) is not None
        ]
        if not matches:
            raise ValueError("stored quantized, but no quantization_config.config_groups entry targets it")
        return self.schemes[min(matches)[1]]


def _match_rank(module: str, target: str) -> int | None:
    """How `target` selects the linear layer `module`: 0 by its name or an "re:" pattern, 1 by the
    class name; None when it does not."""
    if target.startswith("re:"):
        return 0 if re.match(target[3:], module) else None
    if target == module:
        return 0
    return 1 if target == "Linear" else None


def _packed_weight(scheme: Scheme, parts: dict[str, torch.Tensor]) -> QuantizedWeight:
    n, k = (int(v) for v in parts["weight_shape"].tolist())
    bits, offset = scheme.bits, 1 << (scheme.bits - 1)
    if scheme.strategy == "group":
        assert scheme.group_size is not None  # _scheme requires a positive group_size for "group"
        g = scheme.group_size
    else:
        g = k
    groups = -(-k // g)
    packed = parts["weight_packed"]
    check_shape("weight_packed", packed, (n, -(-k * bits // 32)))
    q = unpack_int32(packed, bits, dim=1)[:, :k]
    scale = parts["weight_scale"]
    check_shape("weight_scale", scale, (n, groups))
    zero = parts.get("weight_zero_point")
    if scheme.symmetric or zero is None:
        zero = torch.zeros(n, groups, dtype=torch.int32)
    elif zero.dtype == torch.int32:
        check_shape("weight_zero_point", zero, (-(-n * bits // 32), groups))
        zero = unpack_int32(zero, bits, dim=0)[:n] - offset
    check_shape("weight_zero_point", zero, (n, groups))
    perm = act_order(parts.get("weight_g_idx"), k, g)
    if perm is not None:
        q = q[:, perm]
    # stored code u = q_signed + offset, so w = (u - (zero + offset)) * scale
    return affine_weight(q, zero.to(torch.int32) + offset, scale, bits, g, perm)


def _scheme(name: str, group: dict[str, Any], default_format: str | None, source: str) -> Scheme:
    fmt = group.get("format") or default_format
    weights: Any = group.get("weights") or {}  # JSON; its fields are checked below
    where = f"quantization_config.config_groups.{name}"
    if fmt not in FORMATS:
        raise ModelLoadError(source, f"{where}.format = {fmt!r} is not supported (supported: {', '.join(FORMATS)})")
    is_float = fmt == "float-quantized"
    expected = ("float", (8,), _FLOAT_STRATEGIES) if is_float else ("int", (4, 8), _INT_STRATEGIES)
    kind, bits, strategy = weights.get("type"), weights.get("num_bits"), weights.get("strategy")
    if kind != expected[0] or bits not in expected[1] or strategy not in expected[2]:
        raise ModelLoadError(
            source,
            f"{where}.weights (type {kind!r}, num_bits {bits!r}, strategy {strategy!r}) is "
            f"not supported for {fmt} (supported: type {expected[0]!r}, num_bits "
            f"{list(expected[1])}, strategy {list(expected[2])})",
        )
    group_size = weights.get("group_size")
    if strategy == "group" and not (isinstance(group_size, int) and group_size > 0):
        raise ModelLoadError(source, f"{where}.weights.group_size = {group_size!r}: expected a positive integer")
    block = weights.get("block_structure") if strategy == "block" else None
    if strategy == "block" and not (isinstance(block, list) and len(block) == 2):
        raise ModelLoadError(source, f"{where}.weights.block_structure = {block!r}: expected [rows, columns]")
    return Scheme(
        targets=tuple(group.get("targets") or ()),
        format=fmt,
        bits=bits,
        symmetric=bool(weights.get("symmetric", True)),
        strategy=strategy,
        group_size=group_size,
        block=None if block is None else (int(block[0]), int(block[1])),
    )


def read(qcfg: dict[str, Any], source: str) -> CompressedTensorsFormat:
    if qcfg.get("sparsity_config"):
        raise ModelLoadError(
            source, "quantization_config.sparsity_config: sparse compressed-tensors checkpoints are not supported"
        )
    if qcfg.get("kv_cache_scheme"):
        raise ModelLoadError(
            source,
            "quantization_config.kv_cache_scheme: calibrated KV cache scales are not read "
            "(--kv-cache-dtype fp8 quantizes the cache with unit scales instead)",
        )
    groups = qcfg.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ModelLoadError(source, "quantization_config.config_groups: expected at least one group")
    schemes = tuple(_scheme(name, group, qcfg.get("format"), source) for name, group in groups.items())
    return CompressedTensorsFormat(
        "compressed-tensors",
        source,
        fp8=any(s.format == "float-quantized" for s in schemes),
        schemes=schemes,
        ignore=tuple(qcfg.get("ignore") or ()),
    )
