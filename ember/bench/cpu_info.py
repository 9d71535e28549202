"""What a CPU result depends on, recorded beside it: the CPU's model, the SIMD flags the kernels use,
cache sizes and a measured memory bandwidth.

The same 2-core AMD EPYC kind gave llama.cpp 83-86 tok/s on one machine and 107-114 on another (issue
30), so a CPU number without the machine's bandwidth and flags cannot be compared with another's.
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np

# Flags the kernels (ours and llama.cpp's) branch on
SIMD_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16")
_CACHE_DIR = "/sys/devices/system/cpu/cpu0/cache"
# 256 MiB: 8x the L3 of this project's machines, so copies stream from DRAM.
_BANDWIDTH_BYTES = 1 << 28


def cpu_flags() -> list[str]:
    """The SIMD_FLAGS /proc/cpuinfo lists for the first CPU (empty where there is no /proc)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            line = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return []
    have = set(line.split(":", 1)[-1].split())
    return [flag for flag in SIMD_FLAGS if flag in have]


def cache_sizes() -> dict[str, str]:
    """Cache level and type -> size and the CPUs sharing it, e.g. {"L3 Unified": "32768K (cpus 0-1)"}."""
    sizes: dict[str, str] = {}
    if not os.path.isdir(_CACHE_DIR):
        return sizes
    for index in sorted(os.listdir(_CACHE_DIR)):

        def read(name: str, index: str = index) -> str:
            with open(os.path.join(_CACHE_DIR, index, name), encoding="utf-8") as f:
                return f.read().strip()

        try:
            sizes[f"L{read('level')} {read('type')}"] = f"{read('size')} (cpus {read('shared_cpu_list')})"
        except OSError:
            continue
    return sizes


def memory_bandwidth_gb_s(repeats: int = 5) -> dict[str, float]:
    """GB/s of a numpy copy (read + write counted) and of a sum (read) over 256 MiB, best of `repeats`:
    one thread, as numpy runs them, so a lower bound on what two cores' kernels can draw."""
    src = np.ones(_BANDWIDTH_BYTES // 4, dtype=np.float32)
    dst = np.empty_like(src)
    copy, total = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        np.copyto(dst, src)
        copy.append(time.perf_counter() - start)
        start = time.perf_counter()
        src.sum()
        total.append(time.perf_counter() - start)
    return {
        "copy_gb_s": round(2 * _BANDWIDTH_BYTES / min(copy) / 1e9, 2),
        "read_gb_s": round(_BANDWIDTH_BYTES / min(total) / 1e9, 2),
    }


def cpu_info() -> dict[str, Any]:
    """The flags, caches and bandwidth of this machine (the bandwidth takes ~1 s)."""
    return {"cpu_flags": cpu_flags(), "caches": cache_sizes(), "memory_bandwidth": memory_bandwidth_gb_s()}
