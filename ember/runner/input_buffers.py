"""Persistent step inputs: host buffers (pinned on CUDA) filled in place, one copy each to the device.

The device tensors never move, so CUDA graphs captured on them replay with the next step's
inputs; eager steps use slices of the same tensors. There are two host sets, used by turns:
under async scheduling the host fills step N+1's inputs while step N may still be copying from
its own set, and step N-1, which used the set N+1 takes, has finished by then.
"""

from __future__ import annotations

import numpy as np
import torch


class _Buffer:
    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
        on_gpu = device.type == "cuda"
        self._hosts = [torch.zeros(shape, dtype=dtype, pin_memory=on_gpu) for _ in range(2 if on_gpu else 1)]
        self._arrays = [h.numpy() for h in self._hosts]
        self.host = self._hosts[0]
        self.np: np.ndarray = self._arrays[0]
        self.dev = torch.zeros(shape, dtype=dtype, device=device) if on_gpu else self.host

    def use(self, index: int) -> None:
        self.host, self.np = self._hosts[index % len(self._hosts)], self._arrays[index % len(self._arrays)]

    def upload(self, n: int) -> torch.Tensor:
        if self.dev is not self.host:
            self.dev[:n].copy_(self.host[:n], non_blocking=True)
            return self.dev[:n]
        return self.host[:n]


class InputBuffers:
    def __init__(
        self,
        max_tokens: int,
        max_seqs: int,
        max_blocks_per_seq: int,
        device: torch.device,
        lora: bool = False,
        token_types: bool = False,
        mrope: bool = False,
        state_slots: bool = False,
    ) -> None:
        self.input_ids = _Buffer((max_tokens,), torch.int64, device)
        self.positions = _Buffer((max_tokens,), torch.int64, device)
        self.slot_mapping = _Buffer((max_tokens,), torch.int64, device)
        self.block_tables = _Buffer((max_seqs, max_blocks_per_seq), torch.int32, device)
        self.seq_lens = _Buffer((max_seqs,), torch.int32, device)
        self.query_start_loc = _Buffer((max_seqs + 1,), torch.int32, device)
        self.logits_indices = _Buffer((max_tokens,), torch.int64, device)  # a row per draft too
        # each token's LoRA adapter slot (-1: none), with --enable-lora (ember/runner/lora_manager.py)
        self.lora_slots = _Buffer((max_tokens,), torch.int32, device) if lora else None
        # each token's type (1: in the second text of a pair), for an encoder with token types (ember/model/bert.py)
        self.token_types = _Buffer((max_tokens,), torch.int64, device) if token_types else None
        # each token's M-RoPE (temporal, height, width) positions, for Qwen2.5-VL (ember/multimodal/mrope.py)
        self.mrope_positions = _Buffer((max_tokens, 3), torch.int64, device) if mrope else None
        # each sequence's linear-attention state slot, for a model with such layers (ember/runner/linear_state.py),
        # and whether its state starts from zeros (no tokens before the step's): filled once per step here rather
        # than copied to the device by every layer
        self.state_slots = _Buffer((max_seqs,), torch.int64, device) if state_slots else None
        self.state_fresh = _Buffer((max_seqs,), torch.bool, device) if state_slots else None
        self._all = [
            self.input_ids,
            self.positions,
            self.slot_mapping,
            self.block_tables,
            self.seq_lens,
            self.query_start_loc,
            self.logits_indices,
        ] + [
            b
            for b in (self.lora_slots, self.token_types, self.mrope_positions, self.state_slots, self.state_fresh)
            if b is not None
        ]
        self._turn = 0

    def rope_positions(self, n: int) -> torch.Tensor:
        """The first n tokens' positions as the model's rotary reads them, on the device: [n], or M-RoPE's
        [3, n] (a view of the [n, 3] buffer)."""
        if self.mrope_positions is None:
            return self.positions.dev[:n]
        return self.mrope_positions.dev[:n].t()

    def next_set(self) -> None:
        """Switch to the other host set for the next step's inputs."""
        self._turn += 1
        for buffer in self._all:
            buffer.use(self._turn)
