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
                PREFETCH(p);
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
                PREFETCH(p);
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

#ifdef __AVX512BF16__
/* The parameters p (a->scales or a->zeros) of groups g0 .. g0 + 16 of row n as floats (lanes past the row's G
 * groups 0), each the value param gives: the bf16 GEMVs convert a row's parameters 16 groups at a time and
 * pick a block's with one permute, where param's scalar loads, conversions and broadcasts a group and row
 * made the two-level Q6_K GEMV 30% and the Q5_0 one 10% slower (gate_up, 896 x 4864 down, from DRAM) */
static inline __attribute__((always_inline)) __m512 param_chunk(const gemv_args *a, const void *p, int64_t n, int64_t G,
                                                                int64_t g0) {
    const int64_t i = n * G + g0;
    const __mmask16 m = tail_mask(G - g0);
    if (a->half == 1) return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, (const uint16_t *)p + i));
    if (a->half == 0) return _mm512_maskz_loadu_ps(m, (const float *)p + i);
    /* two-level (param): lanes 0-7 share one base, 8-15 one (the chunk starts a super-block: g0 a multiple of
     * 16, G of 256 / group) */
    const int64_t count = a->N * G, shift = a->group == 16 ? 4 : 3;
    const uint16_t *base = (const uint16_t *)((const uint8_t *)p + count + (count & 1));
    const float lo = half_to_float(base[i >> shift]), hi = G - g0 > 8 ? half_to_float(base[(i + 8) >> shift]) : lo;
    const __m512 codes = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m, (const int8_t *)p + i)));
    return _mm512_mul_ps(_mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(lo), _mm512_set1_ps(hi)), codes);
}

/* The 16 bytes of a run at p as 32 words: words 0-15 the bytes (low nibble, high one above it), 16-31 the
 * bytes shifted down 4 (the high nibbles): inputs j and j + 16 of the run in word j and j + 16 */
static inline __attribute__((always_inline)) __m512i run_nibble_words(const uint8_t *p) {
    const __m512i n = _mm512_cvtepu8_epi16(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)p)));
    return _mm512_srlv_epi16(n, _mm512_mask_set1_epi16(_mm512_setzero_si512(), 0xFFFF0000u, 4));
}

/* 0, 1, .., 15 */
static inline __m512 lane_iota(void) { return _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0); }

/* The 32 weights of the int4 run at p in bf16 through `table`, a group's 16 weights q * scale + zero (one
 * float32 FMA each, rounded to bf16) in words 0-15 and again in 16-31: VPERMW reads an index's low 5 bits,
 * so a low nibble's byte needs no mask. 3 instructions a run and 2 a group where converting each weight
 * took 8 a run: a Q4_K 896 x 4864 GEMV of one row from cache 0.225 -> 0.213 ms (2026-12-07). */
static inline __attribute__((always_inline)) __m512bh q4bf_run(const uint8_t *p, __m512i table) {
    return (__m512bh)_mm512_permutexvar_epi16(run_nibble_words(p), table);
}

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
    const __m512 iota = lane_iota();
    __m512 scales[NR], zeros[NR]; /* groups g - g % 16 .. + 16 of each row (param_chunk) */
    for (int64_t g = 0; g < G; g++) {
        if (g % 16 == 0)
            UNROLL
            for (int r = 0; r < nr; r++) {
                scales[r] = param_chunk(a, a->scales, n0 + r, G, g);
                zeros[r] = a->zeros ? param_chunk(a, a->zeros, n0 + r, G, g) : _mm512_setzero_ps();
            }
        const __m512i lane = _mm512_set1_epi32((int)(g % 16));
        __m512 s[NR], z[NR];
        UNROLL
        for (int r = 0; r < nr; r++) {
            s[r] = _mm512_permutexvar_ps(lane, scales[r]);
            z[r] = _mm512_permutexvar_ps(lane, zeros[r]);
        }
        __m512i table[NR]; /* the group's 16 weights in bf16, twice (q4bf_run) */
        UNROLL
        for (int r = 0; r < nr; r++) {
            const __m512 w16 = _mm512_fmadd_ps(iota, s[r], z[r]);
            table[r] = (__m512i)_mm512_cvtne2ps_pbh(w16, w16);
        }
        const int64_t end = (g + 1) * a->group < K ? (g + 1) * a->group : K;
        for (int64_t k = g * a->group; k < end; k += 32) {
            __m512bh w[NR];
            UNROLL
            for (int r = 0; r < nr; r++) {
                const uint8_t *p = (const uint8_t *)a->codes + (n0 + r) * (K / 2) + k / 2;
                PREFETCH(p);
                w[r] = q4bf_run(p, table[r]); /* lanes 0-15: inputs k..k+15, 16-31: k+16..k+31 */
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
            _mm512_storeu_ps(out + i, bf16_widen16((__m256i)h));
    }
    for (; i < n; i++) {
        uint16_t h = bf16_round(in[i]);
        if (halves)
            halves[i] = h;
        else
            out[i] = bf16_value(h);
    }
}
/* bf16 values of u - 16 for u = 0..31: VPERMW turns an int5 index (code + 16) into its code in bf16 */
static inline __m512i q5_bf16_table(void) {
    const __m512 iota = lane_iota();
    return (__m512i)_mm512_cvtne2ps_pbh(iota, _mm512_sub_ps(iota, _mm512_set1_ps(16.f)));
}

/* The int5 runs at p and p + Q5_RUN_BYTES (inputs k .. k + 64) as bf16 codes in the order bf16_blocks
 * lays x out: v0 = inputs 0-15 of each run (the low nibbles), v1 = inputs 16-31 (the high ones). In 16-bit
 * lanes and through a table, 9 instructions for 64 codes where q5_run's float32 took 18 with its FMAs. */
static inline __attribute__((always_inline)) void q5_pair_bf16(const uint8_t *p, __m512i table, __m512bh *v0,
                                                               __m512bh *v1) {
    uint32_t a, b;
    memcpy(&a, p, 4);
    memcpy(&b, p + Q5_RUN_BYTES, 4);
    const __m256i bytes = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(p + 4))),
                                                  _mm_loadu_si128((const __m128i *)(p + Q5_RUN_BYTES + 4)), 1);
    const __m512i n = _mm512_cvtepu8_epi16(bytes), top = _mm512_set1_epi16(16);
    const __m512i lo = _mm512_and_si512(n, _mm512_set1_epi16(0x0F)), hi = _mm512_srli_epi16(n, 4);
    const __mmask32 m0 = (a & 0xFFFF) | b << 16, m1 = a >> 16 | (b & 0xFFFF0000u);
    *v0 = (__m512bh)_mm512_permutexvar_epi16(_mm512_mask_add_epi16(lo, m0, lo, top), table);
    *v1 = (__m512bh)_mm512_permutexvar_epi16(_mm512_mask_add_epi16(hi, m1, hi, top), table);
}

/* One int5 run (inputs k .. k + 32, a row's last when K is an odd number of runs) in natural order */
static inline __attribute__((always_inline)) __m512bh q5_run_bf16(const uint8_t *p, __m512i table) {
    uint32_t bits;
    memcpy(&bits, p, 4);
    const __m512i c = _mm512_and_si512(run_nibble_words(p + 4), _mm512_set1_epi16(0x0F));
    return (__m512bh)_mm512_permutexvar_epi16(_mm512_mask_add_epi16(c, bits, c, _mm512_set1_epi16(16)), table);
}

/* 16 int8 codes as floats (exact) */
static inline __attribute__((always_inline)) __m512 q8_floats(const int8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}

/* 64 int8 codes as bf16 in bf16_blocks' order (v0: inputs 0-15 and 32-47, v1: 16-31 and 48-63) */
static inline __attribute__((always_inline)) void q8_pair_bf16(const int8_t *p, __m512bh *v0, __m512bh *v1) {
    *v0 = _mm512_cvtne2ps_pbh(q8_floats(p + 32), q8_floats(p));
    *v1 = _mm512_cvtne2ps_pbh(q8_floats(p + 48), q8_floats(p + 16));
}

/* [scale i] in lanes 0-7, [scale j] in lanes 8-15: a VDPBF16PS sum's lanes 0-7 hold the products of the
 * first 16 of its 32 inputs, 8-15 those of the last 16. Float16 scales side by side (Q5_0's, Q8_0's) take
 * one load and one conversion: two scalar ones made a 4864 x 896 int5 GEMV of one row 12% slower. */
static inline __attribute__((always_inline)) __m512 two_scales(const gemv_args *a, int64_t i, int64_t j) {
    if (a->half == 1 && j == i + 1) {
        int32_t pair;
        memcpy(&pair, (const uint16_t *)a->scales + i, 4);
        const __m512i lanes = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
        return _mm512_permutexvar_ps(lanes, _mm512_castps128_ps512(_mm_cvtph_ps(_mm_cvtsi32_si128(pair))));
    }
    return _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(scale_at(a, i)), _mm512_set1_ps(scale_at(a, j)));
}

/* g[j]: the group of input k + 16 j, advanced from its value at an earlier k (no division in the loop) */
static inline __attribute__((always_inline)) void advance_groups(int64_t *g, int64_t k, int64_t group, int n) {
    for (int j = 0; j < n; j++)
        while (k + 16 * j >= (g[j] + 1) * group) g[j]++;
}

/* int5 (five 1) and int8 (five 0, no zeros) in bf16 arithmetic: the codes, exact in bf16, times x rounded
 * to bf16 (VDPBF16PS: 32 products a instruction, exact in float32, float32 sums), each group's sums times
 * its scale. A 64-input block is two VDPBF16PS whose 16 lanes each sum one group's inputs: with groups of
 * 32 (Q5_0, Q8_0) one FMA applies both groups' scales to the two, where float32 took four FMAs for the
 * products and two (int5) or four (int8) for the scales. `shared` (groups a multiple of 32): the block's
 * two vectors cover the same two groups; else (Q6_K's 16) each takes its own scales. `chunked` (the group
 * size, 32 shared or 16 not, else 0): each row's scales converted 16 groups at a time (param_chunk), a
 * block's picked by one permute, where two_scales took a load, a move, a conversion and a permute a block
 * and row. */
static inline __attribute__((always_inline)) void q58bf_body(const gemv_args *a, int64_t n0, int nr, int64_t m0,
                                                             int mt, int five, int shared, int chunked) {
    const int64_t K = a->K, G = groups(K, a->group), whole = K & ~(int64_t)63;
    const int64_t row_bytes = five ? K / 32 * Q5_RUN_BYTES : K;
    const __m512i table = q5_bf16_table();
    __m512 acc[NR][MT];
    int64_t g[4] = {0, 0, 0, 0}; /* the groups of inputs k, k + 16, k + 32, k + 48 */
    UNROLL
    for (int r = 0; r < nr; r++)
        UNROLL
        for (int m = 0; m < mt; m++) acc[r][m] = _mm512_setzero_ps();
    __m512 chunk[NR];
    /* a block's two groups' lanes in a chunk (lanes 0-7: the group of input k, 8-15: of k + 32) */
    const __m512i pick = _mm512_set_epi32(2, 2, 2, 2, 2, 2, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0);
    for (int64_t k = 0; k < whole; k += 64) {
        const int64_t j = chunked ? k % (16 * chunked) / chunked : 0; /* group of input k within its chunk */
        if (chunked && j == 0)
            UNROLL
            for (int r = 0; r < nr; r++) chunk[r] = param_chunk(a, a->scales, n0 + r, G, k / chunked);
        if (!chunked) advance_groups(g, k, a->group, 4);
        const __m512i lanes = _mm512_add_epi32(chunked == 32 ? _mm512_srli_epi32(pick, 1) : pick, _mm512_set1_epi32((int)j));
        __m512bh w0[NR], w1[NR];
        __m512 s0[NR], s1[NR];
        UNROLL
        for (int r = 0; r < nr; r++) {
            const uint8_t *p = (const uint8_t *)a->codes + (n0 + r) * row_bytes + (five ? k / 32 * Q5_RUN_BYTES : k);
            PREFETCH(p);
            if (five)
                q5_pair_bf16(p, table, &w0[r], &w1[r]);
            else
                q8_pair_bf16((const int8_t *)p, &w0[r], &w1[r]);
            if (chunked) {
                s0[r] = _mm512_permutexvar_ps(lanes, chunk[r]);
                if (!shared) s1[r] = _mm512_permutexvar_ps(_mm512_add_epi32(lanes, _mm512_set1_epi32(1)), chunk[r]);
            } else {
                s0[r] = two_scales(a, (n0 + r) * G + g[0], (n0 + r) * G + g[2]);
                if (!shared) s1[r] = two_scales(a, (n0 + r) * G + g[1], (n0 + r) * G + g[3]);
            }
        }
        UNROLL
        for (int m = 0; m < mt; m++) {
            const uint16_t *xm = a->xb + (m0 + m) * K + k;
            const __m512bh x0 = (__m512bh)_mm512_loadu_si512((const void *)xm);
            const __m512bh x1 = (__m512bh)_mm512_loadu_si512((const void *)(xm + 32));
            UNROLL
            for (int r = 0; r < nr; r++) {
                const __m512 d0 = _mm512_dpbf16_ps(_mm512_setzero_ps(), w0[r], x0);
                if (shared) {
                    acc[r][m] = _mm512_fmadd_ps(_mm512_dpbf16_ps(d0, w1[r], x1), s0[r], acc[r][m]);
                } else {
                    acc[r][m] = _mm512_fmadd_ps(d0, s0[r], acc[r][m]);
                    acc[r][m] = _mm512_fmadd_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), w1[r], x1), s1[r], acc[r][m]);
                }
            }
        }
    }
    if (whole < K) { /* one run of 32 left, in natural order */
        advance_groups(g, whole, a->group, 2); /* from 0 where chunked: K / 64 steps at most, once a call */
        UNROLL
        for (int r = 0; r < nr; r++) {
            const uint8_t *p = (const uint8_t *)a->codes + (n0 + r) * row_bytes + (five ? whole / 32 * Q5_RUN_BYTES : whole);
            const __m512bh w = five ? q5_run_bf16(p, table)
                                    : _mm512_cvtne2ps_pbh(q8_floats((const int8_t *)p + 16), q8_floats((const int8_t *)p));
            const __m512 s = two_scales(a, (n0 + r) * G + g[0], (n0 + r) * G + g[1]);
            UNROLL
            for (int m = 0; m < mt; m++) {
                const __m512bh xv = (__m512bh)_mm512_loadu_si512((const void *)(a->xb + (m0 + m) * K + whole));
                acc[r][m] = _mm512_fmadd_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), w, xv), s, acc[r][m]);
            }
        }
    }
    UNROLL
    for (int r = 0; r < nr; r++)
        UNROLL
        for (int m = 0; m < mt; m++)
            a->y[(m0 + m) * a->N + n0 + r] = _mm512_reduce_add_ps(acc[r][m]);
}

/* x [M, K] in bf16 for q58bf_body: in each 64-input block, inputs 32-47 before 16-31 (so a VDPBF16PS's
 * first 16 lanes meet inputs 0-15 and 32-47 of the codes, which q5_pair_bf16 decodes side by side), a
 * last run of 32 in order */
static void bf16_blocks(const float *x, uint16_t *xb, int64_t M, int64_t K) {
    static const int order[4] = {0, 2, 1, 3};
    for (int64_t m = 0; m < M; m++) {
        const float *in = x + m * K;
        uint16_t *out = xb + m * K;
        int64_t k = 0;
        for (; k + 64 <= K; k += 64)
            for (int j = 0; j < 4; j++) round_bf16(in + k + 16 * order[j], NULL, out + k + 16 * j, 16);
        round_bf16(in + k, NULL, out + k, K - k);
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

/* `bits` | BF16: the weight in bf16 arithmetic (int4: q4bf_tile; int5, int8: q58bf_body) */
#define BF16 16

/* One function a tile kind (noinline): as the cases of one switch, the 63 bf16 tile instantiations made one
 * 220 KB function whose register dataflow took GCC 12 20 s of the build's 22.7 on 2 cores; apart, the build
 * takes 7.1 s. A call a block of NR rows costs nothing against the block's K * NR weights. */
#define ROWS_FN(name, tile)                                                                             \
    static __attribute__((noinline)) void name(const gemv_args *a, int64_t n0, int64_t nr) {           \
        ROW_BLOCK(tile, a, n0, nr);                                                                     \
    }

ROWS_FN(q4_rows, q4_tile)
ROWS_FN(q5_rows, q5_tile)
ROWS_FN(q8_rows, q8_tile)

#if HAS_BF16
/* q58bf_body's variants, each with its arguments constant: (int5, shared, chunked) */
#define Q58BF_TILE(name, five, shared, chunked)                                                          \
    static inline __attribute__((always_inline)) void name(const gemv_args *a, int64_t n0, int nr, int64_t m0, \
                                                           int mt) {                                     \
        q58bf_body(a, n0, nr, m0, mt, five, shared, chunked);                                            \
    }
Q58BF_TILE(q5bf32_tile, 1, 1, 32) /* int5 groups are whole runs: a multiple of 32 */
Q58BF_TILE(q5bf_tile, 1, 1, 0)
Q58BF_TILE(q8bf32_tile, 0, 1, 32)
Q58BF_TILE(q8bf_shared_tile, 0, 1, 0) /* groups a multiple of 32 */
Q58BF_TILE(q8bf16_tile, 0, 0, 16)
Q58BF_TILE(q8bf_tile, 0, 0, 0)

ROWS_FN(q4bf_rows, q4bf_tile)
ROWS_FN(q5bf32_rows, q5bf32_tile)
ROWS_FN(q5bf_rows, q5bf_tile)
ROWS_FN(q8bf32_rows, q8bf32_tile)
ROWS_FN(q8bf_shared_rows, q8bf_shared_tile)
ROWS_FN(q8bf16_rows, q8bf16_tile)
ROWS_FN(q8bf_rows, q8bf_tile)

static void q5bf_rows_of(const gemv_args *a, int64_t n0, int64_t nr) {
    (a->group == 32 ? q5bf32_rows : q5bf_rows)(a, n0, nr);
}

static void q8bf_rows_of(const gemv_args *a, int64_t n0, int64_t nr) {
    if (a->group == 32)
        q8bf32_rows(a, n0, nr);
    else if (a->group % 32 == 0)
        q8bf_shared_rows(a, n0, nr);
    else if (a->group == 16)
        q8bf16_rows(a, n0, nr);
    else
        q8bf_rows(a, n0, nr);
}
#endif

/* Bytes of activations (x, or its bf16 copy) a window of rows holds: a thread sweeps its output rows over one
 * window, then the next, so the window stays in its core's L2 (1 MB on Zen 4) while the weight rows stream
 * past. Sweeping all rows at each block of NR weight rows read the activations from L3 once a block: 32
 * prompts of 128 tokens at once (2,048 rows) prefilled at 220 tok/s where one prompt of 128 ran 290-310
 * (the synthetic Qwen2-0.5B Q4_K_M, 2 Zen 4 cores, 2026-12-07). */
#ifndef WINDOW_BYTES
#define WINDOW_BYTES (128 * 1024)
#endif

/* Blocks b0 .. b1 of NR output rows: what one thread of `gemv`'s region computes (bf16 arithmetic: a->xb
 * made), a window of activation rows at a time. Each output's sum is the same in any window. */
static void gemv_blocks(const gemv_args *a, int bits, int64_t b0, int64_t b1) {
    const int64_t row_bytes = a->K * (int64_t)((bits & BF16) ? sizeof(uint16_t) : sizeof(float));
    int64_t rows = WINDOW_BYTES / row_bytes / MT * MT;
    rows = rows < MT ? MT : rows;
    for (int64_t m0 = 0; m0 < a->M; m0 += rows) {
        gemv_args w = *a;
        w.M = a->M - m0 < rows ? a->M - m0 : rows;
        w.x = a->x + m0 * a->K;
        w.xb = a->xb ? a->xb + m0 * a->K : NULL;
        w.y = a->y + m0 * a->N;
        for (int64_t b = b0; b < b1; b++) {
            const int64_t nr = a->N - b * NR < NR ? a->N - b * NR : NR;
            switch (bits) {
            case 4: q4_rows(&w, b * NR, nr); break;
            case 5: q5_rows(&w, b * NR, nr); break;
            case 8: q8_rows(&w, b * NR, nr); break;
#if HAS_BF16
            case BF16 | 4: q4bf_rows(&w, b * NR, nr); break;
            case BF16 | 5: q5bf_rows_of(&w, b * NR, nr); break;
            case BF16 | 8: q8bf_rows_of(&w, b * NR, nr); break;
#endif
            }
        }
    }
}

/* The blocks [*b0, *b1) of `blocks` that thread t of `threads` takes: contiguous runs, the first
 * blocks % threads threads one block more (as OpenMP's static schedule splits them) */
static void thread_blocks(int64_t blocks, int t, int threads, int64_t *b0, int64_t *b1) {
    const int64_t q = blocks / threads, extra = blocks % threads;
    *b0 = t * q + (t < extra ? t : extra);
    *b1 = *b0 + q + (t < extra);
}

/* For bf16 arithmetic, a->xb = x rounded to bf16 (int4's in order, int5's and int8's as bf16_blocks lays it
 * out), which the caller frees; -1 when it cannot be allocated */
static int bf16_x(gemv_args *a, int bits) {
#if HAS_BF16
    if (!(bits & BF16)) return 0;
    uint16_t *xb = malloc(sizeof(uint16_t) * (size_t)(a->M * a->K));
    if (!xb) return -1;
    if (bits == (BF16 | 4))
        round_bf16(a->x, NULL, xb, a->M * a->K);
    else
        bf16_blocks(a->x, xb, a->M, a->K);
    a->xb = xb;
#endif
    return 0;
}

/* int4 in bf16 arithmetic rounds its n outputs at y to bf16, as oneDNN's bf16 GEMM over its expansion
 * does; int5 and int8 keep float32 outputs (their expansion is float32: see ops.dequantize) */
static void round_outputs(int bits, float *y, int64_t n) {
#if HAS_BF16
    if (bits == (BF16 | 4)) round_bf16(y, y, NULL, n);
#endif
}

/* bits 4 / 5 / 8: int4 / int5 / int8 codes, float32 arithmetic; | BF16: bf16 arithmetic, x rounded to bf16
 * here first. Returns -1 when the bf16 copy of x cannot be allocated. */
static int gemv(gemv_args *a, int bits, int threads) {
    const int64_t blocks = (a->N + NR - 1) / NR;
    if (a->M * a->N * a->K < PARALLEL_MIN_WORK) threads = 1;
    if (bf16_x(a, bits) < 0) return -1;
#pragma omp parallel num_threads(threads)
    {
        int64_t b0, b1;
        thread_blocks(blocks, omp_get_thread_num(), omp_get_num_threads(), &b0, &b1);
        gemv_blocks(a, bits, b0, b1);
    }
    free((void *)a->xb);
    a->xb = NULL;
    round_outputs(bits, a->y, a->M * a->N);
    return 0;
}

/* the bf16 variants exist only where the CPU has AVX512_BF16 (see has_bf16) */
static int bf16_built(int bits, const char *name) {
    if ((bits & BF16) && !HAS_BF16) {
        PyErr_Format(PyExc_RuntimeError, "%s: built without AVX512_BF16", name);
        return 0;
    }
    return 1;
}

/* Whether the tiles cover a weight (`bits` as gemv_blocks takes it) of K inputs in groups of `group`, its
 * parameters in form `half` (param), as ops.fits and bf16_fits promise: K and the group whole vector steps
 * (int4 and int5 runs of 32, int8 steps of 16, int8 in bf16 arithmetic K in runs of 32), the two-level form
 * over whole super-blocks in groups of 16 or 32. Else ValueError: the AVX-512 tiles step a run at a time
 * within a group, so int4 groups of 16 (GGUF Q2_K's, which fits refuses) read 32 codes and inputs a group,
 * the last past x's row: outputs of 1e14 and more that changed from call to call. (The plain-C tiles
 * compute any group; one rule for both builds.) */
static int layout_fits(int bits, int64_t K, int64_t group, int half, const char *name) {
    const int kind = bits & ~BF16, step = kind == 8 ? 16 : 32, k_step = kind == 8 && !(bits & BF16) ? 16 : 32;
    int ok = (kind == 4 || kind == 5 || kind == 8) && K >= 0 && group > 0 && group % step == 0 && K % k_step == 0;
    ok = ok && (half == 0 || half == 1 || (half == 2 && K % 256 == 0 && (group == 16 || group == 32)));
    if (!ok)
        PyErr_Format(PyExc_ValueError,
                     "%s: a weight of layout %d in groups of %lld over K=%lld (scales form %d) does not fit the "
                     "kernels (see ops.fits)",
                     name, bits, (long long)group, (long long)K, half);
    return ok;
}

/* gemv_q{4,5,8}(x, codes, scales, zeros, y, M, K, N, group, threads, half): y = x @ W^T; half: the form of
 * the scales and zeros (param: 0 float32, 1 float16, 2 two-level) */
static PyObject *gemv_entry(PyObject *const *args, Py_ssize_t nargs, int bits, const char *name) {
    int64_t v[11];
    if (!bf16_built(bits, name) || parse(args, nargs, 11, name, v, NULL, 0) < 0) return NULL;
    if (!layout_fits(bits, v[6], v[8], (int)v[10], name)) return NULL;
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

/* gemv_q{4,5,8}_bf16: gemv_q{4,5,8} in bf16 arithmetic (q4bf_tile, q58bf_body), x float32 */
static PyObject *gemv_q4_bf16(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    return gemv_entry(args, nargs, BF16 | 4, "gemv_q4_bf16");
}

static PyObject *gemv_q5_bf16(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    return gemv_entry(args, nargs, BF16 | 5, "gemv_q5_bf16");
}

static PyObject *gemv_q8_bf16(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    return gemv_entry(args, nargs, BF16 | 8, "gemv_q8_bf16");
}

static PyObject *has_bf16(PyObject *self, PyObject *unused) { return PyBool_FromLong(HAS_BF16); }
