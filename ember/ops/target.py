"""What an implementation is chosen by: the facts a layer knows when it is built or its weights or
cache are set."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Target:
    device: torch.device
    dtype: torch.dtype  # the activations' (the model's dtype)
    triton: bool  # the Triton kernels run: a CUDA device, or any while registry.FORCE_TRITON
    native: bool  # the native CPU kernels (ember/cpu_native) are built and enabled, on a CPU device

    @property
    def cpu(self) -> bool:
        return self.device.type == "cpu"
