"""The newest GPU kernels compile for an H100/H200 (sm_90) on a CPU-only machine: scripts/compile_sm90.py over
their kernel tests, which runs Triton's compiler and ptxas behind a stand-in driver. This catches code
that the interpreter accepts and the compiler refuses, and tiles over the card's shared memory. It does
not cover numerics or speed.

All 504 binaries of the older kernel tests compiled too (2026-12-06, 8 minutes). CI runs only the kernels
that landed without a GPU run: LoRA, the MoE MLP, MLA with its fp8 cache and fused prep, and the gated delta rule
(about 2 minutes).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TESTS = [
    ["tests/test_lora_kernels.py"],
    ["tests/test_moe_kernels.py", "-k", "fused_mlp or grouped_gemm"],
    ["tests/test_deepseek.py", "-k", "mla_decode_kernel or store_latent or mla_prep_kernel"],
    ["tests/test_qwen3_next.py", "-k", "triton_recurrent_kernel or triton_prefill_kernel"],
]


def test_new_kernels_compile_for_sm90():
    for args in TESTS:
        r = subprocess.run(
            [sys.executable, "scripts/compile_sm90.py", *args], cwd=ROOT, capture_output=True, text=True, timeout=900
        )
        assert r.returncode == 0, f"{args}: {r.stdout[-3000:]}{r.stderr[-2000:]}"
        binaries = re.search(r"sm_90: (\d+) kernel binaries", r.stdout)
        assert binaries and int(binaries.group(1)) > 0, f"{args}: nothing compiled\n{r.stdout[-2000:]}"


BROKEN = """
import torch
import triton
import triton.language as tl


@triton.jit
def _one_dim_dot(x_ptr, B: tl.constexpr):
    o = tl.arange(0, B)
    tl.store(x_ptr + o, tl.dot(tl.load(x_ptr + o), tl.load(x_ptr + o)))


@triton.jit
def _square(x_ptr, B: tl.constexpr):
    o = tl.arange(0, B)
    a = tl.load(x_ptr + o[:, None] * B + o[None, :])
    tl.store(x_ptr + o[:, None] * B + o[None, :], tl.dot(a, a))


def test_one_dim_dot():  # the interpreter runs it; the compiler refuses a dot of vectors
    _one_dim_dot[(1,)](torch.zeros(16), B=16)


def test_fits():
    _square[(1,)](torch.zeros(32 * 32, dtype=torch.float16), B=32)
"""


def test_compile_failures_are_reported(tmp_path):
    """A kernel the compiler refuses is named, one that compiles is counted. (Tiles over the shared memory
    are reported too, as `out of resource: shared memory`; a kernel that big takes minutes to compile.)"""
    (tmp_path / "test_broken.py").write_text(BROKEN)
    r = subprocess.run(
        [sys.executable, "scripts/compile_sm90.py", str(tmp_path / "test_broken.py")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 1, r.stdout[-3000:]
    failed = re.findall(r"COMPILE FAILED \S+::(\w+): (.*)", r.stdout)
    assert [name for name, _ in failed] == ["test_one_dim_dot"], r.stdout[-3000:]
    assert "sm_90: 1 kernel binaries" in r.stdout  # test_fits compiled
