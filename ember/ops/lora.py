"""The LoRA delta of a batch whose rows run under different adapters: y[t] += B[s] @ (A[s] @ x[t]) for the
adapter slot s = slots[t] of each row (s = -1: the base model alone, nothing added).

A projection's adapters sit in slots of fixed tensors (`LoRAWeights`): A of every slot stacked
[max_loras, n_slices * rank, in] (a fused projection's slices side by side, q/k/v or gate/up, each its
own A), and per slice B transposed, [max_loras, rank, out_i], with the adapter's scale folded in. Ranks
below the slots' are padded with zeros, so every slot computes the same shapes. Nothing here reads the
slot index on the host: a step's index array is a device tensor a CUDA graph captures.

The delta is added to the base projection's output, whatever the base weight's format (dense,
int4/int8/fp8, GGUF), so a quantized base takes adapters as a dense one does (QLoRA-style serving).

An embedding adapter is the same pair with the vocabulary as its input (A [max_loras, rank, vocab]):
its shrink is a gather, xa[t] = A[s][:, ids[t]] (`embedding_shrink`, the same on every device), and its
expand is a linear adapter's (`embed`). The LM head's adapter is a linear one into the logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ember.cpu_native import ops as native
from ember.ops.target import Target


@dataclass
class LoRAWeights:
    """One projection's adapter slots (see the module docstring); zeros where a slot holds no adapter."""

    a: torch.Tensor  # [max_loras, n_slices * rank, in]
    b: list[torch.Tensor]  # per slice [max_loras, rank, out_i]
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
        xa = torch.mm(x, w.a.view(-1, w.a.shape[-1]).t()).view(rows, num_slots, -1)
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
        """y += the masked shrink xa [T, slots, n_slices * rank] through every slot's B."""
        rows, num_slots = xa.shape[:2]
        xa = xa.view(rows, num_slots, len(w.b), w.rank)
        if len(w.b) == 1:  # o_proj, down_proj, the embedding, the LM head: one product
            b = w.b[0]
            y[:, : b.shape[2]].addmm_(xa.view(rows, -1), b.view(-1, b.shape[2]))
            return
        for i, (start, b) in enumerate(zip(w.offsets, w.b)):
            y[:, start : start + b.shape[2]].addmm_(xa[:, :, i].reshape(rows, -1), b.view(-1, b.shape[2]))


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
    """A shrink kernel and an expand kernel per slice (ember/kernels/lora.py), each in two forms chosen on
    the device tile by tile: a tensor-core tile for rows under one adapter (prefill), a program per row
    reading only its own slot's weights for the rest (decode, request boundaries)."""

    @staticmethod
    def can_implement(target: Target) -> bool:
        return target.triton

    def __call__(self, x: torch.Tensor, y: torch.Tensor, w: LoRAWeights, slots: torch.Tensor) -> None:
        from ember.kernels.lora import lora_shrink

        self._expand(lora_shrink(x, w.a, slots), y, w, slots)  # [parts, T, n_slices * rank], float32

    def embed(self, ids: torch.Tensor, y: torch.Tensor, w: LoRAWeights, slots: torch.Tensor) -> None:
        self._expand(embedding_shrink(ids, w.a, slots).float()[None], y, w, slots)  # one part

    @staticmethod
    def _expand(xa: torch.Tensor, y: torch.Tensor, w: LoRAWeights, slots: torch.Tensor) -> None:
        from ember.kernels.lora import lora_expand

        for i, (start, b) in enumerate(zip(w.offsets, w.b)):
            lora_expand(xa, b, slots, y, i, start)


def embedding_shrink(ids: torch.Tensor, a: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """[T, rank]: A[slots[t]][:, ids[t]] (an embedding adapter's A [slots, rank, vocab]), zeros where the
    slot is -1. A gather of rank values a row: no matmul, no host read."""
    picked = a[slots.clamp(min=0).long(), :, ids.long()]  # [T, rank]
    return picked * (slots >= 0).to(a.dtype)[:, None]
