"""Quantized matmuls through the native CPU kernels (ember/cpu_native), where they are built and cover
the weight: the native layout replaces the packed or dense copies linear_cpu would make (int8 codes are
shared as they are)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ember.cpu_native import ops as native
from ember.ops.target import Target
from ember.quant.formats import QuantizedWeight, shape_only

# int4 weights in the native layout take bf16 arithmetic (ember/cpu_native/ops.py, NativeWeight) where the
# CPU has AVX512_BF16: float32 sums of bf16 products, each output rounded to bf16, at every row count.
# False: float32 at every row count, as on other CPUs. Both are consistent from batch to batch; bf16
# doubles the multiply-adds an instruction, which is what prefill and batched decode are bound by
# (default model, `benchmarks/cpu.py`, 2026-12-03: float32 prompt processing 722 tok/s against 1,286-1,646
# in bf16, 16 concurrent streams 268 against 332-414 tok/s). Until then int4 was float32 below 16 rows
# and bf16 above, and a prompt whose first blocks came from the prefix cache answered differently from
# the whole prompt (tests/test_llm_api.py keeps that case).
CPU_INT4_BF16 = True
# int5 and zero-free int8 weights (GGUF Q5_0, Q8_0, Q6_K) take bf16 arithmetic likewise where the CPU has
# AVX512_BF16: their codes are exact in bf16, so only x is rounded (gemv.c, q58bf_body). The float32 GEMV
# decoded each code to float32 and multiplied in float32, compute-bound from cache on two Zen 4 cores:
# Qwen2-0.5B's 4864 x 896 int5 gate/up, 16 rows 0.88-0.93 ms in float32 against 0.64-0.68 in bf16, one
# row 0.20-0.21 against 0.18; Q8_0 at that shape 1.06 against 0.63 (16 rows), 0.18 both (one row); the
# synthetic Qwen2-0.5B Q4_K_M file's 128-token prefill 0.68-0.76 s against 0.56-0.58 (2026-12-07,
# benchmarks/results/cpu-int58-bf16-2026-12-07.json). Its batch-1 step, reading 409 MB from DRAM, moved
# within noise (30.0 / 33.2 ms against 29.5 / 31.7).
CPU_INT8_BF16 = True
# Rows from which a native weight is expanded for oneDNN's GEMM (`ops.dequantize`: bf16 or float32, the
# weight's arithmetic) instead of running the native GEMV. `benchmarks/cpu_native_kernels.py`
# (crossover), one SmolLM2-135M layer's int4 weights in cache, 2-core AVX-512 EPYC at load 0.8-1.4,
# native against expanded: in bf16, 16 rows 0.36 / 0.41 ms, 20 rows 0.47-0.51 / 0.44, 24 rows 0.52-0.58
# / 0.47, 32 rows 0.75 / 0.54, 128 2.8 / 1.3; in float32 (the GEMV at the two cores' FMA peak from 8
# rows), 32 rows 0.98-1.03 / 1.86-1.87, 128 3.9-4.0 / 5.4, 256 8.5 / 9.9, 384 14.0 / 14.2, 512
# 19.5-20.2 / 18.2-19.0, 1024 46 / 36. The 49152 x 576 Q8_0 head, whose float32 expansion writes
# 113 MB: 256 rows 104 against 148 ms, 512 282 / 273.
# int5 and int8 in bf16 arithmetic never expand: their expansion is float32 (exact), whose GEMM ran at half
# the native tiles' rate. The synthetic Qwen2-0.5B Q4_K_M file, 32 prompts of 128 tokens at once (steps of
# 2,048 rows): 220 tok/s expanded from 512 rows, 265-276 native at every row count (2026-12-07).
NATIVE_EXPAND_MIN_ROWS = {"bf16": 20, "float32": 512, "int5/int8 bf16": math.inf}
# oneDNN keeps state for every row count its GEMM sees (a primitive and its JIT code, ~0.5-1 MB each on
# AMX), so a server whose steps have every row count from 20 to thousands grew without end: the core's
# RSS rose ~6 MiB per 16 requests of random lengths over 30 rounds here, and was flat with every step at
# one shape, or with the native GEMV at every row count. The expanded GEMM therefore runs on rows padded
# up to one of ROW_BUCKETS_PER_OCTAVE sizes per power of two (at most 25% more rows, 12% on average):
# about 35 row counts from 20 to 8192.
ROW_BUCKETS_PER_OCTAVE = 4


class NativeLinear:
    """x @ W^T in the weight's arithmetic (bf16 or float32) at every row count: the native GEMV below the
    crossover (NATIVE_EXPAND_MIN_ROWS), above it the weight expanded for oneDNN's GEMM (int5 and int8 in
    bf16 have none: the native GEMV at every row count)."""

    layout = "native"
    permutes_input = True

    @staticmethod
    def can_implement(target: Target, w: QuantizedWeight) -> bool:
        return target.native and native.fits(w)

    def __init__(self, w: QuantizedWeight, dtype: torch.dtype) -> None:
        arithmetic = CPU_INT4_BF16 if w.kind == "int4" else CPU_INT8_BF16
        self.native = native.native_weight(w, bf16=arithmetic and native.bf16_fits(w))
        self.weight = shape_only(w)  # the native layout replaces the codes it was made from
        self.expand_min_rows = native_expand_min_rows(self.native)

    def tensors(self) -> list[torch.Tensor]:
        return self.native.tensors()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if rows >= self.expand_min_rows:
            dense = native.dequantize(self.native)
            padded = F.pad(x.to(dense.dtype), (0, 0, 0, row_bucket(rows) - rows))
            return F.linear(padded, dense)[:rows].to(x.dtype)
        if x.dtype == torch.float32:
            return native.matmul(x, self.native)
        return native.matmul(x.float(), self.native).to(x.dtype)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor | None:
        """silu(gate) * up of this weight's output, for a fused gate/up projection (rows [0, I) gate,
        [I, 2I) up), in one native call (`ops.matmul_silu`) where x, float32 [M, K], takes the native GEMV
        (as a call would); else None."""
        if x.dtype != torch.float32 or x.dim() != 2 or not x.is_contiguous() or x.shape[0] >= self.expand_min_rows:
            return None
        return native.matmul_silu(x, self.native)


def row_bucket(rows: int) -> int:
    """`rows` rounded up to the next of ROW_BUCKETS_PER_OCTAVE sizes between two powers of two."""
    step = max(1, (1 << (rows.bit_length() - 1)) // ROW_BUCKETS_PER_OCTAVE)
    return -(-rows // step) * step


def native_expand_min_rows(w: native.NativeWeight) -> float:
    """Rows from which `w` is expanded for oneDNN (math.inf: never); below, the native GEMV runs."""
    if w.bf16:
        return NATIVE_EXPAND_MIN_ROWS["bf16" if w.kind == "int4" else "int5/int8 bf16"]
    return NATIVE_EXPAND_MIN_ROWS["float32"]
