"""Tensor-parallel ranks as processes: rank 0 is the engine's own process; ranks 1..N-1 are
spawned by it (one machine), or started by `torchrun` (several machines).

Rank 0 watches the processes it spawned: one that dies ends the engine with an error naming the
rank and its exception, instead of leaving rank 0 waiting in a collective. Shutdown tells the
ranks to stop and ends every process.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import multiprocessing.process
import os
import socket
import sys
import threading
from typing import Any

import torch

from ember.config import EngineConfig
from ember.distributed import destroy_tensor_parallel, init_tensor_parallel
from ember.model.loader import load_model_files
from ember.runner.device import resolve_device
from ember.runner.model_runner import ModelRunner
from ember.runner.step_broadcast import send_stop
from ember.torchrun import launched_by_torchrun

logger = logging.getLogger("ember")
_JOIN_TIMEOUT_S = 10.0
_FAILURE_WAIT_S = 5.0  # after a failed collective, how long to wait for the watcher to name the dead rank


class TensorParallelError(RuntimeError):
    """A tensor-parallel rank failed or died: the ranks can no longer run steps together."""


def rank_device(device_name: str, local_rank: int) -> torch.device:
    """Rank r uses GPU r of its machine (CUDA_VISIBLE_DEVICES picks which), or the CPU."""
    device = resolve_device(device_name)
    return torch.device("cuda", local_rank) if device.type == "cuda" else device


def _share_cpu_cores(device: torch.device, size: int) -> None:
    """On CPU the ranks share the machine's cores; each using all of them would oversubscribe."""
    if device.type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))


def _exit_with_parent() -> None:
    """A spawned rank ends as soon as rank 0's process does, however it ended (kill -9 included)."""
    parent = multiprocessing.parent_process()
    if parent is not None:
        multiprocessing.connection.wait([parent.sentinel])
        os._exit(1)


def run_worker(
    config: EngineConfig, rank: int, size: int, init_method: str, local_rank: int, errors: Any = None
) -> None:
    """The life of rank 1..N-1: join, load its shard, build its KV cache, then mirror rank 0's steps. It
    resolves the configs from the same files and device kind as rank 0, so they match rank 0's."""
    device = rank_device(config.device, local_rank)
    threading.Thread(target=_exit_with_parent, name="ember-tp-parent", daemon=True).start()
    try:
        _share_cpu_cores(device, size)
        init_tensor_parallel(rank, size, init_method, device)
        files = load_model_files(config.load)
        runner = ModelRunner(
            files,
            config.runner_config(device, files.checkpoint_dtype),
            config.cache,
            config.scheduler_config(files.model_config, device),
            device,
        )
        runner.prepare_cache()
        runner.serve_steps()
    except BaseException as e:
        if errors is not None:
            errors.put((rank, f"{type(e).__name__}: {e}"))
        raise
    finally:
        destroy_tensor_parallel()


def serve_as_torchrun_worker(config: EngineConfig) -> None:
    """Under torchrun, ranks other than 0 serve rank 0's engine and end the process when it stops."""
    run_worker(config, int(os.environ["RANK"]), config.tensor_parallel_size, "env://", int(os.environ["LOCAL_RANK"]))
    sys.exit(0)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _use_loopback_for_gloo() -> None:
    """All ranks are on this machine: gloo should not depend on the host name resolving to a
    reachable interface (it often does not in containers). The spawned ranks inherit the choice."""
    loopback = next((name for _, name in socket.if_nameindex() if name.startswith("lo")), None)
    if loopback is not None:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback)


class TensorParallelGroup:
    """Rank 0's side of the group."""

    def __init__(self, config: EngineConfig) -> None:
        self.size = config.tensor_parallel_size
        self.device = rank_device(config.device, 0)
        self.failure: str | None = None
        self._procs: list[multiprocessing.process.BaseProcess] = []
        self._stopping = False
        self._serving = False
        self._threads = torch.get_num_threads()  # this is the caller's process: restored at stop
        if launched_by_torchrun():
            if int(os.environ["WORLD_SIZE"]) != self.size:
                raise ValueError(
                    f"tensor_parallel_size ({self.size}) must equal torchrun's world size ({os.environ['WORLD_SIZE']})"
                )
            init_method = "env://"
        else:
            if self.device.type == "cuda" and torch.cuda.device_count() < self.size:
                raise ValueError(
                    f"tensor_parallel_size {self.size} needs {self.size} GPUs on this machine, "
                    f"{torch.cuda.device_count()} are visible (CUDA_VISIBLE_DEVICES)"
                )
            init_method = f"tcp://127.0.0.1:{_free_port()}"
            _use_loopback_for_gloo()
            ctx = multiprocessing.get_context("spawn")
            self._errors = ctx.SimpleQueue()
            for rank in range(1, self.size):
                proc = ctx.Process(
                    target=run_worker,
                    args=(config, rank, self.size, init_method, rank, self._errors),
                    name=f"ember-tp-rank{rank}",
                    daemon=True,
                )
                proc.start()
                self._procs.append(proc)
            self._watcher = threading.Thread(target=self._watch, name="ember-tp-watch", daemon=True)
            self._watcher.start()
        _share_cpu_cores(self.device, self.size)
        try:
            self._join(init_method)
        except BaseException:
            self._stopping = True
            self._kill_all()
            raise

    def _join(self, init_method: str) -> None:
        """Rendezvous in a thread: a rank that dies before it joins is an error here, not an endless wait."""
        error: list[BaseException] = []

        def join() -> None:
            try:
                init_tensor_parallel(0, self.size, init_method, self.device)
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
                error.append(e)

        thread = threading.Thread(target=join, name="ember-tp-join", daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(0.1)
            self.check()
        if error:
            raise error[0]

    def _watch(self) -> None:
        sentinels = {p.sentinel: p for p in self._procs}
        ready = multiprocessing.connection.wait(list(sentinels))
        if self._stopping:
            return
        assert isinstance(ready[0], int)  # wait() returns the sentinels it was given
        dead = sentinels[ready[0]]
        dead.join()
        reasons = []
        while not self._errors.empty():
            rank, message = self._errors.get()
            reasons.append(f"rank {rank}: {message}")
        self.failure = (
            f"tensor-parallel rank {dead.name.removeprefix('ember-tp-rank')} (pid {dead.pid}) exited "
            f"with code {dead.exitcode}" + (f" ({'; '.join(reasons)})" if reasons else "")
        )
        logger.error("%s; stopping the engine", self.failure)
        self._kill_all()
        if torch.distributed.is_initialized() and self.device.type == "cuda":
            torch.distributed.distributed_c10d._abort_process_group()  # NCCL waits would otherwise never end

    def check(self) -> None:
        if self.failure is not None:
            raise TensorParallelError(self.failure)

    def step_failed(self, error: Exception) -> TensorParallelError:
        """The error to raise after a step failed on rank 0: the ranks may be out of step now, so the
        engine cannot go on. Names the dead rank when one died (gloo notices a closed socket before
        the watcher sees the process exit)."""
        if self.failure is None and self._procs:  # wait for any rank to die, not for each in turn
            multiprocessing.connection.wait([p.sentinel for p in self._procs], timeout=_FAILURE_WAIT_S)
            if not all(p.is_alive() for p in self._procs):
                self._watcher.join(_FAILURE_WAIT_S)  # it names the rank, then ends
        if self.failure is None:
            self.failure = f"a tensor-parallel step failed on rank 0: {type(error).__name__}: {error}"
        return TensorParallelError(self.failure)

    def ready(self) -> None:
        """Every rank has its KV cache and graphs and now waits for steps."""
        self._serving = True

    def stop(self) -> None:
        if self._stopping:
            return
        self._stopping = True
        if self._serving and self.failure is None:
            try:
                send_stop()
            except RuntimeError as e:  # a rank died meanwhile; it is ended below all the same
                logger.warning("could not tell the tensor-parallel ranks to stop: %s", e)
        for proc in self._procs:
            proc.join(_JOIN_TIMEOUT_S if self._serving and self.failure is None else 0)
        self._kill_all()
        destroy_tensor_parallel()
        torch.set_num_threads(self._threads)

    def _kill_all(self) -> None:
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
                proc.join()
