"""The linear-attention state pool: what a Gated DeltaNet layer (Qwen3-Next, ember/model/qwen3_next.py)
keeps per request instead of KV, in slots beside the paged KV cache.

Per layer, a convolution state [slots, conv_dim, kernel - 1] in the model's dtype (transformers keeps
it so) and a recurrent state [slots, v_heads, k_dim, v_dim] in float32 (the delta rule computes in
float32; rounding the state to bf16 between steps would compound over a long generation). A request
holds one slot, the same index in every layer, from the first step that schedules it until it
finishes, is aborted or is preempted (`RequestStates` in ember/runner/request_state.py); a preempted
request recomputes its prompt, so its state starts again from zeros in whatever slot it gets next.

There are `max_num_seqs` slots, one per sequence that can run at once, so an allocation never fails:
the scheduler never runs more. The pool's size is fixed at start-up, before the KV cache is sized, so
on a GPU the memory left for KV already excludes it. The state does not depend on block boundaries,
which is why prefix caching is off for these models (ember/core/engine_core.py, `_prefix_caching`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Protocol

import torch

from ember.model.hf_config import LinearAttentionConfig

logger = logging.getLogger("ember")


class StateSlots:
    """Free slot indices; the lowest free one is taken first (the state of a reused slot is never read:
    a sequence with no context starts from zeros)."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise RuntimeError(f"linear-attention state pool: all {self.num_slots} slots in use")
        return self._free.pop()

    def free(self, slot: int) -> None:
        self._free.append(slot)
        self._free.sort(reverse=True)

    def reset(self) -> None:
        self._free = list(range(self.num_slots - 1, -1, -1))


class StateLayer(Protocol):
    def bind_state(self, conv_state: torch.Tensor | None, ssm_state: torch.Tensor | None) -> None: ...


class LinearStatePool:
    def __init__(
        self,
        layers: Sequence[StateLayer],
        la: LinearAttentionConfig,
        num_slots: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.slots = StateSlots(num_slots)
        self.layers = layers
        conv = (num_slots, la.conv_dim, la.conv_kernel - 1)
        ssm = (num_slots, la.num_v_heads, la.k_head_dim, la.v_head_dim)
        for layer in layers:
            layer.bind_state(
                torch.zeros(conv, dtype=dtype, device=device), torch.zeros(ssm, dtype=torch.float32, device=device)
            )
        elem = torch.empty((), dtype=dtype).element_size()
        per_slot = len(layers) * (
            la.conv_dim * (la.conv_kernel - 1) * elem + la.num_v_heads * la.k_head_dim * la.v_head_dim * 4
        )
        self.bytes = num_slots * per_slot
        logger.info(
            "linear-attention state: %d slots x %d layers, %.1f MiB per request, %.2f GiB in all",
            num_slots,
            len(layers),
            per_slot / 2**20,
            self.bytes / 2**30,
        )
