"""The LoRA delta of a batch whose rows run under different adapters: y[t] += B[s] @ (A[s] @ x[t]) for the
adapter slot s = slots[t] of each row (s = -1: the base model alone, nothing added).

A projection's adapters sit in slots of fixed tensors (`LoRAWeights`): A of every slot stacked
[max_loras, n_slices * rank, in] (a fused projection's slices side by side, q/k/v or gate/up, each its
own A), and per slice B transposed, [max_loras, rank, out_i], with the adapter's scale folded in. Ranks
below the slots' are padded with zeros, so every slot computes the same shapes. Nothing here reads the
slot index on the host: a step's index array is a device tensor a CUDA graph captures.

The delta is added to the base projection's output, whatever the base weight's format (dense,
int4/int8/fp8, GGUF), so a quantized base takes adapters as a dense one does (QLoRA-style serving).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

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
        num_slots, rank, rows = w.a.shape[0], w.rank, x.shape[0]
        if self._ids is None or self._ids.device != slots.device:
            self._ids = torch.arange(num_slots, dtype=slots.dtype, device=slots.device)
        own = (slots[:, None] == self._ids).to(x.dtype)  # [T, slots]
        xa = torch.mm(x, w.a.view(-1, w.a.shape[-1]).t()).view(rows, num_slots, -1)
        xa = xa.mul_(own[:, :, None]).view(rows, num_slots, len(w.b), rank)
        if len(w.b) == 1:  # o_proj, down_proj: one product into the whole output
            y.addmm_(xa.view(rows, -1), w.b[0].view(-1, w.b[0].shape[2]))
            return
        for i, (start, b) in enumerate(zip(w.offsets, w.b)):
            y[:, start : start + b.shape[2]].addmm_(xa[:, :, i].reshape(rows, -1), b.view(-1, b.shape[2]))


class TritonLoRA:
    """A shrink kernel and an expand kernel per slice (ember/kernels/lora.py), each in two forms chosen on
    the device tile by tile: a tensor-core tile for rows under one adapter (prefill), a program per row
    reading only its own slot's weights for the rest (decode, request boundaries)."""

    @staticmethod
    def can_implement(target: Target) -> bool:
        return target.triton

    def __call__(self, x: torch.Tensor, y: torch.Tensor, w: LoRAWeights, slots: torch.Tensor) -> None:
        from ember.kernels.lora import lora_expand, lora_shrink

        xa = lora_shrink(x, w.a, slots)  # [T, n_slices * rank], float32
        for i, (start, b) in enumerate(zip(w.offsets, w.b)):
            lora_expand(xa, b, slots, y, i, start)
