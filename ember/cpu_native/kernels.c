/* Ember's CPU decode kernels: weight-only int4/int8 GEMV over float32 activations (int4 also in bf16
 * arithmetic where the CPU has AVX512_BF16), the dense expansions of the same layouts for large
 * batches, paged decode attention read straight from the KV cache, and (the last section) the rest
 * of a decode layer fused: residual add + RMSNorm, rotary + KV store, gate/up GEMV + SiLU.
 *
 * Every function takes raw data pointers as Python ints plus sizes; ember/cpu_native/ops.py checks
 * shapes, dtypes and contiguity before calling. The compute runs without the GIL, on OpenMP threads
 * (the libgomp torch already loaded, so one thread pool serves both).
 *
 * Layouts (see ops.py):
 *   int4 codes: uint8 [N, K / 2]; each run of 32 inputs is 16 bytes, input j of the run in the low
 *     nibble of byte j and input j + 16 in the high one (GGUF's Q4_0/Q4_1 order), so one 16-byte
 *     load, a zero-extension, an and and a shift give two vectors of 16 codes.
 *   int8 codes: int8 [N, K], row-major.
 *   scales, zeros: float32 or float16 [N, ceil(K / group)]; w = q * scale + zero (zeros may be
 *     absent); the last group may be shorter (K a multiple of the run, not of the group).
 *
 * AVX-512 code sits under __AVX512F__; the #else branches compute the same sums in plain C so the
 * module builds (and is tested) anywhere.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
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
/* Codes are prefetched this far ahead of the loads: from DRAM, without it the GEMVs of one decode
 * step's weights (30 SmolLM2 layers, 66 MB) read 12 GB/s with two threads; 1-16 KB ahead measured
 * 15-24 GB/s, 4 KB the best (the machine shared, so within noise of 8 KB). */
#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 4096
#endif

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

/* Element i of a float32 (half 0) or float16 (half 1) array */
static inline float param(const void *p, int64_t i, int half) {
    return half ? half_to_float(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

typedef struct {
    const float *x;      /* [M, K] */
    const void *codes;
    const void *scales;  /* [N, G], G = ceil(K / group), float32 or (half) float16 */
    const void *zeros;   /* [N, G] like scales, or NULL */
    float *y;            /* [M, N] */
    int64_t M, K, N, group;
    int half;
    const uint16_t *xb;  /* bits 16: x rounded to bf16 [M, K], made by `gemv` */
} gemv_args;

/* Each weight chunk is dequantized in registers (w = q * scale + zero: one FMA per 16 codes) and
 * multiplied into `mt` activation rows at once; `nr` output rows run side by side so that even one
 * activation row keeps 8 independent FMA chains in flight (a single row's chain of dependent FMAs
 * capped a 1536 x 576 GEMV at 16 GB/s from cache). `nr` and `mt` are constants at every call site,
 * so the accumulators stay in registers. */
#ifdef __AVX512F__
/* The scales and zeros of group g for output rows n0 .. n0 + nr, broadcast (zeros 0 where there are none) */
static inline __attribute__((always_inline)) void group_params(const gemv_args *a, int64_t n0, int nr, int64_t G,
                                                               int64_t g, __m512 *s, __m512 *z) {
    UNROLL
    for (int r = 0; r < nr; r++) {
        s[r] = _mm512_set1_ps(param(a->scales, (n0 + r) * G + g, a->half));
        z[r] = a->zeros ? _mm512_set1_ps(param(a->zeros, (n0 + r) * G + g, a->half)) : _mm512_setzero_ps();
    }
}

/* The 32 weights of the int4 run at p, q * scale + zero in one FMA each: inputs 0-15 of the run in lo,
 * 16-31 in hi. What both GEMVs multiply, and (rounded to bf16) what the bf16 expansion stores. */
static inline __attribute__((always_inline)) void q4_run(const uint8_t *p, __m512 s, __m512 z, __m512 *lo,
                                                         __m512 *hi) {
    __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    *lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(0x0F))), s, z);
    *hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4)), s, z);
}

static inline __attribute__((always_inline)) void q4_tile(const gemv_args *a, int64_t n0, int nr, int64_t m0,
                                                           int mt) {
    const int64_t K = a->K, G = groups(a->K, a->group);
    __m512 acc[NR][MT];
    UNROLL
    for (int r = 0; r < nr; r++)
        UNROLL
        for (int m = 0; m < mt; m++) acc[r][m] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        __m512 s[NR], z[NR];
        group_params(a, n0, nr, G, g, s, z);
        const int64_t end = (g + 1) * a->group < K ? (g + 1) * a->group : K;
        for (int64_t k = g * a->group; k < end; k += 32) {
            __m512 wl[NR], wh[NR];
            UNROLL
            for (int r = 0; r < nr; r++) {
                const uint8_t *p = (const uint8_t *)a->codes + (n0 + r) * (K / 2) + k / 2;
                _mm_prefetch((const char *)p + PREFETCH_BYTES, _MM_HINT_T0);
                q4_run(p, s[r], z[r], &wl[r], &wh[r]);
            }
            UNROLL
            for (int m = 0; m < mt; m++) {
                const float *xm = a->x + (m0 + m) * K + k;
                __m512 xl = _mm512_loadu_ps(xm), xh = _mm512_loadu_ps(xm + 16);
                UNROLL
                for (int r = 0; r < nr; r++) {
                    acc[r][m] = _mm512_fmadd_ps(wh[r], xh, _mm512_fmadd_ps(wl[r], xl, acc[r][m]));
                }
            }
        }
    }
    UNROLL
    for (int r = 0; r < nr; r++)
        UNROLL
        for (int m = 0; m < mt; m++)
            a->y[(m0 + m) * a->N + n0 + r] = _mm512_reduce_add_ps(acc[r][m]);
}

static inline __attribute__((always_inline)) void q8_tile(const gemv_args *a, int64_t n0, int nr, int64_t m0,
                                                           int mt) {
    const int64_t K = a->K, G = groups(a->K, a->group);
    __m512 acc[NR][MT];
    UNROLL
    for (int r = 0; r < nr; r++)
        UNROLL
        for (int m = 0; m < mt; m++) acc[r][m] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        __m512 s[NR], z[NR];
        group_params(a, n0, nr, G, g, s, z);
        const int64_t end = (g + 1) * a->group < K ? (g + 1) * a->group : K;
        for (int64_t k = g * a->group; k < end; k += 16) {
            __m512 w[NR];
            UNROLL
            for (int r = 0; r < nr; r++) {
                const int8_t *p = (const int8_t *)a->codes + (n0 + r) * K + k;
                _mm_prefetch((const char *)p + PREFETCH_BYTES, _MM_HINT_T0);
                w[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p))),
                                       s[r], z[r]);
            }
            UNROLL
            for (int m = 0; m < mt; m++) {
                __m512 xv = _mm512_loadu_ps(a->x + (m0 + m) * K + k);
                UNROLL
                for (int r = 0; r < nr; r++) acc[r][m] = _mm512_fmadd_ps(w[r], xv, acc[r][m]);
            }
        }
    }
    UNROLL
    for (int r = 0; r < nr; r++)
        UNROLL
        for (int m = 0; m < mt; m++)
            a->y[(m0 + m) * a->N + n0 + r] = _mm512_reduce_add_ps(acc[r][m]);
}
#else
static inline uint8_t q4_code(const uint8_t *run, int64_t j) {
    return j < 16 ? (run[j] & 0x0F) : (run[j - 16] >> 4);
}

static inline float q4_weight(const gemv_args *a, int64_t n, int64_t k) {
    const int64_t G = groups(a->K, a->group);
    const uint8_t *run = (const uint8_t *)a->codes + n * (a->K / 2) + (k / 32) * 16;
    float w = (float)q4_code(run, k % 32) * param(a->scales, n * G + k / a->group, a->half);
    return a->zeros ? w + param(a->zeros, n * G + k / a->group, a->half) : w;
}

static inline float q8_weight(const gemv_args *a, int64_t n, int64_t k) {
    const int64_t G = groups(a->K, a->group);
    float w = (float)((const int8_t *)a->codes)[n * a->K + k] * param(a->scales, n * G + k / a->group, a->half);
    return a->zeros ? w + param(a->zeros, n * G + k / a->group, a->half) : w;
}

#define SCALAR_TILE(name, weight)                                                           \
    static void name(const gemv_args *a, int64_t n0, int nr, int64_t m0, int mt) {          \
        for (int r = 0; r < nr; r++)                                                        \
            for (int m = 0; m < mt; m++) {                                                  \
                const float *xm = a->x + (m0 + m) * a->K;                                   \
                float acc = 0.f;                                                            \
                for (int64_t k = 0; k < a->K; k++) acc += weight(a, n0 + r, k) * xm[k];     \
                a->y[(m0 + m) * a->N + n0 + r] = acc;                                       \
            }                                                                               \
    }
SCALAR_TILE(q4_tile, q4_weight)
SCALAR_TILE(q8_tile, q8_weight)
#endif

/* float32 -> bf16, round to nearest even (what VCVTNEPS2BF16 and PyTorch's conversion do) */
static inline uint16_t bf16_round(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7FFFFFFF) > 0x7F800000) return (uint16_t)((u >> 16) | 0x40); /* quiet NaN */
    u += 0x7FFF + ((u >> 16) & 1);
    return (uint16_t)(u >> 16);
}

static inline float bf16_value(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

#ifdef __AVX512BF16__
/* int4 in bf16 arithmetic, as oneDNN's bf16 GEMM computes the expanded weight (`dequantize_q4_bf16`)
 * from 20 rows: x and w = q * scale + zero (one float32 FMA, then rounded to bf16) multiplied by
 * VDPBF16PS, 32 multiply-adds an instruction, float32 sums, each output rounded to bf16 (by `gemv`).
 * So every row count computes the same numbers up to summation order. */
static inline __attribute__((always_inline)) void q4bf_tile(const gemv_args *a, int64_t n0, int nr, int64_t m0,
                                                             int mt) {
    const int64_t K = a->K, G = groups(a->K, a->group);
    __m512 acc[NR][MT];
    UNROLL
    for (int r = 0; r < nr; r++)
        UNROLL
        for (int m = 0; m < mt; m++) acc[r][m] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        __m512 s[NR], z[NR];
        group_params(a, n0, nr, G, g, s, z);
        const int64_t end = (g + 1) * a->group < K ? (g + 1) * a->group : K;
        for (int64_t k = g * a->group; k < end; k += 32) {
            __m512bh w[NR];
            UNROLL
            for (int r = 0; r < nr; r++) {
                const uint8_t *p = (const uint8_t *)a->codes + (n0 + r) * (K / 2) + k / 2;
                _mm_prefetch((const char *)p + PREFETCH_BYTES, _MM_HINT_T0);
                __m512 lo, hi;
                q4_run(p, s[r], z[r], &lo, &hi);
                w[r] = _mm512_cvtne2ps_pbh(hi, lo); /* lanes 0-15: inputs k..k+15, 16-31: k+16..k+31 */
            }
            UNROLL
            for (int m = 0; m < mt; m++) {
                __m512bh xv = (__m512bh)_mm512_loadu_si512((const void *)(a->xb + (m0 + m) * K + k));
                UNROLL
                for (int r = 0; r < nr; r++) acc[r][m] = _mm512_dpbf16_ps(acc[r][m], w[r], xv);
            }
        }
    }
    UNROLL
    for (int r = 0; r < nr; r++)
        UNROLL
        for (int m = 0; m < mt; m++)
            a->y[(m0 + m) * a->N + n0 + r] = _mm512_reduce_add_ps(acc[r][m]);
}

/* n floats rounded to bf16 (to nearest even) and back, or into bf16 halves: 16 at a time, then the tail */
static void round_bf16(const float *in, float *out, uint16_t *halves, int64_t n) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m256bh h = _mm512_cvtneps_pbh(_mm512_loadu_ps(in + i));
        if (halves)
            _mm256_storeu_si256((__m256i *)(halves + i), (__m256i)h);
        else
            _mm512_storeu_ps(out + i, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)h), 16)));
    }
    for (; i < n; i++) {
        uint16_t h = bf16_round(in[i]);
        if (halves)
            halves[i] = h;
        else
            out[i] = bf16_value(h);
    }
}
#define HAS_BF16 1
#else
#define HAS_BF16 0
#endif

/* Activation rows m0 .. M in tiles of MT, then a tile each of 4, 2 and 1 rows for the rest: every
 * tile size a constant. */
#define M_TILES(tile, a, n, nr, m0)                                              \
    do {                                                                         \
        int64_t m_ = (m0);                                                       \
        for (; m_ + MT <= (a)->M; m_ += MT) tile((a), (n), (nr), m_, MT);        \
        if (m_ + 4 <= (a)->M) { tile((a), (n), (nr), m_, 4); m_ += 4; }          \
        if (m_ + 2 <= (a)->M) { tile((a), (n), (nr), m_, 2); m_ += 2; }          \
        if (m_ < (a)->M) tile((a), (n), (nr), m_, 1);                            \
    } while (0)

/* Output rows n0 .. n0 + nr (nr <= NR) against every activation row: one activation row takes all
 * NR weight rows at once, more take them two at a time (the weight rows stay in L1 across the
 * activation tiles). */
#define ROW_BLOCK(tile, a, n0, nr)                                               \
    do {                                                                         \
        if ((nr) == NR && (a)->M == 1) {                                         \
            tile((a), (n0), NR, 0, 1);                                           \
            break;                                                               \
        }                                                                        \
        for (int64_t n = (n0); n < (n0) + (nr); n += 2) {                        \
            if (n + 1 < (n0) + (nr))                                             \
                M_TILES(tile, a, n, 2, 0);                                       \
            else                                                                 \
                M_TILES(tile, a, n, 1, 0);                                       \
        }                                                                        \
    } while (0)

/* Below this many multiply-adds a call runs on the calling thread alone, as PyTorch's own grain size
 * keeps small ops: forking costs a few microseconds, and on a busy machine a parallel region waits for
 * whichever of its threads was descheduled. */
#define PARALLEL_MIN_WORK (1 << 18)

/* bits 4 / 8: int4 / int8 codes, float32 arithmetic; 16: int4 codes, bf16 arithmetic (q4bf_tile), x
 * rounded to bf16 here first. Returns -1 when the bf16 copy of x cannot be allocated. */
static int gemv(gemv_args *a, int bits, int threads) {
    const int64_t blocks = (a->N + NR - 1) / NR;
    if (a->M * a->N * a->K < PARALLEL_MIN_WORK) threads = 1;
    int64_t b;
    if (bits == 4) {
#pragma omp parallel for num_threads(threads) schedule(static)
        for (b = 0; b < blocks; b++) ROW_BLOCK(q4_tile, a, b * NR, a->N - b * NR < NR ? a->N - b * NR : NR);
    } else if (bits == 8) {
#pragma omp parallel for num_threads(threads) schedule(static)
        for (b = 0; b < blocks; b++) ROW_BLOCK(q8_tile, a, b * NR, a->N - b * NR < NR ? a->N - b * NR : NR);
    } else {
#if HAS_BF16
        uint16_t *xb = malloc(sizeof(uint16_t) * (size_t)(a->M * a->K));
        if (!xb) return -1;
        round_bf16(a->x, NULL, xb, a->M * a->K);
        a->xb = xb;
#pragma omp parallel for num_threads(threads) schedule(static)
        for (b = 0; b < blocks; b++) ROW_BLOCK(q4bf_tile, a, b * NR, a->N - b * NR < NR ? a->N - b * NR : NR);
        free(xb);
        round_bf16(a->y, a->y, NULL, a->M * a->N);
#endif
    }
    return 0;
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

/* the bf16 variants (bits 16) exist only where the CPU has AVX512_BF16 (see has_bf16) */
static int bf16_built(int bits, const char *name) {
    if (bits == 16 && !HAS_BF16) {
        PyErr_Format(PyExc_RuntimeError, "%s: built without AVX512_BF16", name);
        return 0;
    }
    return 1;
}

/* gemv_q{4,8}(x, codes, scales, zeros, y, M, K, N, group, threads, half): y = x @ W^T; half: scales and
 * zeros are float16 */
static PyObject *gemv_entry(PyObject *const *args, Py_ssize_t nargs, int bits, const char *name) {
    int64_t v[11];
    if (!bf16_built(bits, name) || parse(args, nargs, 11, name, v, NULL, 0) < 0) return NULL;
    gemv_args a = {PTR(v[0]), PTR(v[1]), PTR(v[2]), PTR(v[3]), PTR(v[4]), v[5], v[6], v[7], v[8], (int)v[10], NULL};
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = gemv(&a, bits, (int)v[9]);
    Py_END_ALLOW_THREADS
    if (status < 0) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyObject *gemv_q4(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    return gemv_entry(args, nargs, 4, "gemv_q4");
}

static PyObject *gemv_q8(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    return gemv_entry(args, nargs, 8, "gemv_q8");
}

/* gemv_q4_bf16: gemv_q4 in bf16 arithmetic (q4bf_tile), x float32 */
static PyObject *gemv_q4_bf16(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    return gemv_entry(args, nargs, 16, "gemv_q4_bf16");
}

static PyObject *has_bf16(PyObject *self, PyObject *unused) { return PyBool_FromLong(HAS_BF16); }

/* ---- dense expansions, exactly `dequantize`: q * scale, then + zero, each rounded in float32 ---- */

#ifdef __AVX512F__
static inline __m512 affine512(__m512 q, __m512 s, __m512 z, int has_zero) {
    __m512 w = _mm512_mul_ps(q, s);
    return has_zero ? _mm512_add_ps(w, z) : w;
}

static inline void q4_expand_run(const uint8_t *p, float s, float z, int has_zero, float *o) {
    __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    __m512 vs = _mm512_set1_ps(s), vz = _mm512_set1_ps(z);
    _mm512_storeu_ps(o, affine512(_mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(0x0F))), vs, vz, has_zero));
    _mm512_storeu_ps(o + 16, affine512(_mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4)), vs, vz, has_zero));
}

static inline void q8_expand_run(const int8_t *p, float s, float z, int has_zero, float *o) {
    __m512 q = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
    _mm512_storeu_ps(o, affine512(q, _mm512_set1_ps(s), _mm512_set1_ps(z), has_zero));
}
#else
static inline float affine(float q, float s, float z, int has_zero) {
    float w = q * s;
    return has_zero ? w + z : w;
}

static inline void q4_expand_run(const uint8_t *p, float s, float z, int has_zero, float *o) {
    for (int j = 0; j < 16; j++) {
        o[j] = affine((float)(p[j] & 0x0F), s, z, has_zero);
        o[j + 16] = affine((float)(p[j] >> 4), s, z, has_zero);
    }
}

static inline void q8_expand_run(const int8_t *p, float s, float z, int has_zero, float *o) {
    for (int j = 0; j < 16; j++) o[j] = affine((float)p[j], s, z, has_zero);
}
#endif

#if HAS_BF16
/* the weight q4bf_tile multiplies: q * scale + zero in one FMA (float32), rounded to bf16 (to nearest
 * even), so oneDNN's GEMM over the expansion and the GEMV compute the same products */
static inline void q4_expand_run_bf16(const uint8_t *p, float s, float z, uint16_t *o) {
    __m512 lo, hi;
    q4_run(p, _mm512_set1_ps(s), _mm512_set1_ps(z), &lo, &hi);
    _mm512_storeu_si512((void *)o, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
}
#endif

/* dequantize_q{4,8}_f32(codes, scales, zeros, out, N, K, group, threads, half): out float32 [N, K];
 * dequantize_q4_bf16 (bits 16): the same rounded to bf16, for oneDNN's bf16 GEMM */
static PyObject *expand_entry(PyObject *const *args, Py_ssize_t nargs, int bits, const char *name) {
    int64_t v[9];
    if (!bf16_built(bits, name) || parse(args, nargs, 9, name, v, NULL, 0) < 0) return NULL;
    const void *scales = PTR(v[1]), *zeros = PTR(v[2]);
    const int half = (int)v[8];
    const int64_t N = v[4], K = v[5], group = v[6], G = groups(K, group), run = bits == 8 ? 16 : 32;
    const int has_zero = zeros != NULL;
    Py_BEGIN_ALLOW_THREADS
    int64_t n;
#pragma omp parallel for num_threads((int)v[7]) schedule(static)
    for (n = 0; n < N; n++) {
        for (int64_t k = 0; k < K; k += run) {
            float s = param(scales, n * G + k / group, half), z = has_zero ? param(zeros, n * G + k / group, half) : 0.f;
            float *o = (float *)PTR(v[3]) + n * K + k;
            if (bits == 4)
                q4_expand_run((const uint8_t *)PTR(v[0]) + (n * K + k) / 2, s, z, has_zero, o);
            else if (bits == 8)
                q8_expand_run((const int8_t *)PTR(v[0]) + n * K + k, s, z, has_zero, o);
#if HAS_BF16
            else
                q4_expand_run_bf16((const uint8_t *)PTR(v[0]) + (n * K + k) / 2, s, z, (uint16_t *)PTR(v[3]) + n * K + k);
#endif
        }
    }
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *dequantize_q4_f32(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    return expand_entry(args, nargs, 4, "dequantize_q4_f32");
}

static PyObject *dequantize_q4_bf16(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    return expand_entry(args, nargs, 16, "dequantize_q4_bf16");
}

static PyObject *dequantize_q8_f32(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    return expand_entry(args, nargs, 8, "dequantize_q8_f32");
}

/* ---- paged decode attention ---- */

#define MAX_GROUP 64   /* query heads per KV head */
#define MAX_ACC 8192   /* query heads per KV head times head dimension (32 KB of accumulators) */
#define MAX_BLOCK 256  /* keys per cache block */

typedef struct {
    const float *q;          /* [nd, Hq, D], token stride q_stride */
    const float *k, *v;      /* [blocks, block_size, Hk, D] */
    const int32_t *tables;   /* [nd, table_stride] */
    const int32_t *seq_lens; /* [nd] */
    const float *sinks;      /* [Hq] or NULL */
    float *out;              /* [nd, Hq, D] */
    int64_t q_stride, table_stride, Hq, Hk, D, block_size, window;
    float scale, cap;
} attn_args;

#ifdef __AVX512F__
/* exp for x <= 0 (scores minus their running maximum): 2^n * p(r), r = x - n ln2, degree-6
 * polynomial, within 2 ulp of expf; below -87 it flushes to 0. */
static inline __m512 exp512(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
    __m512 e = _mm512_scalef_ps(p, n);
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.f), _CMP_LE_OQ), e, _mm512_setzero_ps());
}

static inline float dot(const float *a, const float *b, int64_t d) {
    __m512 acc = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= d; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
    if (i < d) {
        __mmask16 m = (__mmask16)((1u << (d - i)) - 1);
        acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, a + i), _mm512_maskz_loadu_ps(m, b + i), acc);
    }
    return _mm512_reduce_add_ps(acc);
}

/* p[i] = exp(s[i] - mx) for i < n */
static inline void exp_shifted(float *p, const float *s, int64_t n, float mx) {
    __m512 vm = _mm512_set1_ps(mx);
    for (int64_t i = 0; i < n; i += 16) {
        __mmask16 m = n - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - i)) - 1);
        _mm512_mask_storeu_ps(p + i, m, exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + i), vm)));
    }
}

/* acc = acc * alpha + sum_j p[j] v_j, 64 columns at a time in registers (one pass over the keys per 64
 * columns: 1.6x faster than a pass per 16 for head dim 64) */
static inline void scale_add(float *acc, float alpha, const float *p, const float *v, int64_t n, int64_t vstride,
                             int64_t d) {
    for (int64_t i0 = 0; i0 < d; i0 += 64) {
        __mmask16 m[4];
        __m512 a[4];
        UNROLL
        for (int c = 0; c < 4; c++) {
            int64_t left = d - i0 - 16 * c;
            m[c] = left >= 16 ? (__mmask16)0xFFFF : left > 0 ? (__mmask16)((1u << left) - 1) : 0;
            a[c] = _mm512_mul_ps(_mm512_maskz_loadu_ps(m[c], acc + i0 + 16 * c), _mm512_set1_ps(alpha));
        }
        for (int64_t j = 0; j < n; j++) {
            __m512 pj = _mm512_set1_ps(p[j]);
            UNROLL
            for (int c = 0; c < 4; c++)
                a[c] = _mm512_fmadd_ps(pj, _mm512_maskz_loadu_ps(m[c], v + j * vstride + i0 + 16 * c), a[c]);
        }
        UNROLL
        for (int c = 0; c < 4; c++) _mm512_mask_storeu_ps(acc + i0 + 16 * c, m[c], a[c]);
    }
}
#else
static inline float dot(const float *a, const float *b, int64_t d) {
    float acc = 0.f;
    for (int64_t i = 0; i < d; i++) acc += a[i] * b[i];
    return acc;
}

static inline void exp_shifted(float *p, const float *s, int64_t n, float mx) {
    for (int64_t i = 0; i < n; i++) p[i] = expf(s[i] - mx);
}

static inline void scale_add(float *acc, float alpha, const float *p, const float *v, int64_t n, int64_t vstride,
                             int64_t d) {
    for (int64_t i = 0; i < d; i++) {
        float a = acc[i] * alpha;
        for (int64_t j = 0; j < n; j++) a += p[j] * v[j * vstride + i];
        acc[i] = a;
    }
}
#endif

/* One sequence's query heads of one KV head, online softmax over its blocks in order. */
static void attend_one(const attn_args *a, int64_t s, int64_t h) {
    const int64_t G = a->Hq / a->Hk, D = a->D, bs = a->block_size, row = a->Hk * D;
    const int64_t len = a->seq_lens[s], pos = len - 1;
    const int64_t first = a->window > 0 && pos - a->window + 1 > 0 ? pos - a->window + 1 : 0;
    const int32_t *table = a->tables + s * a->table_stride;
    float acc[MAX_ACC], mx[MAX_GROUP], l[MAX_GROUP], sc[MAX_BLOCK], p[MAX_BLOCK];
    const float *q = a->q + s * a->q_stride + h * G * D;
    for (int64_t g = 0; g < G; g++) {
        mx[g] = -INFINITY;
        l[g] = 0.f;
        memset(acc + g * D, 0, sizeof(float) * (size_t)D);
    }
    for (int64_t b = first / bs; b * bs < len; b++) {
        int64_t j0 = b * bs < first ? first - b * bs : 0, j1 = len - b * bs < bs ? len - b * bs : bs, nj = j1 - j0;
        const float *kb = a->k + ((int64_t)table[b] * bs + j0) * row + h * D;
        const float *vb = a->v + ((int64_t)table[b] * bs + j0) * row + h * D;
        for (int64_t g = 0; g < G; g++) {
            float bmax = -INFINITY;
            for (int64_t j = 0; j < nj; j++) {
                float x = dot(q + g * D, kb + j * row, D) * a->scale;
                if (a->cap > 0.f) x = a->cap * tanhf(x / a->cap);
                sc[j] = x;
                bmax = x > bmax ? x : bmax;
            }
            float m_new = bmax > mx[g] ? bmax : mx[g];
            float alpha = mx[g] == -INFINITY ? 0.f : expf(mx[g] - m_new);
            exp_shifted(p, sc, nj, m_new);
            float psum = 0.f;
            for (int64_t j = 0; j < nj; j++) psum += p[j];
            l[g] = l[g] * alpha + psum;
            mx[g] = m_new;
            scale_add(acc + g * D, alpha, p, vb, nj, row, D);
        }
    }
    for (int64_t g = 0; g < G; g++) {
        float norm = l[g], alpha = 1.f;
        if (a->sinks) {
            float sink = a->sinks[h * G + g], m_new = sink > mx[g] ? sink : mx[g];
            alpha = mx[g] == -INFINITY ? 0.f : expf(mx[g] - m_new);
            norm = l[g] * alpha + expf(sink - m_new);
        }
        float f = norm > 0.f ? alpha / norm : 0.f;
        float *o = a->out + (s * a->Hq + h * G + g) * D;
        for (int64_t i = 0; i < D; i++) o[i] = acc[g * D + i] * f;
    }
}

static int attention_fits(const attn_args *a) {
    return a->Hq / a->Hk <= MAX_GROUP && a->Hq / a->Hk * a->D <= MAX_ACC && a->block_size <= MAX_BLOCK;
}

/* nd one-token queries, parallel over (sequence, KV head) */
static void attend(const attn_args *a, int64_t nd, int threads) {
    int64_t work = 0;
    for (int64_t s = 0; s < nd; s++) work += a->seq_lens[s];
    if (work * a->Hq * a->D < PARALLEL_MIN_WORK) threads = 1;
    int64_t i;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (i = 0; i < nd * a->Hk; i++) attend_one(a, i / a->Hk, i % a->Hk);
}

/* paged_decode_attention(q, q_stride, k_cache, v_cache, tables, table_stride, seq_lens, sinks, out,
 *                        nd, Hq, Hk, D, block_size, window, scale, cap, threads)
 * window 0: none; cap 0: none; sinks 0: none. */
static PyObject *paged_decode_attention(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    int64_t v[18];
    double f[18];
    if (parse(args, nargs, 18, "paged_decode_attention", v, f, 1u << 15 | 1u << 16) < 0) return NULL;
    attn_args a = {PTR(v[0]), PTR(v[2]), PTR(v[3]), PTR(v[4]), PTR(v[6]), PTR(v[7]), PTR(v[8]),
                   v[1], v[5], v[10], v[11], v[12], v[13], v[14], (float)f[15], (float)f[16]};
    const int64_t nd = v[9];
    if (!attention_fits(&a)) {
        PyErr_SetString(PyExc_ValueError, "paged_decode_attention: group, head dim or block size too large");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    attend(&a, nd, (int)v[17]);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* ==== fused decode-layer ops (float32): residual add + RMSNorm, rotary + KV store, gate/up + SiLU ====
 * What a CPU decode layer runs between its GEMVs, each in one call instead of 3-6 PyTorch ops of
 * ~6-12 us apiece (the data is a few KB: the ops' dispatch, not their arithmetic, was the cost). */

/* Rows of an elementwise op run on the calling thread below this many elements (a decode step's few KB) */
#define ROWS_PARALLEL_MIN (1 << 16)

#ifdef __AVX512F__
static inline __mmask16 tail_mask(int64_t left) {
    return left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
}
#endif

/* One row: sum = x + residual (when residual), out = sum * rsqrt(mean(sum^2) + eps) * w, float32 as
 * F.rms_norm computes it (the sum of squares in another order). */
static void add_rms_norm_row(const float *x, const float *res, const float *w, float *out, float *sum, int64_t n,
                             float eps) {
    const float *s = x;
    if (res) {
        for (int64_t i = 0; i < n; i++) sum[i] = x[i] + res[i];
        s = sum;
    }
#ifdef __AVX512F__
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 16) {
        __m512 v = _mm512_maskz_loadu_ps(tail_mask(n - i), s + i);
        acc = _mm512_fmadd_ps(v, v, acc);
    }
    const float ss = _mm512_reduce_add_ps(acc);
#else
    float ss = 0.f;
    for (int64_t i = 0; i < n; i++) ss += s[i] * s[i];
#endif
    const float r = 1.f / sqrtf(ss / (float)n + eps);
    for (int64_t i = 0; i < n; i++) out[i] = s[i] * r * w[i];
}

static void norm_rows(const float *x, const float *res, const float *w, float *out, float *sum, int64_t M,
                      int64_t N, float eps, int threads) {
    if (M * N < ROWS_PARALLEL_MIN) threads = 1;
    int64_t m;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (m = 0; m < M; m++)
        add_rms_norm_row(x + m * N, res ? res + m * N : NULL, w, out + m * N, res ? sum + m * N : NULL, N, eps);
}

/* add_rms_norm(x, residual, weight, out, sum, M, N, eps, threads): residual 0 normalises x alone (sum
 * unused) */
static PyObject *add_rms_norm(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    int64_t v[9];
    double f[9];
    if (parse(args, nargs, 9, "add_rms_norm", v, f, 1u << 7) < 0) return NULL;
    Py_BEGIN_ALLOW_THREADS
    norm_rows(PTR(v[0]), PTR(v[1]), PTR(v[2]), PTR(v[3]), PTR(v[4]), v[5], v[6], (float)f[7], (int)v[8]);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* One head in place, neox style: x[i] * cos[i] + x[i +- D/2] * sin_signed[i] (sin_signed: sin with its
 * first half negated), a product then a sum, no FMA, so bit for bit RotaryEmbedding's CPU ops. */
static void rotate_head(float *x, const float *c, const float *s, int64_t half) {
#ifdef __AVX512F__
    for (int64_t i = 0; i < half; i += 16) {
        __mmask16 m = tail_mask(half - i);
        __m512 a = _mm512_maskz_loadu_ps(m, x + i), b = _mm512_maskz_loadu_ps(m, x + half + i);
        __m512 lo = _mm512_add_ps(_mm512_mul_ps(a, _mm512_maskz_loadu_ps(m, c + i)),
                                  _mm512_mul_ps(b, _mm512_maskz_loadu_ps(m, s + i)));
        __m512 hi = _mm512_add_ps(_mm512_mul_ps(b, _mm512_maskz_loadu_ps(m, c + half + i)),
                                  _mm512_mul_ps(a, _mm512_maskz_loadu_ps(m, s + half + i)));
        _mm512_mask_storeu_ps(x + i, m, lo);
        _mm512_mask_storeu_ps(x + half + i, m, hi);
    }
#else
    for (int64_t i = 0; i < half; i++) {
        float a = x[i], b = x[half + i];
        x[i] = a * c[i] + b * s[i];
        x[half + i] = b * c[half + i] + a * s[half + i];
    }
#endif
}

/* rotary_store(qkv, row_stride, positions, cos, sin_signed, table_rows, k_cache, v_cache, slots,
 *              cache_slots, T, Hq, Hk, D, threads)
 * qkv float32 [T, row_stride]: Hq query heads, Hk key heads, Hk value heads of D each from column 0.
 * The query and key heads are rotated in place at positions (int64 [T], rows of the [table_rows, D]
 * tables); then keys and values are copied to slot slots[t] of the [cache_slots, Hk, D] caches (-1:
 * none). Positions and slots out of range raise before anything is written. */
/* Query and key heads: each RMS-normalised in place first where q_norm / k_norm (float32 [D]) are given
 * (Qwen3's QK norm), then rotated; keys and values then copied to their slots. */
static void rotate_store_rows(float *qkv, int64_t stride, const int64_t *pos, const float *cos, const float *sin,
                              float *kc, float *vc, const int64_t *slots, int64_t T, int64_t Hq, int64_t Hk, int64_t D,
                              const float *q_norm, const float *k_norm, float eps, int threads) {
    if (T * (Hq + 2 * Hk) * D < ROWS_PARALLEL_MIN) threads = 1;
    const size_t kv_bytes = sizeof(float) * (size_t)(Hk * D);
    int64_t t;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (t = 0; t < T; t++) {
        float *row = qkv + t * stride;
        for (int64_t h = 0; h < Hq + Hk; h++) {
            const float *w = h < Hq ? q_norm : k_norm;
            if (w) add_rms_norm_row(row + h * D, NULL, w, row + h * D, NULL, D, eps);
            rotate_head(row + h * D, cos + pos[t] * D, sin + pos[t] * D, D / 2);
        }
        if (slots[t] >= 0) {
            memcpy(kc + slots[t] * Hk * D, row + Hq * D, kv_bytes);
            memcpy(vc + slots[t] * Hk * D, row + (Hq + Hk) * D, kv_bytes);
        }
    }
}

/* IndexError unless every position is a row of the tables and every slot one of the cache's (or -1) */
static int check_positions(const char *name, const int64_t *pos, const int64_t *slots, int64_t T, int64_t rows,
                           int64_t cache_slots) {
    for (int64_t t = 0; t < T; t++) {
        if (pos[t] < 0 || pos[t] >= rows || slots[t] < -1 || slots[t] >= cache_slots) {
            PyErr_Format(PyExc_IndexError, "%s: token %lld has position %lld (table of %lld) and slot %lld (cache "
                         "of %lld)", name, (long long)t, (long long)pos[t], (long long)rows, (long long)slots[t],
                         (long long)cache_slots);
            return -1;
        }
    }
    return 0;
}

static PyObject *rotary_store(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    int64_t v[15];
    if (parse(args, nargs, 15, "rotary_store", v, NULL, 0) < 0) return NULL;
    float *qkv = PTR(v[0]), *kc = PTR(v[6]), *vc = PTR(v[7]);
    const int64_t *pos = PTR(v[2]), *slots = PTR(v[8]);
    const float *cos = PTR(v[3]), *sin = PTR(v[4]);
    const int64_t stride = v[1], T = v[10], Hq = v[11], Hk = v[12], D = v[13];
    if (check_positions("rotary_store", pos, slots, T, v[5], v[9]) < 0) return NULL;
    Py_BEGIN_ALLOW_THREADS
    rotate_store_rows(qkv, stride, pos, cos, sin, kc, vc, slots, T, Hq, Hk, D, NULL, NULL, 0.f, (int)v[14]);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* out[m, i] = silu(y[m, i]) * y[m, I + i], silu(g) = g / (1 + exp(-g)) computed as g * sigmoid(g) from
 * e = exp(-|g|) (exp512's domain, and no overflow): sigmoid = 1 / (1 + e) for g >= 0, e / (1 + e) below */
static void silu_mul_row(const float *y, float *out, int64_t I) {
#ifdef __AVX512F__
    const __m512 one = _mm512_set1_ps(1.f);
    for (int64_t i = 0; i < I; i += 16) {
        __mmask16 m = tail_mask(I - i);
        __m512 g = _mm512_maskz_loadu_ps(m, y + i), u = _mm512_maskz_loadu_ps(m, y + I + i);
        __m512 e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(g)));
        __m512 num = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_LT_OQ), one, e);
        __m512 silu = _mm512_mul_ps(g, _mm512_div_ps(num, _mm512_add_ps(one, e)));
        _mm512_mask_storeu_ps(out + i, m, _mm512_mul_ps(silu, u));
    }
#else
    for (int64_t i = 0; i < I; i++) out[i] = y[i] / (1.f + expf(-y[i])) * y[I + i];
#endif
}

/* a->y [M, 2I] = x @ [G; U]^T (a->N = 2I), then out [M, I] = silu(gate) * up */
static int gemv_silu(gemv_args *a, float *out, int bits, int threads) {
    if (gemv(a, bits, threads) < 0) return -1;
    const int64_t M = a->M, I = a->N / 2;
    if (M * I < ROWS_PARALLEL_MIN) threads = 1;
    int64_t m;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (m = 0; m < M; m++) silu_mul_row(a->y + m * 2 * I, out + m * I, I);
    return 0;
}

/* gemv_silu_q{4,8}(x, codes, scales, zeros, out, M, K, I, group, threads, half): the fused gate/up GEMV
 * (rows [0, I) gate, [I, 2I) up) into a scratch [M, 2I], then out [M, I] = silu(gate) * up */
static PyObject *gemv_silu_entry(PyObject *const *args, Py_ssize_t nargs, int bits, const char *name) {
    int64_t v[11];
    if (!bf16_built(bits, name) || parse(args, nargs, 11, name, v, NULL, 0) < 0) return NULL;
    const int64_t M = v[5], I = v[7];
    /* a scratch per call: freed blocks this size come back from malloc's free lists (glibc raises its
     * mmap threshold to a freed block's size), so this costs nanoseconds against a GEMV's microseconds */
    float *y = malloc(sizeof(float) * (size_t)(M * 2 * I));
    if (!y) return PyErr_NoMemory();
    gemv_args a = {PTR(v[0]), PTR(v[1]), PTR(v[2]), PTR(v[3]), y, M, v[6], 2 * I, v[8], (int)v[10], NULL};
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = gemv_silu(&a, PTR(v[4]), bits, (int)v[9]);
    Py_END_ALLOW_THREADS
    free(y);
    if (status < 0) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyObject *gemv_silu_q4(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    return gemv_silu_entry(args, nargs, 4, "gemv_silu_q4");
}

static PyObject *gemv_silu_q8(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    return gemv_silu_entry(args, nargs, 8, "gemv_silu_q8");
}

static PyObject *gemv_silu_q4_bf16(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    return gemv_silu_entry(args, nargs, 16, "gemv_silu_q4_bf16");
}

/* ---- a whole decode layer in one call ---- */

/* a weight as decode_layer takes it: 6 ints (codes, scales, zeros, group, half, bits: 4, 8 or 16) */
typedef struct {
    const void *codes, *scales, *zeros;
    int64_t group;
    int half, bits;
} weight_ref;

static weight_ref weight_at(const int64_t *v) {
    weight_ref w = {PTR(v[0]), PTR(v[1]), PTR(v[2]), v[3], (int)v[4], (int)v[5]};
    return w;
}

static gemv_args gemv_of(const weight_ref *w, const float *x, float *y, int64_t M, int64_t K, int64_t N) {
    gemv_args a = {x, w->codes, w->scales, w->zeros, y, M, K, N, w->group, w->half, NULL};
    return a;
}

/* decode_layer(x, residual, in_norm, post_norm, qkv[6], o[6], gate_up[6], down[6], positions, cos, sin_signed,
 *              table_rows, k_cache, v_cache, cache_slots, slots, tables, table_stride, seq_lens, block_size,
 *              window, M, H, Hq, Hk, D, I, threads, out, residual_out, q_norm, k_norm, eps, scale, cap,
 *              qk_eps, qkv_bias)
 * A Llama decoder layer for M one-token sequences, the calls a layer's modules make one by one, in the
 * same order with the same kernels (so bit for bit their result): residual add + RMSNorm, QKV GEMV,
 * rotary + KV store, paged attention, o GEMV, residual add + RMSNorm, gate/up GEMV + SiLU, down GEMV.
 * qkv_bias (0: none): Qwen2's, added to the QKV GEMV's output as QuantLinear adds it.
 * q_norm / k_norm (0: none): Qwen3's per-head RMSNorm before rotary, which the modules compute with
 * PyTorch's rms_norm (the same formula, its own summation order).
 * residual 0: the first layer (x is the embedding, which becomes the residual). out [M, H] is the MLP
 * output and residual_out [M, H] the residual stream, as DecoderLayer.forward returns them. */
static PyObject *decode_layer(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    int64_t v[57];
    double f[57];
    if (parse(args, nargs, 57, "decode_layer", v, f, 1ull << 52 | 1ull << 53 | 1ull << 54 | 1ull << 55) < 0)
        return NULL;
    const float *qkv_bias = PTR(v[56]);
    const float *x = PTR(v[0]), *res = PTR(v[1]), *in_w = PTR(v[2]), *post_w = PTR(v[3]);
    const weight_ref wqkv = weight_at(v + 4), wo = weight_at(v + 10), wgu = weight_at(v + 16), wd = weight_at(v + 22);
    const int64_t *pos = PTR(v[28]), *slots = PTR(v[35]);
    const float *cos = PTR(v[29]), *sin = PTR(v[30]);
    float *kc = PTR(v[32]), *vc = PTR(v[33]), *out = PTR(v[48]), *res_out = PTR(v[49]);
    const int64_t M = v[41], H = v[42], Hq = v[43], Hk = v[44], D = v[45], I = v[46];
    const int threads = (int)v[47];
    const float eps = (float)f[52], qk_eps = (float)f[55];
    const int64_t width = (Hq + 2 * Hk) * D;
    const int any_bf16 = wqkv.bits == 16 || wo.bits == 16 || wgu.bits == 16 || wd.bits == 16;
    if (!bf16_built(any_bf16 ? 16 : 0, "decode_layer")) return NULL;
    attn_args at = {NULL, kc, vc, PTR(v[36]), PTR(v[38]), NULL, NULL, width, v[37], Hq, Hk, D, v[39], v[40],
                    (float)f[53], (float)f[54]};
    if (!attention_fits(&at)) {
        PyErr_SetString(PyExc_ValueError, "decode_layer: group, head dim or block size too large");
        return NULL;
    }
    if (check_positions("decode_layer", pos, slots, M, v[31], v[34]) < 0) return NULL;
    /* scratch: normed x, qkv, attention output, o output, normed h, gate/up output, SiLU output */
    const int64_t sizes[7] = {M * H, M * width, M * Hq * D, M * H, M * H, M * 2 * I, M * I};
    int64_t total = 0;
    for (int i = 0; i < 7; i++) total += sizes[i];
    float *scratch = malloc(sizeof(float) * (size_t)total), *buf[7];
    if (!scratch) return PyErr_NoMemory();
    buf[0] = scratch;
    for (int i = 1; i < 7; i++) buf[i] = buf[i - 1] + sizes[i - 1];
    int status = 0;
    Py_BEGIN_ALLOW_THREADS
    if (res) {
        norm_rows(x, res, in_w, buf[0], res_out, M, H, eps, threads);
    } else {
        memcpy(res_out, x, sizeof(float) * (size_t)(M * H));
        norm_rows(x, NULL, in_w, buf[0], NULL, M, H, eps, threads);
    }
    gemv_args a = gemv_of(&wqkv, buf[0], buf[1], M, H, width);
    status |= gemv(&a, wqkv.bits, threads);
    if (qkv_bias)
        for (int64_t i = 0; i < M * width; i++) buf[1][i] += qkv_bias[i % width];
    rotate_store_rows(buf[1], width, pos, cos, sin, kc, vc, slots, M, Hq, Hk, D, PTR(v[50]), PTR(v[51]), qk_eps,
                      threads);
    at.q = buf[1];
    at.out = buf[2];
    attend(&at, M, threads);
    a = gemv_of(&wo, buf[2], buf[3], M, Hq * D, H);
    status |= gemv(&a, wo.bits, threads);
    norm_rows(buf[3], res_out, post_w, buf[4], res_out, M, H, eps, threads);
    a = gemv_of(&wgu, buf[4], buf[5], M, H, 2 * I);
    status |= gemv_silu(&a, buf[6], wgu.bits, threads);
    a = gemv_of(&wd, buf[6], out, M, I, H);
    status |= gemv(&a, wd.bits, threads);
    Py_END_ALLOW_THREADS
    free(scratch);
    if (status < 0) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

/* ==== end of the fused decode-layer ops ==== */

static PyObject *simd(PyObject *self, PyObject *unused) {
#ifdef __AVX512F__
    return PyUnicode_FromString("avx512");
#else
    return PyUnicode_FromString("scalar");
#endif
}

static PyMethodDef methods[] = {
    {"gemv_q4", (PyCFunction)(void (*)(void))gemv_q4, METH_FASTCALL, "y = x @ W^T, int4 codes"},
    {"gemv_q8", (PyCFunction)(void (*)(void))gemv_q8, METH_FASTCALL, "y = x @ W^T, int8 codes"},
    {"dequantize_q4_f32", (PyCFunction)(void (*)(void))dequantize_q4_f32, METH_FASTCALL, "int4 -> float32 [N, K]"},
    {"dequantize_q4_bf16", (PyCFunction)(void (*)(void))dequantize_q4_bf16, METH_FASTCALL, "int4 -> bf16 [N, K]"},
    {"gemv_q4_bf16", (PyCFunction)(void (*)(void))gemv_q4_bf16, METH_FASTCALL, "y = x @ W^T, int4, bf16 arithmetic"},
    {"has_bf16", has_bf16, METH_NOARGS, "whether the bf16 variants were compiled (AVX512_BF16)"},
    {"dequantize_q8_f32", (PyCFunction)(void (*)(void))dequantize_q8_f32, METH_FASTCALL, "int8 -> float32 [N, K]"},
    {"paged_decode_attention", (PyCFunction)(void (*)(void))paged_decode_attention, METH_FASTCALL,
     "one-token queries against a paged KV cache"},
    {"decode_layer", (PyCFunction)(void (*)(void))decode_layer, METH_FASTCALL,
     "a Llama decoder layer for one-token sequences, in one call"},
    {"simd", simd, METH_NOARGS, "which code path was compiled: 'avx512' or 'scalar'"},
    {"add_rms_norm", (PyCFunction)(void (*)(void))add_rms_norm, METH_FASTCALL, "residual add + RMSNorm"},
    {"rotary_store", (PyCFunction)(void (*)(void))rotary_store, METH_FASTCALL,
     "rotary on q and k in place, then k and v into their cache slots"},
    {"gemv_silu_q4", (PyCFunction)(void (*)(void))gemv_silu_q4, METH_FASTCALL, "silu(x @ G^T) * (x @ U^T), int4"},
    {"gemv_silu_q8", (PyCFunction)(void (*)(void))gemv_silu_q8, METH_FASTCALL, "silu(x @ G^T) * (x @ U^T), int8"},
    {"gemv_silu_q4_bf16", (PyCFunction)(void (*)(void))gemv_silu_q4_bf16, METH_FASTCALL,
     "silu(x @ G^T) * (x @ U^T), int4, bf16 arithmetic"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_ember_cpu_kernels", NULL, -1, methods};

PyMODINIT_FUNC PyInit__ember_cpu_kernels(void) { return PyModule_Create(&module); }
