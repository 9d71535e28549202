"""Persistent step inputs: host buffers (pinned on CUDA) filled in place, one copy each to the device.

The device tensors never move, so CUDA graphs captured on them replay with the next step's
inputs; eager steps use slices of the same tensors.
"""

from __future__ import annotations

import numpy as np
import torch


class _Buffer:
    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
        on_gpu = device.type == "cuda"
        self.host = torch.zeros(shape, dtype=dtype, pin_memory=on_gpu)
        self.np: np.ndarray = self.host.numpy()
        self.dev = torch.zeros(shape, dtype=dtype, device=device) if on_gpu else self.host

    def upload(self, n: int) -> torch.Tensor:
        if self.dev is not self.host:
            self.dev[:n].copy_(self.host[:n], non_blocking=True)
        return self.dev[:n]


class InputBuffers:
    def __init__(self, max_tokens: int, max_seqs: int, max_blocks_per_seq: int, device: torch.device) -> None:
        self.input_ids = _Buffer((max_tokens,), torch.int64, device)
        self.positions = _Buffer((max_tokens,), torch.int64, device)
        self.slot_mapping = _Buffer((max_tokens,), torch.int64, device)
        self.block_tables = _Buffer((max_seqs, max_blocks_per_seq), torch.int32, device)
        self.seq_lens = _Buffer((max_seqs,), torch.int32, device)
        self.query_start_loc = _Buffer((max_seqs + 1,), torch.int32, device)
        self.logits_indices = _Buffer((max_seqs,), torch.int64, device)
