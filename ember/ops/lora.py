"""The LoRA delta of a batch whose rows run under different adapters: y[t] += B[s] @ (A[s] @ x[t]) for the
adapter slot s = slots[t] of each row (s = -1: the base model alone, nothing added).

A projection's adapters sit in slots of fixed tensors (`LoRAWeights`): A of every slot stacked
[max_loras, n_slices * rank, in] (a fused projection's slices side by side, q/k/v or gate/up, each its
own A), and per slice B transposed, [max_loras, rank, out_i], with the adapter's scale folded in, the
slices one after another in one buffer (`stacked_slices`: the GPU's one expand launch for all of them
addresses them from the first). Ranks below the slots' are padded with zeros, so every slot computes the
same shapes. Nothing here reads the slot index on the host: a step's index array is a device tensor a
CUDA graph captures.

On the GPU a dense base (bf16/fp16/fp32) keeps A in its own weight's buffer, under W (`FusedShrink`), so
its one GEMM computes the shrink too and only the expand is launched (ember/model/lora.py decides where).

The delta is added to the base projection's output, whatever the base weight's format (dense,
int4/int8/fp8, GGUF), so a quantized base takes adapters as a dense one does (QLoRA-style serving).

An embedding adapter is the same pair with the vocabulary as its input (A [max_loras, rank, vocab]):
its shrink is a gather, xa[t] = A[s][:, ids[t]] (`embedding_shrink`, the same on every device), and its
expand is a linear adapter's (`embed`). The LM head's adapter is a linear one into the logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ember.cpu_native import ops as native
from ember.ops.target import Target


@dataclass
class LoRAWeights:
    """One projection's adapter slots (see the module docstring); zeros where a slot holds no adapter."""

    a: torch.Tensor  # [max_loras, n_slices * rank, in]; a view into FusedShrink.weight where the shrink is fused
    b: list[torch.Tensor]  # per slice [max_loras, rank, out_i], `stacked_slices`
    offsets: list[int]  # per slice, its first output column

    @property
    def rank(self) -> int:
        return self.b[0].shape[1]


class TorchLoRA:
    """Every slot's shrink in one matmul, each row's own slot kept by a one-hot mask, then one expand
    matmul per slice over the masked [T, slots * rank]: two or three matmuls whatever the batch's mix,
    no gather of per-row weights and no host sync. Each row's sum is its own adapter's terms plus exact
    zeros. Costs max_loras times one adapter's FLOPs: the CPU path and the kernels' reference."""

    @staticmethod
    def can_implement(target: Target) -> bool:
        return True

    def __init__(self) -> None:
        self._ids: torch.Tensor | None = None  # 0 .. max_loras - 1, made once on the slots' device

    def __call__(self, x: torch.Tensor, y: torch.Tensor, w: LoRAWeights, slots: torch.Tensor) -> None:
        num_slots, rows = w.a.shape[0], x.shape[0]
        xa = torch.mm(x, w.a.view(-1, w.a.shape[-1]).t().to(x.dtype)).view(rows, num_slots, -1)
        self._expand(xa.mul_(self._own(slots, num_slots, x.dtype)[:, :, None]), y, w)

    def embed(self, ids: torch.Tensor, y: torch.Tensor, w: LoRAWeights, slots: torch.Tensor) -> None:
        """y[t] += B[s] @ A[s][:, ids[t]] (an embedding adapter, A [slots, rank, vocab])."""
        xa = embedding_shrink(ids, w.a, slots)  # [T, rank], zeros for the base's rows
        self._expand(xa[:, None, :] * self._own(slots, w.a.shape[0], xa.dtype)[:, :, None], y, w)

    def _own(self, slots: torch.Tensor, num_slots: int, dtype: torch.dtype) -> torch.Tensor:
        """[T, slots]: one where a row's slot is the column's."""
        if self._ids is None or self._ids.device != slots.device:
            self._ids = torch.arange(num_slots, dtype=slots.dtype, device=slots.device)
        return (slots[:, None] == self._ids).to(dtype)

    @staticmethod
    def _expand(xa: torch.Tensor, y: torch.Tensor, w: LoRAWeights) -> None:
        """y += the masked shrink xa [T, slots, n_slices * rank] through every slot's B, in y's dtype (the
        slots' may differ: `--lora-dtype`)."""
        rows, num_slots = xa.shape[:2]
        xa = xa.to(y.dtype).view(rows, num_slots, len(w.b), w.rank)
        if len(w.b) == 1:  # o_proj, down_proj, the embedding, the LM head: one product
            b = w.b[0]
            y[:, : b.shape[2]].addmm_(xa.view(rows, -1), b.view(-1, b.shape[2]).to(y.dtype))
            return
        for i, (start, b) in enumerate(zip(w.offsets, w.b)):
            y[:, start : start + b.shape[2]].addmm_(xa[:, :, i].reshape(rows, -1), b.view(-1, b.shape[2]).to(y.dtype))


class NativeLoRA(TorchLoRA):
    """The gathered form in one native call a projection (ember/cpu_native lora.c): rows taken slot by slot,
    each slot's A and B read once whatever its rows, slots no row uses not read, each row's sums in one
    fixed order whatever its batch. The fused decode layers (ops.decode_layers) and LoRALinear over a native
    GEMV run the same sums inside the GEMV's own parallel region (gemv_lora, ops.matmul_lora), so a row's
    numbers do not depend on which path its step took. TorchLoRA's eight ops a projection over
    every slot made 16 requests over 4 rank-16 adapters on the default model 0.54x the base's tok/s
    (2026-12-06, with the fused decode off). PyTorch's ops where the tensors do not fit."""

    @staticmethod
    def can_implement(target: Target) -> bool:
        return target.native and target.dtype == torch.float32

    def __call__(self, x: torch.Tensor, y: torch.Tensor, w: LoRAWeights, slots: torch.Tensor) -> None:
        if x.dtype != torch.float32 or x.stride(-1) != 1 or y.stride(-1) != 1 or not native.lora_fits(w.a, w.b):
            super().__call__(x, y, w, slots)
            return
        native.lora_delta(x, y[:, : w.offsets[-1] + w.b[-1].shape[2]], (w.a, w.b), slots)  # logits may be wider


class TritonLoRA:
    """A shrink kernel and one expand kernel for every slice (ember/kernels/lora.py), each in two forms
    chosen on the device tile by tile: a tensor-core tile for rows under one adapter (prefill), a program
    per row reading only its own slot's weights for the rest (decode, request boundaries). Where the base
    GEMM computed the shrink (`FusedShrink`), the expand alone (`expand_slots`)."""

    @staticmethod
    def can_implement(target: Target) -> bool:
        return target.triton

    def __call__(self, x: torch.Tensor, y: torch.Tensor, w: LoRAWeights, slots: torch.Tensor) -> None:
        from ember.kernels.lora import lora_expand, lora_shrink

        lora_expand(lora_shrink(x, w.a, slots), w.b, slots, y)  # [parts, T, n_slices * rank], float32

    def embed(self, ids: torch.Tensor, y: torch.Tensor, w: LoRAWeights, slots: torch.Tensor) -> None:
        from ember.kernels.lora import lora_expand

        lora_expand(embedding_shrink(ids, w.a, slots).float()[None], w.b, slots, y)  # one part

    @staticmethod
    def expand_slots(xa: torch.Tensor, y: torch.Tensor, w: LoRAWeights, slots: torch.Tensor) -> None:
        """y += each row's delta from xa [T, max_loras * n_slices * rank], every slot's shrink of each row
        (`FusedShrink`'s)."""
        from ember.kernels.lora import lora_expand_slots

        lora_expand_slots(xa, w.b, slots, y)


@dataclass
class FusedShrink:
    """A dense base projection's weight W [N, K] with every slot's A stacked under it in one buffer, [W ; A]
    [N + max_loras * n_slices * rank, K], and its bias (if any) followed by zeros: the one GEMM the base
    runs (F.linear: cuBLAS on a GPU) yields both the base's output, its first N columns, and every slot's
    shrink of every row, the rest (`TritonLoRA.expand_slots` reads each row's own slot's): no shrink
    launch, where at batch 1 a projection's delta costs mostly its launches.

    The shrink comes out in the GEMM's dtype: in a bf16 model one more rounding (at most 2^-8 relative) of
    the rank-wide vector the delta is made from, as punica's kernels in vLLM round it to the activations'
    dtype. The segmented expand rounded it so already (its tensor-core operand); the gathered one now
    multiplies it in float32 as it comes. The delta's added error, about 2^-8 of its |B| |xa|, is under
    the output's own bf16 rounding wherever the delta is smaller than the output; a float32 tail would
    take a second GEMM (a GEMM has one output dtype).

    The base's own columns are W's dot products as before, though cuBLAS may pick another kernel for the
    wider product (another summation order, in the last bit, as another batch size may): a step of the base
    alone runs W alone (`base_weight`), as an engine without LoRA does."""

    weight: torch.Tensor  # [N + A's rows, K]
    bias: torch.Tensor | None  # [N + A's rows]: the base's, then zeros
    out_features: int  # N

    @classmethod
    def stack(cls, weight: torch.Tensor, bias: torch.Tensor | None, a_rows: int) -> FusedShrink:
        """New buffers holding `weight` [N, K] and `bias` [N] followed by `a_rows` zero rows (A's slots,
        filled by adapters' loads through `a`)."""
        n, k = weight.shape
        stacked = torch.zeros(n + a_rows, k, dtype=weight.dtype, device=weight.device)
        stacked[:n].copy_(weight)
        stacked_bias = None
        if bias is not None:
            stacked_bias = torch.zeros(n + a_rows, dtype=bias.dtype, device=bias.device)
            stacked_bias[:n].copy_(bias)
        return cls(stacked, stacked_bias, n)

    @property
    def base_weight(self) -> torch.Tensor:
        return self.weight[: self.out_features]

    @property
    def base_bias(self) -> torch.Tensor | None:
        return None if self.bias is None else self.bias[: self.out_features]

    def a(self, num_slots: int) -> torch.Tensor:
        """The slots' A [num_slots, n_slices * rank, K]: a view of the rows under W."""
        return self.weight[self.out_features :].view(num_slots, -1, self.weight.shape[1])

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, K] -> (the base's output [T, N], every slot's shrink [T, A's rows]): views of one GEMM's
        output, so their rows are strided."""
        out = F.linear(x, self.weight, self.bias)
        return out[:, : self.out_features], out[:, self.out_features :]


def stacked_slices(
    num_slots: int, rank: int, widths: list[int], dtype: torch.dtype, device: torch.device | str
) -> list[torch.Tensor]:
    """Zeroed B [num_slots, rank, width] per slice, one after another in one buffer (each contiguous, as
    the native kernels take them): the layout TritonLoRA's one expand launch for every slice reads."""
    flat = torch.zeros(num_slots * rank * sum(widths), dtype=dtype, device=device)
    return [part.view(num_slots, rank, -1) for part in flat.split([num_slots * rank * w for w in widths])]


def embedding_shrink(ids: torch.Tensor, a: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """[T, rank]: A[slots[t]][:, ids[t]] (an embedding adapter's A [slots, rank, vocab]), zeros where the
    slot is -1. A gather of rank values a row: no matmul, no host read."""
    picked = a[slots.clamp(min=0).long(), :, ids.long()]  # [T, rank]
    return picked * (slots >= 0).to(a.dtype)[:, None]
