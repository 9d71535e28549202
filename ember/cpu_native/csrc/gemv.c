/* Weight-only int4/int8 GEMV over float32 activations, int4 also in bf16 arithmetic (part of kernels.c's one translation unit: see there) */

#include "kernels.h"

typedef struct {
    const float *x;      /* [M, K] */
    const void *codes;
    const void *scales;  /* [N, G], G = ceil(K / group): float32, float16 or two-level (`half` 0, 1, 2: see param) */
    const void *zeros;   /* [N, G] like scales, or NULL */
    float *y;            /* [M, N] */
    int64_t M, K, N, group;
    int half;
    const uint16_t *xb;  /* bits 16: x rounded to bf16 [M, K], made by `gemv` */
} gemv_args;

/* two-level parameters: K a multiple of 256, so G = K / group without a division's rounding */
static inline float scale_at(const gemv_args *a, int64_t i) {
    return param(a->scales, i, a->half, a->half == 2 ? a->N * (a->K / a->group) : 0, a->group);
}

static inline float zero_at(const gemv_args *a, int64_t i) {
    return param(a->zeros, i, a->half, a->half == 2 ? a->N * (a->K / a->group) : 0, a->group);
}

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
        s[r] = _mm512_set1_ps(scale_at(a, (n0 + r) * G + g));
        z[r] = a->zeros ? _mm512_set1_ps(zero_at(a, (n0 + r) * G + g)) : _mm512_setzero_ps();
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

/* The 32 weights of the int5 run at p (see Q5_RUN_BYTES), (c + 16) * scale - 16 * scale in one FMA each:
 * exactly c * scale, as c * scale needs at most 16 of float32's 24 bits. */
static inline __attribute__((always_inline)) void q5_run(const uint8_t *p, __m512 s, __m512 z, __m512 *lo,
                                                         __m512 *hi) {
    uint32_t bits;
    memcpy(&bits, p, 4);
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p + 4))), top = _mm512_set1_epi32(16);
    const __m512i l = _mm512_and_si512(b, _mm512_set1_epi32(0x0F)), h = _mm512_srli_epi32(b, 4);
    *lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_mask_or_epi32(l, (__mmask16)bits, l, top)), s, z);
    *hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_mask_or_epi32(h, (__mmask16)(bits >> 16), h, top)), s, z);
}

/* int4 runs (five 0) or int5 runs (five 1, whose zero term is -16 * scale), both in float32 */
static inline __attribute__((always_inline)) void q45_tile(const gemv_args *a, int64_t n0, int nr, int64_t m0,
                                                            int mt, int five) {
    const int64_t K = a->K, G = groups(a->K, a->group), row_bytes = five ? K / 32 * Q5_RUN_BYTES : K / 2;
    __m512 acc[NR][MT];
    UNROLL
    for (int r = 0; r < nr; r++)
        UNROLL
        for (int m = 0; m < mt; m++) acc[r][m] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        __m512 s[NR], z[NR];
        group_params(a, n0, nr, G, g, s, z);
        if (five)
            UNROLL
            for (int r = 0; r < nr; r++) z[r] = _mm512_mul_ps(s[r], _mm512_set1_ps(-16.f));
        const int64_t end = (g + 1) * a->group < K ? (g + 1) * a->group : K;
        for (int64_t k = g * a->group; k < end; k += 32) {
            __m512 wl[NR], wh[NR];
            UNROLL
            for (int r = 0; r < nr; r++) {
                const uint8_t *p = (const uint8_t *)a->codes + (n0 + r) * row_bytes + (five ? k / 32 * Q5_RUN_BYTES : k / 2);
                _mm_prefetch((const char *)p + PREFETCH_BYTES, _MM_HINT_T0);
                if (five)
                    q5_run(p, s[r], z[r], &wl[r], &wh[r]);
                else
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

static inline __attribute__((always_inline)) void q4_tile(const gemv_args *a, int64_t n0, int nr, int64_t m0,
                                                           int mt) {
    q45_tile(a, n0, nr, m0, mt, 0);
}

static inline __attribute__((always_inline)) void q5_tile(const gemv_args *a, int64_t n0, int nr, int64_t m0,
                                                           int mt) {
    q45_tile(a, n0, nr, m0, mt, 1);
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
    float w = (float)q4_code(run, k % 32) * scale_at(a, n * G + k / a->group);
    return a->zeros ? w + zero_at(a, n * G + k / a->group) : w;
}

/* int5: code | fifth bit << 4, less 16, times the scale (no zeros) */
static inline float q5_weight(const gemv_args *a, int64_t n, int64_t k) {
    const int64_t G = groups(a->K, a->group);
    const uint8_t *run = (const uint8_t *)a->codes + n * (a->K / 32 * Q5_RUN_BYTES) + (k / 32) * Q5_RUN_BYTES;
    const int code = q4_code(run + 4, k % 32) | (run[k % 32 / 8] >> (k % 8) & 1) << 4;
    return (float)(code - 16) * scale_at(a, n * G + k / a->group);
}

static inline float q8_weight(const gemv_args *a, int64_t n, int64_t k) {
    const int64_t G = groups(a->K, a->group);
    float w = (float)((const int8_t *)a->codes)[n * a->K + k] * scale_at(a, n * G + k / a->group);
    return a->zeros ? w + zero_at(a, n * G + k / a->group) : w;
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
SCALAR_TILE(q5_tile, q5_weight)
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

/* Blocks b0 .. b1 of NR output rows: what one thread of `gemv`'s loop computes (for bits 16, a->xb made) */
static void gemv_blocks(const gemv_args *a, int bits, int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; b++) {
        const int64_t nr = a->N - b * NR < NR ? a->N - b * NR : NR;
        if (bits == 4)
            ROW_BLOCK(q4_tile, a, b * NR, nr);
        else if (bits == 5)
            ROW_BLOCK(q5_tile, a, b * NR, nr);
        else if (bits == 8)
            ROW_BLOCK(q8_tile, a, b * NR, nr);
#if HAS_BF16
        else
            ROW_BLOCK(q4bf_tile, a, b * NR, nr);
#endif
    }
}

/* bits 4 / 5 / 8: int4 / int5 / int8 codes, float32 arithmetic; 16: int4 codes, bf16 arithmetic (q4bf_tile), x
 * rounded to bf16 here first. Returns -1 when the bf16 copy of x cannot be allocated. */
static int gemv(gemv_args *a, int bits, int threads) {
    const int64_t blocks = (a->N + NR - 1) / NR;
    if (a->M * a->N * a->K < PARALLEL_MIN_WORK) threads = 1;
    int64_t b;
    if (bits == 4) {
#pragma omp parallel for num_threads(threads) schedule(static)
        for (b = 0; b < blocks; b++) ROW_BLOCK(q4_tile, a, b * NR, a->N - b * NR < NR ? a->N - b * NR : NR);
    } else if (bits == 5) {
#pragma omp parallel for num_threads(threads) schedule(static)
        for (b = 0; b < blocks; b++) ROW_BLOCK(q5_tile, a, b * NR, a->N - b * NR < NR ? a->N - b * NR : NR);
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

/* the bf16 variants (bits 16) exist only where the CPU has AVX512_BF16 (see has_bf16) */
static int bf16_built(int bits, const char *name) {
    if (bits == 16 && !HAS_BF16) {
        PyErr_Format(PyExc_RuntimeError, "%s: built without AVX512_BF16", name);
        return 0;
    }
    return 1;
}

/* gemv_q{4,5,8}(x, codes, scales, zeros, y, M, K, N, group, threads, half): y = x @ W^T; half: the form of
 * the scales and zeros (param: 0 float32, 1 float16, 2 two-level) */
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

static PyObject *gemv_q5(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    return gemv_entry(args, nargs, 5, "gemv_q5");
}

static PyObject *gemv_q8(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    return gemv_entry(args, nargs, 8, "gemv_q8");
}

/* gemv_q4_bf16: gemv_q4 in bf16 arithmetic (q4bf_tile), x float32 */
static PyObject *gemv_q4_bf16(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    return gemv_entry(args, nargs, 16, "gemv_q4_bf16");
}

static PyObject *has_bf16(PyObject *self, PyObject *unused) { return PyBool_FromLong(HAS_BF16); }
