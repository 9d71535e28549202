/* Paged decode attention read straight from the KV cache (part of kernels.c's one translation unit: see there) */

#include "kernels.h"

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
