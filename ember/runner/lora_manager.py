"""Which LoRA adapter is in which device slot, and the adapters read into host memory.

An adapter is checked (config and tensor shapes, ember/lora/peft.py) when its first request reaches the
core, and its tensors are read by a loader thread then, off the engine's loop; up to `max_cpu_loras`
stay read, least recently used dropped first. A step's adapters are put in device slots before its
inputs are filled (`activate`): one already there is reused, else a free slot is taken or the least
recently used adapter that the step does not use is evicted. The scheduler admits no request whose
adapter would make the running requests' adapters outnumber `max_loras`, so no running request's
adapter is ever evicted under it. Adapters are known by `lora_int_id`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager

import torch

from ember.config import LoRAConfig
from ember.lora.peft import LoRAShapes, PeftAdapter, read_adapter
from ember.lora.request import LoRARequest
from ember.model.llama import CausalLM
from ember.model.lora import LoRALayers

HostAdapter = dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


class LoRAManager:
    def __init__(self, model: CausalLM, config: LoRAConfig, slots: torch.Tensor) -> None:
        """`slots`: the step input holding each token's slot (-1: none), read by every wrapped layer."""
        slots.fill_(-1)
        self.layers = LoRALayers(model, config.max_loras, config.max_lora_rank, slots, config.lora_dtype)
        self.config = config
        self._checked: dict[int, tuple[str, PeftAdapter]] = {}  # id -> (path, adapter) for adapters that passed
        self._host: OrderedDict[int, Future[HostAdapter]] = OrderedDict()  # LRU: oldest first
        self._slot_of: OrderedDict[int, int] = OrderedDict()  # LRU: oldest first
        self._free = list(reversed(range(config.max_loras)))
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="ember-lora-load")

    @property
    def shapes(self) -> LoRAShapes:
        return self.layers.shapes

    @property
    def head_active(self) -> bool:
        """Whether an adapter of the step last activated has an LM-head adapter."""
        return self.layers.batch.head

    def capturing(self, lora: bool) -> AbstractContextManager[None]:
        """While inside, the forward runs every LoRA delta (`lora`: a CUDA graph captured there replays any
        mix of adapters) or none (a graph for steps of the base alone); after, those the last `activate` set."""
        return self.layers.capturing(lora)

    def check(self, lora: LoRARequest) -> None:
        """A ValueError naming what is wrong when `lora` cannot run on this model; else its tensors start
        loading (on the loader thread) unless they are read already."""
        lora.check()
        known = self._checked.get(lora.lora_int_id)
        if known is None or known[0] != lora.lora_path:
            adapter = read_adapter(lora.lora_path, self.shapes)
            self._checked[lora.lora_int_id] = (lora.lora_path, adapter)
            # another path under a known id: its old weights go from the host cache and their slot
            self._host.pop(lora.lora_int_id, None)
            slot = self._slot_of.pop(lora.lora_int_id, None)
            if slot is not None:
                self._free.append(slot)
        self._host_adapter(lora.lora_int_id)

    def _host_adapter(self, lora_id: int) -> Future[HostAdapter]:
        future = self._host.get(lora_id)
        if future is None:
            future = self._loader.submit(self.layers.read, self._checked[lora_id][1])
            self._host[lora_id] = future
            while len(self._host) > self.config.max_cpu_loras:
                self._host.popitem(last=False)
        self._host.move_to_end(lora_id)
        return future

    def activate(self, lora_ids: Iterable[int]) -> dict[int, int]:
        """Device slots for a step's adapters (each `check`ed before), loading those not in one; a step
        without any runs no LoRA delta when it runs eagerly."""
        needed = set(lora_ids)
        if len(needed) > self.config.max_loras:
            raise RuntimeError(f"a step uses {len(needed)} LoRA adapters; max_loras is {self.config.max_loras}")
        for lora_id in needed:
            if lora_id in self._slot_of:
                self._slot_of.move_to_end(lora_id)
                continue
            slot = self._free.pop() if self._free else self._evict(needed)
            self.layers.install(slot, self._host_adapter(lora_id).result())
            self._slot_of[lora_id] = slot
        slots = {lora_id: self._slot_of[lora_id] for lora_id in needed}
        self.layers.use(set(slots.values()))
        return slots

    def _evict(self, keep: set[int]) -> int:
        """The slot of the least recently used adapter not in `keep`, now free."""
        victim = next(lora_id for lora_id in self._slot_of if lora_id not in keep)
        return self._slot_of.pop(victim)

    def shutdown(self) -> None:
        self._loader.shutdown(wait=False, cancel_futures=True)
