"""Tensor-parallel process state and the collectives the model needs, over torch.distributed.

One process per rank. The model's layers read `tp_rank()` / `tp_size()` when they are built and
call `all_reduce` / `all_gather` in their forward; with one rank these are no-ops, so the
single-process engine never touches torch.distributed. Activations travel over the default group
(NCCL on GPUs, gloo on CPUs); the per-step batch description travels over a gloo group on host
memory (`host_group`), so building a step never waits on a device copy.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

# NVLink multicast (NVLS) must stay off: the multi-GPU machines we run on require it, and NCCL's
# all-reduce works without it. Set before the first NCCL communicator exists.
_NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
# How long a collective may wait for a peer: long enough for the largest prefill on a slow CPU.
# A rank that dies is noticed much sooner (the engine's monitor, gloo's closed sockets).
_TIMEOUT = datetime.timedelta(minutes=10)


@dataclass
class TensorParallelState:
    rank: int = 0
    size: int = 1
    host_group: dist.ProcessGroup | None = None


_STATE = TensorParallelState()


def tp_rank() -> int:
    return _STATE.rank


def tp_size() -> int:
    return _STATE.size


def host_group() -> dist.ProcessGroup | None:
    return _STATE.host_group


def init_tensor_parallel(rank: int, size: int, init_method: str, device: torch.device) -> None:
    """Join the process group of `size` ranks (every rank calls this with the same `init_method`)."""
    for key, value in _NCCL_ENV.items():
        os.environ[key] = value
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend,
        init_method=init_method,
        rank=rank,
        world_size=size,
        timeout=_TIMEOUT,
        device_id=device if device.type == "cuda" else None,
    )
    host = dist.new_group(backend="gloo", timeout=_TIMEOUT) if backend != "gloo" else dist.group.WORLD
    _STATE.rank, _STATE.size, _STATE.host_group = rank, size, host


def destroy_tensor_parallel() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
    _STATE.rank, _STATE.size, _STATE.host_group = 0, 1, None


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum of `x` over the ranks (row-parallel outputs, vocab-parallel embedding rows)."""
    if _STATE.size > 1:
        dist.all_reduce(x)
    return x


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Every rank's `x` side by side along the last dimension (vocab-parallel logits)."""
    if _STATE.size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_STATE.size)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)
