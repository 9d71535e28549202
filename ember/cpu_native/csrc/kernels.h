/* What every kernel family shares: the includes, the tile sizes, float16 parameters and the
 * argument parsing of the Python entry points. See kernels.c for the module as a whole. */

#ifndef EMBER_CPU_KERNELS_H
#define EMBER_CPU_KERNELS_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

/* the tile loops, fully unrolled so their accumulators live in registers (without it GCC 12 kept
 * some tiles' accumulators on the stack) */
#define UNROLL _Pragma("GCC unroll 8")
#define MT 8 /* activation rows per tile: each weight chunk is dequantized once per tile */
#define NR 4 /* output rows per block */
/* Codes are prefetched this far ahead of the loads, into L2 (_MM_HINT_T1): a core keeps more misses to L2 in
 * flight than to L1. From DRAM, without any the GEMVs of one decode step's weights (30 SmolLM2 layers, 66 MB)
 * read 12 GB/s with two threads; into L1 (T0) 4 KB ahead read 15-24 GB/s, and held the Qwen2-0.5B Q4_K_M
 * step's weights (409 MB) to 16-17 GB/s, its kernels in cache 23-29; into L2 8-16 KB ahead 25 GB/s (its
 * Q8_0 LM head 31 against 20, a plain read with two threads 34; benchmarks/cpu_weight_stream.py, 2026-12-07). */
#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 16384
#endif
#define PREFETCH(p) _mm_prefetch((const char *)(p) + PREFETCH_BYTES, _MM_HINT_T1)

/* An int5 run of 32 inputs: 4 bytes whose bit j (little-endian) is the fifth bit of input j, then 16 bytes
 * of low nibbles laid out as an int4 run; codes c + 16 of int8 codes c in [-16, 15]. That is a GGUF Q5_0
 * block without its scale: 5 bits a weight where the int8 codes it decodes to take 8. */
#define Q5_RUN_BYTES 20

#ifdef __AVX512F__
/* the lanes of a 16-float vector that hold one of the `left` floats still to go */
static inline __mmask16 tail_mask(int64_t left) {
    return left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
}

/* 16 bf16 values (their bits) widened to float32, exactly */
static inline __m512 bf16_widen16(__m256i h) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#endif

/* a bf16 value (its bits) widened to float32, exactly */
static inline float bf16_value(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline int64_t groups(int64_t K, int64_t group) { return (K + group - 1) / group; }

/* A float16's value (exact in float32) */
static inline float half_to_float(uint16_t h) {
#ifdef __AVX512F__
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF, u;
    if (exp == 0x1F) {
        u = sign | 0x7F800000 | (man << 13);
    } else if (exp) {
        u = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man) { /* subnormal: normalise */
        int e = -1;
        do {
            man <<= 1;
            e++;
        } while (!(man & 0x400));
        u = sign | ((uint32_t)(112 - e) << 23) | ((man & 0x3FF) << 13);
    } else {
        u = sign;
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
#endif
}

/* Element i of a weight's scales or zeros [N, G] (count = N * G): float32 (mode 0) or float16 (mode 1); mode
 * 2 is GGUF K-quants' two-level form, int8 codes [N, G] then, from the next even byte, float16 bases, one per
 * super-block of 256 inputs (`per` = 256 / group groups): base * code, the float32 product the file's own
 * decoding computes, in 1 byte a group where float32 takes 4 (Q4_K: 4.6 bits a weight instead of 6.5). */
static inline float param(const void *p, int64_t i, int mode, int64_t count, int64_t group) {
    if (mode == 2) { /* groups of 16 or 32 (kernels.h's callers check): 16 or 8 a super-block, a shift */
        const uint16_t *base = (const uint16_t *)((const uint8_t *)p + count + (count & 1));
        return half_to_float(base[i >> (group == 16 ? 4 : 3)]) * (float)((const int8_t *)p)[i];
    }
    return mode ? half_to_float(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* ---- argument parsing: every argument is a Python int (pointers, sizes) or float ---- */

/* ints[i] = args[i] as an integer, or floats[i] where bit i of float_mask is set */
static int parse(PyObject *const *args, Py_ssize_t nargs, Py_ssize_t want, const char *name, int64_t *ints,
                 double *floats, uint64_t float_mask) {
    if (nargs != want) {
        PyErr_Format(PyExc_TypeError, "%s takes %zd arguments (%zd given)", name, want, nargs);
        return -1;
    }
    for (Py_ssize_t i = 0; i < nargs; i++) {
        if (float_mask >> i & 1) {
            floats[i] = PyFloat_AsDouble(args[i]);
        } else {
            ints[i] = PyLong_AsLongLong(args[i]);
        }
        if (PyErr_Occurred()) return -1;
    }
    return 0;
}

#define PTR(v) ((void *)(intptr_t)(v))

#endif
