/* Dense expansions of the int4/int5/int8 layouts for large batches, and the int5 packing (part of kernels.c's one translation unit: see there) */

#include "kernels.h"

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

static inline void q5_expand_run(const uint8_t *p, float s, float *o) {
    uint32_t bits;
    memcpy(&bits, p, 4);
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p + 4))), top = _mm512_set1_epi32(16);
    const __m512i l = _mm512_and_si512(b, _mm512_set1_epi32(0x0F)), h = _mm512_srli_epi32(b, 4);
    const __m512 vs = _mm512_set1_ps(s);
    _mm512_storeu_ps(o, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_mask_or_epi32(l, (__mmask16)bits, l, top), top)), vs));
    _mm512_storeu_ps(o + 16, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_mask_or_epi32(h, (__mmask16)(bits >> 16), h, top), top)), vs));
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

static inline void q5_expand_run(const uint8_t *p, float s, float *o) {
    for (int j = 0; j < 32; j++) {
        const uint8_t nibble = j < 16 ? p[4 + j] & 0x0F : p[4 + j - 16] >> 4;
        o[j] = (float)((nibble | (p[j / 8] >> (j % 8) & 1) << 4) - 16) * s;
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

/* Row n of the weight [N, K] expanded into o [K] (bits 4, 5, 8: float32; BF16 | 4: bf16) */
static inline void expand_row(int bits, const void *codes, const void *scales, const void *zeros, int half, int64_t N,
                              int64_t K, int64_t group, int64_t n, void *o) {
    const int64_t G = groups(K, group), run = bits == 8 ? 16 : 32;
    const int has_zero = zeros != NULL;
    for (int64_t k = 0; k < K; k += run) {
        float s = param(scales, n * G + k / group, half, N * G, group);
        float z = has_zero ? param(zeros, n * G + k / group, half, N * G, group) : 0.f;
        if (bits == 4)
            q4_expand_run((const uint8_t *)codes + (n * K + k) / 2, s, z, has_zero, (float *)o + k);
        else if (bits == 5)
            q5_expand_run((const uint8_t *)codes + n * (K / 32 * Q5_RUN_BYTES) + k / 32 * Q5_RUN_BYTES, s, (float *)o + k);
        else if (bits == 8)
            q8_expand_run((const int8_t *)codes + n * K + k, s, z, has_zero, (float *)o + k);
#if HAS_BF16
        else
            q4_expand_run_bf16((const uint8_t *)codes + (n * K + k) / 2, s, z, (uint16_t *)o + k);
#endif
    }
}

/* dequantize_q{4,5,8}_f32(codes, scales, zeros, out, N, K, group, threads, half): out float32 [N, K];
 * dequantize_q4_bf16 (bits BF16 | 4): the same rounded to bf16, for oneDNN's bf16 GEMM */
static PyObject *expand_entry(PyObject *const *args, Py_ssize_t nargs, int bits, const char *name) {
    int64_t v[9];
    if (!bf16_built(bits, name) || parse(args, nargs, 9, name, v, NULL, 0) < 0) return NULL;
    if (!layout_fits(bits, v[5], v[6], (int)v[8], name)) return NULL;
    const int64_t N = v[4], K = v[5], elem = bits == (BF16 | 4) ? 2 : 4;
    Py_BEGIN_ALLOW_THREADS
    int64_t n;
#pragma omp parallel for num_threads((int)v[7]) schedule(static)
    for (n = 0; n < N; n++)
        expand_row(bits, PTR(v[0]), PTR(v[1]), PTR(v[2]), (int)v[8], N, K, v[6], n, (char *)PTR(v[3]) + n * K * elem);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* dequantize_rows(codes, scales, zeros, out, ids, M, N, K, group, half, bits): out float32 [M, K] = rows ids
 * [M] (int64) of the int4/int5/int8 weight [N, K], each exactly as dequantize_q{bits}_f32 expands it: an
 * embedding's lookup in one call, where indexing the codes, scales and zeros and dequantizing the rows in
 * PyTorch took ~10 ops (~0.1 ms of a ~1.2 ms CPU decode step outside the kernels, 2026-12-07) */
static PyObject *dequantize_rows(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    int64_t v[11];
    if (parse(args, nargs, 11, "dequantize_rows", v, NULL, 0) < 0) return NULL;
    const int bits = (int)v[10];
    const int64_t *ids = PTR(v[4]);
    const int64_t M = v[5], N = v[6], K = v[7];
    if (bits != 4 && bits != 5 && bits != 8) {
        PyErr_SetString(PyExc_ValueError, "dequantize_rows: bits 4, 5 or 8");
        return NULL;
    }
    if (!layout_fits(bits, K, v[8], (int)v[9], "dequantize_rows")) return NULL;
    for (int64_t m = 0; m < M; m++) {
        if (ids[m] < 0 || ids[m] >= N) {
            PyErr_Format(PyExc_IndexError, "dequantize_rows: row %lld of %lld", (long long)ids[m], (long long)N);
            return NULL;
        }
    }
    Py_BEGIN_ALLOW_THREADS
    for (int64_t m = 0; m < M; m++)
        expand_row(bits, PTR(v[0]), PTR(v[1]), PTR(v[2]), (int)v[9], N, K, v[8], ids[m], (float *)PTR(v[3]) + m * K);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *dequantize_q4_f32(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    return expand_entry(args, nargs, 4, "dequantize_q4_f32");
}

static PyObject *dequantize_q4_bf16(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    return expand_entry(args, nargs, BF16 | 4, "dequantize_q4_bf16");
}

static PyObject *dequantize_q8_f32(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    return expand_entry(args, nargs, 8, "dequantize_q8_f32");
}

static PyObject *dequantize_q5_f32(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    return expand_entry(args, nargs, 5, "dequantize_q5_f32");
}

/* One row of int8 codes [K] into int5 runs [K / 32 * Q5_RUN_BYTES]; 0 where a code lies outside [-16, 15] */
static int pack_q5_row(const int8_t *c, uint8_t *out, int64_t K) {
    for (int64_t k = 0; k < K; k += 32, out += Q5_RUN_BYTES) {
        uint32_t bits = 0;
        for (int j = 0; j < 32; j++) {
            if (c[k + j] < -16 || c[k + j] > 15) return 0;
            bits |= (uint32_t)((c[k + j] + 16) >> 4) << j;
        }
        memcpy(out, &bits, 4);
        for (int j = 0; j < 16; j++) out[4 + j] = (uint8_t)(((c[k + j] + 16) & 0x0F) | ((c[k + j + 16] + 16) & 0x0F) << 4);
    }
    return 1;
}

/* pack_q5(codes, out, N, K, threads) -> bool: int8 codes [N, K] (K a multiple of 32) as int5 runs, True
 * when every code lies in [-16, 15] (else `out` is partly written and must be dropped) */
static PyObject *pack_q5(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    int64_t v[5];
    if (parse(args, nargs, 5, "pack_q5", v, NULL, 0) < 0) return NULL;
    const int64_t N = v[2], K = v[3];
    int fits = 1;
    Py_BEGIN_ALLOW_THREADS
    int64_t n;
#pragma omp parallel for num_threads((int)v[4]) schedule(static) reduction(&& : fits)
    for (n = 0; n < N; n++)
        fits = fits && pack_q5_row((const int8_t *)PTR(v[0]) + n * K, (uint8_t *)PTR(v[1]) + n * (K / 32 * Q5_RUN_BYTES), K);
    Py_END_ALLOW_THREADS
    return PyBool_FromLong(fits);
}
