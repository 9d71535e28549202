"""The paged KV pool's memory: per attention layer one K and one V tensor of
`[num_blocks, block_size, num_kv_heads, head_dim]`, which the attention layers read and write; or, for
multi-head latent attention (`latent=True`, ember/model/mla.py), one tensor of
`[num_blocks, block_size, 1, kv_lora_rank + qk_rope_head_dim]` and no V.
"""

from __future__ import annotations

import math
import mmap
from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch


class CachedAttention(Protocol):
    """An attention layer that reads and writes its layer's cache (a decoder's, an encoder's on CUDA)."""

    def bind_cache(self, k_cache: torch.Tensor | None, v_cache: torch.Tensor | None) -> None: ...


class KVCache:
    def __init__(
        self,
        layers: Sequence[CachedAttention],
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        latent: bool = False,
    ) -> None:
        self.layers = layers
        self.tensors_per_layer = 1 if latent else 2
        self.block_shape = (block_size, num_kv_heads, head_dim)
        self.dtype = dtype
        self.device = device
        self.num_blocks = 0

    @property
    def bytes_per_block(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return self.tensors_per_layer * len(self.layers) * math.prod(self.block_shape) * elem

    def allocate(self, num_blocks: int) -> None:
        shape = (num_blocks, *self.block_shape)
        for attn in self.layers:
            attn.bind_cache(self._zeros(shape), self._zeros(shape) if self.tensors_per_layer == 2 else None)
        self.num_blocks = num_blocks

    def release(self) -> None:
        for attn in self.layers:
            attn.bind_cache(None, None)
        self.num_blocks = 0

    def _zeros(self, shape: tuple[int, ...]) -> torch.Tensor:
        """A zeroed cache tensor. On CPU, an anonymous memory map leaves untouched pages unmapped, so a
        large `--kv-cache-memory` costs resident memory only as blocks are used (torch.zeros writes
        every page at once). Not numpy's zeros: it advises huge pages for large arrays, and the
        kernel's khugepaged then fills whole 2 MiB pages around each touched block."""
        if self.device.type != "cpu":
            return torch.zeros(shape, dtype=self.dtype, device=self.device)
        nbytes = math.prod(shape) * torch.empty((), dtype=self.dtype).element_size()
        raw = np.frombuffer(mmap.mmap(-1, nbytes), dtype=np.uint8)
        return torch.from_numpy(raw).view(self.dtype).view(shape)
