"""Compiles csrc/kernels.c (with the kernel families it includes) with the system C compiler into a
per-user cache, once per source, flags, compiler, Python ABI and CPU. One translation unit gives
the same machine code as the single file it was split from (objdump compared, 2026-12-05).

The binary is built with -march=native, so the CPU's feature flags are part of the cache key: a
cache directory shared between machines never hands one a binary with instructions it lacks. The
front end and the engine core may build at the same moment; each writes its own temporary file and
renames it into place, so a reader sees a whole library or none.

`python -m ember.cpu_native.build` builds it and prints where (scripts/setup.sh runs it, so the
first server start does not pay the ~7 s compile on 2 cores).
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path
from types import ModuleType

SOURCES = Path(__file__).with_name("csrc")  # kernel families, one header, one translation unit
UNIT = "kernels.c"  # the translation unit, which includes the families
MODULE_NAME = "_ember_cpu_kernels"
# -ffp-contract=off: the dense expansions must round q * scale and then + zero as `dequantize` does;
# the kernels ask for their FMAs explicitly.
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-ffp-contract=off", "-std=c11")
COMPILE_TIMEOUT_S = 120


class BuildError(RuntimeError):
    """The compiler is missing, failed or timed out."""


def cache_dir() -> Path:
    """$EMBER_CACHE_DIR, else $XDG_CACHE_HOME/ember, else ~/.cache/ember; kernels in cpu_native/ under it."""
    root = os.environ.get("EMBER_CACHE_DIR")
    if not root:
        xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(xdg, "ember")
    return Path(root) / "cpu_native"


def compiler() -> str:
    """$CC, else cc, else gcc."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise BuildError("no C compiler found (set CC, or install gcc)")
    return cc


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        import platform

        return platform.processor() + platform.machine()


def _compiler_version(cc: str) -> str:
    try:
        done = subprocess.run([cc, "--version"], check=False, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise BuildError(f"C compiler {cc!r} cannot run: {e}") from e
    if done.returncode != 0:
        raise BuildError(f"C compiler {cc!r} --version exited with {done.returncode}")
    return done.stdout


def library_path(cc: str, extra_flags: tuple[str, ...] = (), sources: Path | None = None) -> Path:
    """Where the build for these sources (default SOURCES), flags, this compiler, Python ABI and CPU lives."""
    key = hashlib.sha256()
    code = b"".join(f.name.encode() + f.read_bytes() for f in sorted((sources or SOURCES).glob("*.[ch]")))
    for part in (
        code,
        " ".join(FLAGS + extra_flags).encode(),
        cc.encode(),
        _compiler_version(cc).encode(),
        sysconfig.get_config_var("EXT_SUFFIX").encode(),
        sys.version.encode(),
        _cpu_flags().encode(),
    ):
        key.update(part)
        key.update(b"\0")
    return cache_dir() / f"kernels-{key.hexdigest()[:20]}{sysconfig.get_config_var('EXT_SUFFIX')}"


def build(extra_flags: tuple[str, ...] = (), sources: Path | None = None) -> Path:
    """The compiled library's path, compiling it first unless the cache has it. `extra_flags` go after
    the defaults (tests build the plain-C path with -mno-avx512f); `sources`, another copy of csrc/
    (benchmarks/cpu_weight_stream.py compares kernel versions)."""
    cc = compiler()
    sources = sources or SOURCES
    target = library_path(cc, extra_flags, sources)
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=target.name + ".", suffix=".tmp")
    os.close(fd)
    cmd = [cc, *FLAGS, *extra_flags, f"-I{sysconfig.get_paths()['include']}", str(sources / UNIT), "-o", tmp, "-lm"]
    try:
        done = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
        if done.returncode != 0:
            raise BuildError(f"{' '.join(cmd)} exited with {done.returncode}: {done.stderr.strip()[-2000:]}")
        os.replace(tmp, target)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise BuildError(f"compiling {UNIT} with {cc!r} failed: {e}") from e
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def load(path: Path, name: str = MODULE_NAME) -> ModuleType:
    """Loads a built library. torch must be imported first: the library links libgomp.so.1 by its
    SONAME, and torch's wheel ships the runtime under that name, so the process keeps one OpenMP
    runtime (and one thread pool) instead of two competing for the cores."""
    import torch  # noqa: F401  (see above: torch's libgomp must be the one loaded)

    loader = importlib.machinery.ExtensionFileLoader(name, str(path))
    spec = importlib.util.spec_from_file_location(name, str(path), loader=loader)
    assert spec is not None  # never None when a loader is given
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def main() -> int:
    try:
        path = build()
    except BuildError as e:
        print(f"warning: Ember's CPU kernels were not built ({e}); the CPU path will use PyTorch ops", file=sys.stderr)
        return 0
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
