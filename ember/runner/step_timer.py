"""GPU busy and idle time between engine steps, from CUDA events, without waiting on the device.

Each step records an event before its first device work and one after sampling. Once a step's
results have been waited for, its events are done: the step's busy time is end - start, and the
GPU's idle time before it is its start - the previous step's end (zero when the host launched it
while the previous one still ran, which async scheduling aims for). Recording two events costs
a few microseconds; nothing here synchronizes.

A step with grammar masks records two more: one after its forward, one once the host has the masks
and queues sampling. The GPU reaches the second no sooner than the host records it, so the time
between them is how long the GPU waited for the masks inside the step (zero when they were ready
before the forward ended, which the mask thread aims for).
"""

from __future__ import annotations

import torch


class StepTimer:
    def __init__(self) -> None:
        self.busy_s = 0.0
        self.idle_s = 0.0
        self.mask_wait_s = 0.0
        self._last_end: torch.cuda.Event | None = None

    @staticmethod
    def record() -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def finished(
        self,
        start: torch.cuda.Event,
        end: torch.cuda.Event,
        mask_wait: tuple[torch.cuda.Event, torch.cuda.Event] | None = None,
    ) -> None:
        """Account a step whose `end` event has completed (steps in launch order); `mask_wait`: its
        forward's end and the masks' arrival, for a step with grammar masks."""
        if self._last_end is not None:
            self.idle_s += max(self._last_end.elapsed_time(start), 0.0) / 1e3
        self.busy_s += start.elapsed_time(end) / 1e3
        if mask_wait is not None:
            self.mask_wait_s += max(mask_wait[0].elapsed_time(mask_wait[1]), 0.0) / 1e3
        self._last_end = end
