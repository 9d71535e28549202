"""Where an engine's steps spend device time: a torch.profiler window over some `engine.step()` calls.

Shared by the benchmarks that explain a miss with a kernel profile (latency.py, structured.py). The
engine must run in this process (`engine_process=False`), or the profiler sees none of its kernels.
On CUDA it reports device time per step by kernel and the device's idle time inside the window (the
window's span less the union of its kernels' intervals: launch gaps, host waits); on CPU, operators'
self time.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile


def _busy_us(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals."""
    busy, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            busy += end - max(start, reach)
            reach = end
    return busy


def profile_steps(step: Callable[[], Any], steps: int, device: torch.device, top: int = 20) -> dict[str, Any]:
    """Run `step` `steps` times under the profiler; per-step device time by kernel (top `top`)."""
    on_gpu = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CUDA if on_gpu else ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
        if on_gpu:
            torch.cuda.synchronize(device)
    events = [e for e in prof.key_averages() if (e.device_time_total if on_gpu else e.self_cpu_time_total) > 0]
    spent = {e.key: (e.device_time_total if on_gpu else e.self_cpu_time_total) / steps for e in events}
    calls = {e.key: e.count / steps for e in events}
    total = sum(spent.values())
    out: dict[str, Any] = {"steps": steps, "device_us_per_step": round(total, 1)}
    if on_gpu:
        kernels = [
            (e.time_range.start, e.time_range.end)
            for e in prof.events()
            if e.device_type == torch.autograd.DeviceType.CUDA
        ]
        if kernels:
            span = max(end for _, end in kernels) - min(start for start, _ in kernels)
            out["device_idle_us_per_step"] = round((span - _busy_us(kernels)) / steps, 1)
    out["kernels"] = [
        {
            "name": k[:160],
            "us_per_step": round(spent[k], 2),
            "calls_per_step": round(calls[k], 2),
            "share": round(spent[k] / total, 4),
        }
        for k in sorted(spent, key=spent.get, reverse=True)[:top]
    ]
    return out


def print_profile(p: dict[str, Any], label: str = "kernel profile") -> None:
    idle = f", device idle {p['device_idle_us_per_step']} us" if "device_idle_us_per_step" in p else ""
    extra = f" (roofline {p['roofline_us_per_step']} us)" if p.get("roofline_us_per_step") else ""
    print(f"{label}: {p['device_us_per_step']} us of device time per step{idle}{extra}")
    for k in p["kernels"][:12]:
        print(f"{k['us_per_step']:>10.1f} us {100 * k['share']:>5.1f}% {k['calls_per_step']:>6.1f}x  {k['name'][:90]}")
