/* Dense expansions of the int4/int8 layouts for large batches (part of kernels.c's one translation unit: see there) */

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
