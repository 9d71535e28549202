/* The rest of a decode layer fused, and the whole layer in one call (part of kernels.c's one translation unit: see there) */

#include "kernels.h"

/* ==== fused decode-layer ops (float32): residual add + RMSNorm, rotary + KV store, gate/up + SiLU ====
 * What a CPU decode layer runs between its GEMVs, each in one call instead of 3-6 PyTorch ops of
 * ~6-12 us apiece (the data is a few KB: the ops' dispatch, not their arithmetic, was the cost). */

/* Rows of an elementwise op run on the calling thread below this many elements (a decode step's few KB) */
#define ROWS_PARALLEL_MIN (1 << 16)

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

/* out [M, I] = silu(y[:, :I]) * y[:, I:] for y [M, 2I] */
static void silu_rows(const float *y, float *out, int64_t M, int64_t I, int threads) {
    if (M * I < ROWS_PARALLEL_MIN) threads = 1;
    int64_t m;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (m = 0; m < M; m++) silu_mul_row(y + m * 2 * I, out + m * I, I);
}

/* a->y [M, 2I] = x @ [G; U]^T (a->N = 2I), then out [M, I] = silu(gate) * up */
static int gemv_silu(gemv_args *a, float *out, int bits, int threads) {
    if (gemv(a, bits, threads) < 0) return -1;
    silu_rows(a->y, out, a->M, a->N / 2, threads);
    return 0;
}

/* silu_mul(y, out, M, I, threads): out [M, I] = silu(y[:, :I]) * y[:, I:], y float32 [M, 2I] (what
 * gemv_silu applies to its GEMV's output, for a gate/up output the caller has changed: a LoRA delta) */
static PyObject *silu_mul(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    int64_t v[5];
    if (parse(args, nargs, 5, "silu_mul", v, NULL, 0) < 0) return NULL;
    Py_BEGIN_ALLOW_THREADS
    silu_rows(PTR(v[0]), PTR(v[1]), v[2], v[3], (int)v[4]);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* gemv_silu_q{4,5,8}(x, codes, scales, zeros, out, M, K, I, group, threads, half): the fused gate/up GEMV
 * (rows [0, I) gate, [I, 2I) up) into a scratch [M, 2I], then out [M, I] = silu(gate) * up */
static PyObject *gemv_silu_entry(PyObject *const *args, Py_ssize_t nargs, int bits, const char *name) {
    int64_t v[11];
    if (!bf16_built(bits, name) || parse(args, nargs, 11, name, v, NULL, 0) < 0) return NULL;
    if (!layout_fits(bits, v[6], v[8], (int)v[10], name)) return NULL;
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

static PyObject *gemv_silu_q5(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    return gemv_silu_entry(args, nargs, 5, "gemv_silu_q5");
}

static PyObject *gemv_silu_q8(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    return gemv_silu_entry(args, nargs, 8, "gemv_silu_q8");
}

static PyObject *gemv_silu_q4_bf16(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    return gemv_silu_entry(args, nargs, BF16 | 4, "gemv_silu_q4_bf16");
}

static PyObject *gemv_silu_q5_bf16(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    return gemv_silu_entry(args, nargs, BF16 | 5, "gemv_silu_q5_bf16");
}

static PyObject *gemv_silu_q8_bf16(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    return gemv_silu_entry(args, nargs, BF16 | 8, "gemv_silu_q8_bf16");
}

/* ---- a GEMV with its LoRA delta in one parallel region ---- */

/* a->y = x W^T (+ bias [N]), then + the delta of w's adapters for the rows with a slot (w NULL: none), every
 * output as gemv, the bias loop and lora_delta compute it one after the other (the same sums in the same
 * order), in gemv's one parallel region instead of two more: the shrink's units first (tiny: rank x in a
 * slot), the GEMV's blocks split as gemv splits them, each thread's columns rounded (bf16) and biased, then
 * after one barrier (the shrink's output complete) each thread adds the expand of its own columns, still
 * in its cache. A parallel region is a fork and a join, and a barrier that waits for a descheduled thread
 * on a shared machine: lora_delta's own region a projection made a decode layer 4 more. -1: out of memory. */
static int gemv_lora(gemv_args *a, int bits, int threads, const float *bias, const lora_ref *w,
                     const int32_t *slots) {
    lora_plan p = {NULL, NULL, NULL, 0, NULL};
    if (w && lora_plan_make(&p, w, slots, a->M) < 0) return -1;
    if (!p.n_used && !bias) {
        lora_plan_free(&p);
        return gemv(a, bits, threads);
    }
    const int64_t blocks = (a->N + NR - 1) / NR, M = a->M, N = a->N, SR = w ? w->slices * w->rank : 0;
    if (M * N * a->K < PARALLEL_MIN_WORK) threads = 1;
    if (bf16_x(a, bits) < 0) {
        lora_plan_free(&p);
        return -1;
    }
#pragma omp parallel num_threads(threads)
    {
        int64_t u, b0, b1;
#pragma omp for schedule(static) nowait
        for (u = 0; u < p.n_used * SR; u++) lora_shrink_unit(w, &p, a->x, a->K, u);
        /* one contiguous run of blocks a thread, whose columns it then rounds, biases and expands */
        thread_blocks(blocks, omp_get_thread_num(), omp_get_num_threads(), &b0, &b1);
        gemv_blocks(a, bits, b0, b1);
        const int64_t c0 = b0 * NR, c1 = b1 * NR < N ? b1 * NR : N;
        for (int64_t m = 0; c0 < c1 && m < M; m++) {
            float *y = a->y + m * N;
            round_outputs(bits, y + c0, c1 - c0);
            if (bias)
                for (int64_t c = c0; c < c1; c++) y[c] += bias[c];
        }
#pragma omp barrier
        if (p.n_used && c0 < c1) lora_expand_range(w, &p, c0, c1, a->y, N);
    }
    free((void *)a->xb);
    a->xb = NULL;
    lora_plan_free(&p);
    return 0;
}

/* gemv_lora(x, codes, scales, zeros, y, M, K, N, group, threads, half, bits, bias, slots, a, b0, b1, b2, n0, n1,
 *           n2, slices, rank, loras, lora_bf16): y [M, N] = x @ W^T (+ bias float32 [N], 0: none) + each row's LoRA delta
 *           (slots int32 [M], -1: none; a 0: no adapter) in one parallel region (gemv_lora); the weight as
 *           gemv_q{bits} takes it (bits 4, 5, 8, | BF16 for bf16 arithmetic), the slots as lora_delta takes
 *           them, n0 + n1 + n2 = N. The module path's fused projection (LoRALinear), the same numbers as
 *           decode_layers'. */
static PyObject *gemv_lora_entry(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    int64_t v[25];
    if (parse(args, nargs, 25, "gemv_lora", v, NULL, 0) < 0) return NULL;
    const int bits = (int)v[11];
    if ((bits & ~BF16) != 4 && (bits & ~BF16) != 5 && (bits & ~BF16) != 8) {
        PyErr_SetString(PyExc_ValueError, "gemv_lora: bits 4, 5 or 8, | 16 for bf16 arithmetic");
        return NULL;
    }
    if (!bf16_built(bits, "gemv_lora") || !layout_fits(bits, v[6], v[8], (int)v[10], "gemv_lora")) return NULL;
    gemv_args a = {PTR(v[0]), PTR(v[1]), PTR(v[2]), PTR(v[3]), PTR(v[4]), v[5], v[6], v[7], v[8], (int)v[10], NULL};
    const lora_ref w = {PTR(v[14]), {PTR(v[15]), PTR(v[16]), PTR(v[17])}, {v[18], v[19], v[20]},
                        {0, v[18], v[18] + v[19]}, v[21], v[22], v[6], v[23], v[24] != 0};
    const int32_t *slots = PTR(v[13]);
    const int lora = v[14] != 0;
    if (lora && (w.slices < 1 || w.slices > 3 || v[18] + v[19] + v[20] != a.N)) {
        PyErr_SetString(PyExc_ValueError, "gemv_lora: 1 to 3 slices as wide as the GEMV's output");
        return NULL;
    }
    if (lora && lora_check_slots("gemv_lora", slots, a.M, w.loras) < 0) return NULL;
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = gemv_lora(&a, bits, (int)v[9], PTR(v[12]), lora ? &w : NULL, slots);
    Py_END_ALLOW_THREADS
    if (status < 0) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

/* ---- whole decode layers in one call ---- */

/* A layer's fixed arguments: one int64 row of a records array that ops.layer_record packs at load
 * (pointers and sizes; the R_EPS.. ones float64 bits), so a step passes one pointer for all its layers
 * instead of 57 Python ints a layer (~25 us of Python a layer, 2026-12-05). A weight is 6 slots: codes,
 * scales, zeros, group, half, bits (4, 5 or 8, | BF16 in bf16 arithmetic). Pointers 0 where absent (QK norm, QKV bias). */
enum {
    R_IN_NORM, R_POST_NORM, R_QKV, R_O = R_QKV + 6, R_GATE_UP = R_O + 6, R_DOWN = R_GATE_UP + 6,
    R_COS = R_DOWN + 6, R_SIN, R_TABLE_ROWS, R_K_CACHE, R_V_CACHE, R_CACHE_SLOTS, R_BLOCK_SIZE, R_WINDOW,
    R_H, R_HQ, R_HK, R_D, R_I, R_Q_NORM, R_K_NORM, R_QKV_BIAS, R_LORAS, R_LORA_RANK, R_LORA_BF16, R_LORA_QKV,
    R_LORA_O = R_LORA_QKV + 4, R_LORA_GATE_UP = R_LORA_O + 4, R_LORA_DOWN = R_LORA_GATE_UP + 4,
    R_EPS = R_LORA_DOWN + 4, R_SCALE, R_CAP, R_QK_EPS, R_FIELDS
};
/* LoRA (ember/ops/lora.py): R_LORAS slots (0: the layer has none) of rank R_LORA_RANK, bfloat16 where
 * R_LORA_BF16 is 1 (else float32); per projection 4 slots: A, then B of each slice (0 past the projection's
 * slices) */

typedef struct {
    const void *codes, *scales, *zeros;
    int64_t group;
    int half, bits;
} weight_ref;

static weight_ref weight_at(const int64_t *v) {
    weight_ref w = {PTR(v[0]), PTR(v[1]), PTR(v[2]), v[3], (int)v[4], (int)v[5]};
    return w;
}

static float record_float(const int64_t *r, int field) {
    double d;
    memcpy(&d, r + field, sizeof d);
    return (float)d;
}

static gemv_args gemv_of(const weight_ref *w, const float *x, float *y, int64_t M, int64_t K, int64_t N) {
    gemv_args a = {x, w->codes, w->scales, w->zeros, y, M, K, N, w->group, w->half, NULL};
    return a;
}

/* What changes from step to step: the tokens' positions and cache slots, the block tables and lengths */
typedef struct {
    const int64_t *pos, *slots;
    const int32_t *tables, *seq_lens;
    int64_t table_stride, M;
    int threads;
    const int32_t *lora_slots; /* each token's adapter slot (-1: none); NULL: no row has one */
} step_args;

/* The LoRA weights of projection `field` (R_LORA_*) over K inputs, its slices' widths n (0 past the last) */
static lora_ref lora_at(const int64_t *r, int field, int64_t K, int64_t n0, int64_t n1, int64_t n2) {
    lora_ref w = {PTR(r[field]), {PTR(r[field + 1]), PTR(r[field + 2]), PTR(r[field + 3])}, {n0, n1, n2},
                  {0, n0, n0 + n1}, n2 ? 3 : n1 ? 2 : 1, r[R_LORA_RANK], K, r[R_LORAS], r[R_LORA_BF16] != 0};
    return w;
}

/* a's GEMV (+ bias) and the LoRA delta of projection `field` (slices n0, n1, n2 wide) where the step has
 * adapter rows, in one parallel region (gemv_lora); -1: out of memory */
static int layer_gemv(const int64_t *r, const step_args *s, gemv_args *a, int bits, const float *bias, int field,
                      int64_t n0, int64_t n1, int64_t n2) {
    if (!s->lora_slots || !r[R_LORAS]) return gemv_lora(a, bits, s->threads, bias, NULL, NULL);
    const lora_ref w = lora_at(r, field, a->K, n0, n1, n2);
    return gemv_lora(a, bits, s->threads, bias, &w, s->lora_slots);
}

static attn_args attention_of(const int64_t *r, const step_args *s) {
    const int64_t width = (r[R_HQ] + 2 * r[R_HK]) * r[R_D];
    attn_args at = {NULL, PTR(r[R_K_CACHE]), PTR(r[R_V_CACHE]), s->tables, s->seq_lens, NULL, NULL, width,
                    s->table_stride, r[R_HQ], r[R_HK], r[R_D], r[R_BLOCK_SIZE], r[R_WINDOW],
                    record_float(r, R_SCALE), record_float(r, R_CAP)};
    return at;
}

/* The floats of scratch a layer needs: normed x, qkv, attention output, o output, normed h, gate/up
 * output, SiLU output */
static int64_t scratch_sizes(const int64_t *r, int64_t M, int64_t *sizes) {
    const int64_t H = r[R_H], I = r[R_I], width = (r[R_HQ] + 2 * r[R_HK]) * r[R_D];
    const int64_t s[7] = {M * H, M * width, M * r[R_HQ] * r[R_D], M * H, M * H, M * 2 * I, M * I};
    int64_t total = 0;
    for (int i = 0; i < 7; i++) total += sizes[i] = s[i];
    return total;
}

/* ValueError / IndexError / RuntimeError unless the kernels take this layer at this step */
static int layer_fits(const int64_t *r, const step_args *s) {
    if (!bf16_built((int)(r[R_QKV + 5] | r[R_O + 5] | r[R_GATE_UP + 5] | r[R_DOWN + 5]), "decode_layers")) return -1;
    const int64_t K[4] = {r[R_H], r[R_HQ] * r[R_D], r[R_H], r[R_I]}, field[4] = {R_QKV, R_O, R_GATE_UP, R_DOWN};
    for (int i = 0; i < 4; i++) {
        const int64_t *w = r + field[i];
        if (!layout_fits((int)w[5], K[i], w[3], (int)w[4], "decode_layers")) return -1;
    }
    const attn_args at = attention_of(r, s);
    if (!attention_fits(&at)) {
        PyErr_SetString(PyExc_ValueError, "decode_layers: group, head dim or block size too large");
        return -1;
    }
    if (s->lora_slots && r[R_LORAS] && lora_check_slots("decode_layers", s->lora_slots, s->M, r[R_LORAS]) < 0)
        return -1;
    return check_positions("decode_layers", s->pos, s->slots, s->M, r[R_TABLE_ROWS], r[R_CACHE_SLOTS]);
}

/* One Llama decoder layer for M one-token sequences, the calls a layer's modules make one by one, in the
 * same order with the same kernels (so bit for bit their result): residual add + RMSNorm, QKV GEMV,
 * rotary + KV store, paged attention, o GEMV, residual add + RMSNorm, gate/up GEMV + SiLU, down GEMV.
 * The QKV bias (Qwen2's) is added to the QKV GEMV's output as QuantLinear adds it; q_norm / k_norm
 * (Qwen3's per-head RMSNorm before rotary) use the kernels' RMSNorm where the modules use PyTorch's (the
 * same formula, its own summation order). res NULL: the first layer (x is the embedding, which becomes
 * the residual); res may be res_out and x may be out (the next layer reads x before it writes out). */
static int layer_step(const int64_t *r, const step_args *s, const float *x, const float *res, float *out,
                      float *res_out, float *scratch) {
    const int64_t M = s->M, H = r[R_H], Hq = r[R_HQ], Hk = r[R_HK], D = r[R_D], I = r[R_I];
    const int64_t width = (Hq + 2 * Hk) * D;
    const float eps = record_float(r, R_EPS), *qkv_bias = PTR(r[R_QKV_BIAS]);
    const weight_ref wqkv = weight_at(r + R_QKV), wo = weight_at(r + R_O), wgu = weight_at(r + R_GATE_UP),
                     wd = weight_at(r + R_DOWN);
    const int threads = s->threads;
    int64_t sizes[7];
    scratch_sizes(r, M, sizes);
    float *buf[7] = {scratch};
    for (int i = 1; i < 7; i++) buf[i] = buf[i - 1] + sizes[i - 1];
    int status = 0;
    if (res) {
        norm_rows(x, res, PTR(r[R_IN_NORM]), buf[0], res_out, M, H, eps, threads);
    } else {
        memcpy(res_out, x, sizeof(float) * (size_t)(M * H));
        norm_rows(x, NULL, PTR(r[R_IN_NORM]), buf[0], NULL, M, H, eps, threads);
    }
    gemv_args a = gemv_of(&wqkv, buf[0], buf[1], M, H, width);
    status |= layer_gemv(r, s, &a, wqkv.bits, qkv_bias, R_LORA_QKV, Hq * D, Hk * D, Hk * D);
    rotate_store_rows(buf[1], width, s->pos, PTR(r[R_COS]), PTR(r[R_SIN]), PTR(r[R_K_CACHE]), PTR(r[R_V_CACHE]),
                      s->slots, M, Hq, Hk, D, PTR(r[R_Q_NORM]), PTR(r[R_K_NORM]), record_float(r, R_QK_EPS),
                      threads);
    attn_args at = attention_of(r, s);
    at.q = buf[1];
    at.out = buf[2];
    attend(&at, M, threads);
    a = gemv_of(&wo, buf[2], buf[3], M, Hq * D, H);
    status |= layer_gemv(r, s, &a, wo.bits, NULL, R_LORA_O, H, 0, 0);
    norm_rows(buf[3], res_out, PTR(r[R_POST_NORM]), buf[4], res_out, M, H, eps, threads);
    a = gemv_of(&wgu, buf[4], buf[5], M, H, 2 * I);
    if (s->lora_slots && r[R_LORAS]) { /* the delta between the GEMV and the SiLU, as the modules add it */
        status |= layer_gemv(r, s, &a, wgu.bits, NULL, R_LORA_GATE_UP, I, I, 0);
        silu_rows(buf[5], buf[6], M, I, threads);
    } else {
        status |= gemv_silu(&a, buf[6], wgu.bits, threads);
    }
    a = gemv_of(&wd, buf[6], out, M, I, H);
    status |= layer_gemv(r, s, &a, wd.bits, NULL, R_LORA_DOWN, H, 0, 0);
    return status;
}

/* decode_layers(records, layers, x, residual, positions, slots, tables, table_stride, seq_lens, M, threads,
 *               out, residual_out, lora_slots)
 * `layers` consecutive decoder layers (rows of the int64 [layers, R_FIELDS] records) for M one-token
 * sequences, each as layer_step computes it: the first reads x and residual (0: the first layer of the
 * model), every one writes out [M, H] (its MLP output) and residual_out [M, H] (the residual stream),
 * which the next reads, as DecoderLayer.forward returns and DecoderModel.forward passes them. lora_slots:
 * int32 [M], each row's adapter slot in the layers' LoRA weights (-1: none), or 0: no row has one. */
static PyObject *decode_layers(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    int64_t v[14];
    if (parse(args, nargs, 14, "decode_layers", v, NULL, 0) < 0) return NULL;
    const int64_t *records = PTR(v[0]), layers = v[1];
    const step_args s = {PTR(v[4]), PTR(v[5]), PTR(v[6]), PTR(v[8]), v[7], v[9], (int)v[10], PTR(v[13])};
    float *out = PTR(v[11]), *res_out = PTR(v[12]);
    int64_t total = 0, sizes[7];
    for (int64_t l = 0; l < layers; l++) {
        if (layer_fits(records + l * R_FIELDS, &s) < 0) return NULL;
        const int64_t need = scratch_sizes(records + l * R_FIELDS, s.M, sizes);
        total = need > total ? need : total;
    }
    float *scratch = malloc(sizeof(float) * (size_t)total);
    if (!scratch) return PyErr_NoMemory();
    int status = 0;
    Py_BEGIN_ALLOW_THREADS
    for (int64_t l = 0; l < layers; l++) {
        const float *x = l ? out : PTR(v[2]), *res = l ? res_out : PTR(v[3]);
        status |= layer_step(records + l * R_FIELDS, &s, x, res, out, res_out, scratch);
    }
    Py_END_ALLOW_THREADS
    free(scratch);
    if (status < 0) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

/* layer_fields() -> R_FIELDS, so ops.layer_record's packing is checked against this file's at load */
static PyObject *layer_fields(PyObject *self, PyObject *unused) { return PyLong_FromLong(R_FIELDS); }

/* ==== end of the fused decode-layer ops ==== */
