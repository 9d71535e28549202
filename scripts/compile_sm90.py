"""Compile the Triton kernels that kernel tests launch for an H100/H200 (sm_90) on a machine without a GPU.

A stand-in driver tells Triton that the current device is an sm_90 GPU and makes every launch a no-op, so
the kernels' own launch wrappers, called by the given kernel tests with CPU tensors, drive Triton's real
compiler (front end, LLVM and the bundled ptxas) with the exact arguments and constexprs they build. What
this catches without a GPU: code the interpreter accepts but the compiler rejects, and kernels that need
more shared memory or threads than an H100 has. What it cannot: numerics (outputs are never written, so
the tests' own comparisons fail, and are ignored here) and speed.

    .venv/bin/python scripts/compile_sm90.py tests/test_lora_kernels.py tests/test_moe_kernels.py
    .venv/bin/python scripts/compile_sm90.py tests/test_deepseek.py -k "mla_decode_kernel or store_latent"

Prints the kernels compiled (name x specializations) and every test whose failure came from the compiler;
exits 1 if there was one. The Triton here may be newer than a GPU machine's (3.9 here, 3.6 on the lent
H200s): a kernel that compiles here can still meet an older compiler's limits.
"""

from __future__ import annotations

import collections
import os
import sys
import types
from typing import Any

os.environ["TRITON_INTERPRET"] = "0"  # before anything imports ember.kernels or the tests
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

import pytest
import torch
from triton.backends.compiler import GPUTarget
from triton.compiler.errors import CompilationError
from triton.runtime import driver
from triton.runtime.errors import OutOfResources, PTXASError

# An H100 SXM's limits as CUDA reports them (what Triton checks a compiled kernel against before a launch).
H100 = {"max_shared_mem": 232_448, "multiprocessor_count": 132, "max_num_regs": 65_536, "warpSize": 32}
COMPILER_ERRORS = (CompilationError, OutOfResources, PTXASError)


class Sm90Driver:
    """Triton's driver interface, as much of it as compiling and a launch touch: target sm_90, device 0,
    launches that do nothing; each kernel binary 'loaded' is recorded."""

    def __init__(self) -> None:
        self.compiled: list[tuple[str, int]] = []
        self.utils = types.SimpleNamespace(get_device_properties=lambda device: H100, load_binary=self._load)
        self.launcher_cls = lambda src, metadata: lambda *args, **kwargs: None

    def _load(self, name: str, binary: bytes, shared: int, device: int) -> tuple[int, int, int, int, int]:
        self.compiled.append((name, shared))
        return 1, 1, 0, 0, 1024  # module, function, registers, spills, max threads

    def is_active(self) -> bool:
        return True

    def get_current_target(self) -> GPUTarget:
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")

    def map_python_to_cpp_type(self, ty: str) -> str:
        return ty


class CompileFailures:
    """A pytest plugin: the tests whose call raised one of the compiler's errors."""

    def __init__(self) -> None:
        self.failures: list[tuple[str, str]] = []

    def pytest_runtest_makereport(self, item: Any, call: Any) -> None:
        if call.excinfo is not None and isinstance(call.excinfo.value, COMPILER_ERRORS):
            self.failures.append((item.nodeid, str(call.excinfo.value).strip().splitlines()[-1][:300]))


def main(argv: list[str]) -> int:
    sm90, plugin = Sm90Driver(), CompileFailures()
    driver.set_active(sm90)
    pytest.main([*argv, "-q", "--tb=no", "-p", "no:cacheprovider", "--no-header", "-rN"], plugins=[plugin])
    names = collections.Counter(name for name, _ in sm90.compiled)
    largest = max((shared for _, shared in sm90.compiled), default=0)
    print(f"\nsm_90: {len(sm90.compiled)} kernel binaries, largest shared memory {largest} B")
    for name, count in sorted(names.items()):
        print(f"  {name} x{count}")
    for nodeid, message in plugin.failures:
        print(f"COMPILE FAILED {nodeid}: {message}")
    print(f"{len(plugin.failures)} compile failures (the tests' own comparisons fail here by design)")
    return 1 if plugin.failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
