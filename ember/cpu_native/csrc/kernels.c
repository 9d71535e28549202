/* Ember's CPU decode kernels: weight-only int4/int8 GEMV over float32 activations (int4 also in bf16
 * arithmetic where the CPU has AVX512_BF16), the dense expansions of the same layouts for large
 * batches, paged decode attention read straight from the KV cache, and (the last section) the rest
 * of a decode layer fused: residual add + RMSNorm, rotary + KV store, gate/up GEMV + SiLU; and the LoRA
 * delta of rows under different adapters (lora.c), alone or inside the fused decode layers.
 *
 * Every function takes raw data pointers as Python ints plus sizes; ember/cpu_native/ops.py checks
 * shapes, dtypes and contiguity before calling. The compute runs without the GIL, on OpenMP threads
 * (the libgomp torch already loaded, so one thread pool serves both).
 *
 * Layouts (see ops.py):
 *   int4 codes: uint8 [N, K / 2]; each run of 32 inputs is 16 bytes, input j of the run in the low
 *     nibble of byte j and input j + 16 in the high one (GGUF's Q4_0/Q4_1 order), so one 16-byte
 *     load, a zero-extension, an and and a shift give two vectors of 16 codes.
 *   int5 codes: uint8 [N, K / 32 * 20]; each run of 32 inputs is 4 bytes of fifth bits then an int4 run
 *     (kernels.h, Q5_RUN_BYTES): int8 codes in [-16, 15] (GGUF Q5_0) in 5 bits, w = (q - 16) * scale.
 *   int8 codes: int8 [N, K], row-major.
 *   scales, zeros: float32 or float16 [N, ceil(K / group)]; w = q * scale + zero (zeros may be
 *     absent); the last group may be shorter (K a multiple of the run, not of the group).
 *
 * AVX-512 code sits under __AVX512F__; the #else branches compute the same sums in plain C so the
 * module builds (and is tested) anywhere.
 *
 * The families live in their own files (csrc/: gemv.c, expand.c, attention.c, lora.c, fused.c, argmax.c, with the
 * shared kernels.h) and are compiled as this one translation unit, so the whole-layer call keeps inlining
 * the GEMV tiles and norms it shares with the single ops, exactly as when they were one file.
 */

#include "kernels.h"
#include "gemv.c"
#include "expand.c"
#include "attention.c"
#include "lora.c"
#include "fused.c"
#include "argmax.c"

static PyObject *simd(PyObject *self, PyObject *unused) {
#ifdef __AVX512F__
    return PyUnicode_FromString("avx512");
#else
    return PyUnicode_FromString("scalar");
#endif
}

static PyMethodDef methods[] = {
    {"gemv_q4", (PyCFunction)(void (*)(void))gemv_q4, METH_FASTCALL, "y = x @ W^T, int4 codes"},
    {"gemv_q5", (PyCFunction)(void (*)(void))gemv_q5, METH_FASTCALL, "y = x @ W^T, int5 runs"},
    {"dequantize_q5_f32", (PyCFunction)(void (*)(void))dequantize_q5_f32, METH_FASTCALL, "int5 -> float32 [N, K]"},
    {"pack_q5", (PyCFunction)(void (*)(void))pack_q5, METH_FASTCALL, "int8 codes in [-16, 15] -> int5 runs"},
    {"gemv_silu_q5", (PyCFunction)(void (*)(void))gemv_silu_q5, METH_FASTCALL, "silu(x @ G^T) * (x @ U^T), int5"},
    {"gemv_q8", (PyCFunction)(void (*)(void))gemv_q8, METH_FASTCALL, "y = x @ W^T, int8 codes"},
    {"dequantize_q4_f32", (PyCFunction)(void (*)(void))dequantize_q4_f32, METH_FASTCALL, "int4 -> float32 [N, K]"},
    {"dequantize_q4_bf16", (PyCFunction)(void (*)(void))dequantize_q4_bf16, METH_FASTCALL, "int4 -> bf16 [N, K]"},
    {"gemv_q4_bf16", (PyCFunction)(void (*)(void))gemv_q4_bf16, METH_FASTCALL, "y = x @ W^T, int4, bf16 arithmetic"},
    {"gemv_q5_bf16", (PyCFunction)(void (*)(void))gemv_q5_bf16, METH_FASTCALL, "y = x @ W^T, int5, bf16 arithmetic"},
    {"gemv_q8_bf16", (PyCFunction)(void (*)(void))gemv_q8_bf16, METH_FASTCALL, "y = x @ W^T, int8, bf16 arithmetic"},
    {"has_bf16", has_bf16, METH_NOARGS, "whether the bf16 variants were compiled (AVX512_BF16)"},
    {"dequantize_q8_f32", (PyCFunction)(void (*)(void))dequantize_q8_f32, METH_FASTCALL, "int8 -> float32 [N, K]"},
    {"dequantize_rows", (PyCFunction)(void (*)(void))dequantize_rows, METH_FASTCALL, "rows of int4/5/8 -> float32 [M, K]"},
    {"paged_decode_attention", (PyCFunction)(void (*)(void))paged_decode_attention, METH_FASTCALL,
     "one-token queries against a paged KV cache"},
    {"decode_layers", (PyCFunction)(void (*)(void))decode_layers, METH_FASTCALL,
     "consecutive Llama decoder layers for one-token sequences, in one call"},
    {"layer_fields", layer_fields, METH_NOARGS, "the int64 slots of a decode_layers record"},
    {"lora_delta", (PyCFunction)(void (*)(void))lora_delta_entry, METH_FASTCALL,
     "y += each row's LoRA delta under its adapter slot"},
    {"gemv_lora", (PyCFunction)(void (*)(void))gemv_lora_entry, METH_FASTCALL,
     "y = x @ W^T (+ bias) + each row's LoRA delta, in one parallel region"},
    {"silu_mul", (PyCFunction)(void (*)(void))silu_mul, METH_FASTCALL, "silu(y[:, :I]) * y[:, I:]"},
    {"argmax", (PyCFunction)(void (*)(void))argmax, METH_FASTCALL, "each float32 row's argmax, as torch's"},
    {"simd", simd, METH_NOARGS, "which code path was compiled: 'avx512' or 'scalar'"},
    {"add_rms_norm", (PyCFunction)(void (*)(void))add_rms_norm, METH_FASTCALL, "residual add + RMSNorm"},
    {"rotary_store", (PyCFunction)(void (*)(void))rotary_store, METH_FASTCALL,
     "rotary on q and k in place, then k and v into their cache slots"},
    {"gemv_silu_q4", (PyCFunction)(void (*)(void))gemv_silu_q4, METH_FASTCALL, "silu(x @ G^T) * (x @ U^T), int4"},
    {"gemv_silu_q8", (PyCFunction)(void (*)(void))gemv_silu_q8, METH_FASTCALL, "silu(x @ G^T) * (x @ U^T), int8"},
    {"gemv_silu_q4_bf16", (PyCFunction)(void (*)(void))gemv_silu_q4_bf16, METH_FASTCALL,
     "silu(x @ G^T) * (x @ U^T), int4, bf16 arithmetic"},
    {"gemv_silu_q5_bf16", (PyCFunction)(void (*)(void))gemv_silu_q5_bf16, METH_FASTCALL,
     "silu(x @ G^T) * (x @ U^T), int5, bf16 arithmetic"},
    {"gemv_silu_q8_bf16", (PyCFunction)(void (*)(void))gemv_silu_q8_bf16, METH_FASTCALL,
     "silu(x @ G^T) * (x @ U^T), int8, bf16 arithmetic"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_ember_cpu_kernels", NULL, -1, methods};

PyMODINIT_FUNC PyInit__ember_cpu_kernels(void) { return PyModule_Create(&module); }
