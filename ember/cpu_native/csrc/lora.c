/* The LoRA delta of rows under different adapters (ember/ops/lora.py): for each row t whose adapter slot
 * s = slots[t] is not -1, xa = A[s] x[t] (all slices' ranks side by side), then for each slice i,
 * y[t, off_i + c] += sum_k xa[i R + k] B_i[s, k, c]. Part of kernels.c's one translation unit.
 *
 * Rows are taken slot by slot, so a call reads each slot's A and B once whatever its rows (a chunk of B
 * stays in L1 across them) and never reads a slot no row uses; PyTorch's one-hot form (TorchLoRA)
 * multiplied every slot for every row in ~8 ops a projection. Each row's sums run in one fixed order,
 * whatever the other rows, so a row's delta does not depend on its batch. */

#include "kernels.h"

#define LORA_COLS 64                /* output columns a thread adds at once: four vectors of accumulators */
#define LORA_PARALLEL_MIN (1 << 14) /* floats of weights a call reads below which it runs on one thread */

typedef struct {
    const float *a;       /* [loras, slices * rank, K] */
    const float *b[3];    /* per slice [loras, rank, n_i] */
    int64_t n[3], off[3]; /* per slice: width, first output column */
    int64_t slices, rank, K, loras;
} lora_ref;

/* dot(a, x) over K floats, in 16 lanes then their sum */
static inline float lora_dot(const float *a, const float *x, int64_t K) {
#ifdef __AVX512F__
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < K; i += 16) {
        const __mmask16 m = tail_mask(K - i);
        acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, a + i), _mm512_maskz_loadu_ps(m, x + i), acc);
    }
    return _mm512_reduce_add_ps(acc);
#else
    float s = 0.f;
    for (int64_t i = 0; i < K; i++) s += a[i] * x[i];
    return s;
#endif
}

/* y[c] += sum_k xa[k] b[k * stride + c] for c < width (<= LORA_COLS) */
static inline void lora_expand_cols(const float *xa, const float *b, int64_t stride, int64_t rank, float *y,
                                    int64_t width) {
#ifdef __AVX512F__
    __m512 acc[LORA_COLS / 16];
    __mmask16 m[LORA_COLS / 16];
    UNROLL for (int v = 0; v < LORA_COLS / 16; v++) {
        acc[v] = _mm512_setzero_ps();
        m[v] = width > v * 16 ? tail_mask(width - v * 16) : 0;
    }
    for (int64_t k = 0; k < rank; k++) {
        const __m512 xv = _mm512_set1_ps(xa[k]);
        UNROLL for (int v = 0; v < LORA_COLS / 16; v++) acc[v] =
            _mm512_fmadd_ps(xv, _mm512_maskz_loadu_ps(m[v], b + k * stride + v * 16), acc[v]);
    }
    UNROLL for (int v = 0; v < LORA_COLS / 16; v++) _mm512_mask_storeu_ps(
        y + v * 16, m[v], _mm512_add_ps(_mm512_maskz_loadu_ps(m[v], y + v * 16), acc[v]));
#else
    for (int64_t c = 0; c < width; c++) {
        float s = 0.f;
        for (int64_t k = 0; k < rank; k++) s += xa[k] * b[k * stride + c];
        y[c] += s;
    }
#endif
}

/* -1 (IndexError set) unless every slot is -1 or one of the `loras` */
static int lora_check_slots(const char *name, const int32_t *slots, int64_t M, int64_t loras) {
    for (int64_t t = 0; t < M; t++) {
        if (slots[t] < -1 || slots[t] >= loras) {
            PyErr_Format(PyExc_IndexError, "%s: token %lld has LoRA slot %d (of %lld)", name, (long long)t,
                         (int)slots[t], (long long)loras);
            return -1;
        }
    }
    return 0;
}

/* The delta of w's adapters added to y [M, y_stride] for x [M, x_stride] (slots checked); -1 when out of
 * memory. Runs without the GIL. */
static int lora_delta(const lora_ref *w, const float *x, int64_t x_stride, float *y, int64_t y_stride,
                      const int32_t *slots, int64_t M, int threads) {
    const int64_t L = w->loras, R = w->rank, SR = w->slices * R, K = w->K;
    /* rows grouped by slot: order[start[s] .. start[s + 1]) are slot s's; used[] the slots some row has */
    int64_t *start = calloc((size_t)(3 * L + 1), sizeof(int64_t)), *order = malloc(sizeof(int64_t) * (size_t)(M + 1));
    float *xa = malloc(sizeof(float) * (size_t)(M * SR + 1));
    if (!start || !order || !xa) {
        free(start), free(order), free(xa);
        return -1;
    }
    int64_t *used = start + L + 1, *fill = used + L, n_used = 0, width = 0, cols = 0, chunks[3] = {0, 0, 0};
    for (int64_t t = 0; t < M; t++)
        if (slots[t] >= 0) start[slots[t] + 1]++;
    for (int64_t s = 0; s < L; s++) {
        if (start[s + 1]) used[n_used++] = s;
        start[s + 1] += start[s];
        fill[s] = start[s];
    }
    for (int64_t t = 0; t < M; t++)
        if (slots[t] >= 0) order[fill[slots[t]]++] = t;
    for (int64_t i = 0; i < w->slices; i++) {
        width += w->n[i];
        cols += chunks[i] = (w->n[i] + LORA_COLS - 1) / LORA_COLS;
    }
    if (!n_used) {
        free(start), free(order), free(xa);
        return 0;
    }
    if (n_used * (SR * K + R * width) < LORA_PARALLEL_MIN) threads = 1;
#pragma omp parallel num_threads(threads)
    {
        int64_t u;
        /* shrink: one unit per (used slot, row of its A), for every row of that slot */
#pragma omp for schedule(static)
        for (u = 0; u < n_used * SR; u++) {
            const int64_t s = used[u / SR], j = u % SR;
            const float *arow = w->a + (s * SR + j) * K;
            for (int64_t g = start[s]; g < start[s + 1]; g++) {
                const int64_t t = order[g];
                xa[t * SR + j] = lora_dot(arow, x + t * x_stride, K);
            }
        }
        /* expand: one unit per (slice, LORA_COLS columns of it), for every used slot and its rows */
#pragma omp for schedule(static)
        for (u = 0; u < cols; u++) {
            int64_t i = 0, c = u;
            while (c >= chunks[i]) c -= chunks[i++];
            const int64_t n = w->n[i], c0 = c * LORA_COLS, cw = n - c0 < LORA_COLS ? n - c0 : LORA_COLS;
            for (int64_t k = 0; k < n_used; k++) {
                const int64_t s = used[k];
                const float *b = w->b[i] + s * R * n + c0;
                for (int64_t g = start[s]; g < start[s + 1]; g++) {
                    const int64_t t = order[g];
                    lora_expand_cols(xa + t * SR + i * R, b, n, R, y + t * y_stride + w->off[i] + c0, cw);
                }
            }
        }
    }
    free(start), free(order), free(xa);
    return 0;
}

/* lora_delta(x, x_stride, y, y_stride, slots, M, a, b0, b1, b2, n0, n1, n2, off0, off1, off2, slices, rank,
 *            K, loras, threads): x float32 [M, K] rows x_stride apart, y float32 [M, >= off + n] rows y_stride
 *            apart, slots int32 [M] (-1: no adapter), a float32 [loras, slices * rank, K], b_i float32
 *            [loras, rank, n_i] (unused slices 0) */
static PyObject *lora_delta_entry(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    int64_t v[21];
    if (parse(args, nargs, 21, "lora_delta", v, NULL, 0) < 0) return NULL;
    const lora_ref w = {PTR(v[6]), {PTR(v[7]), PTR(v[8]), PTR(v[9])}, {v[10], v[11], v[12]}, {v[13], v[14], v[15]},
                        v[16], v[17], v[18], v[19]};
    const int32_t *slots = PTR(v[4]);
    if (w.slices < 1 || w.slices > 3) {
        PyErr_SetString(PyExc_ValueError, "lora_delta: 1 to 3 slices");
        return NULL;
    }
    if (lora_check_slots("lora_delta", slots, v[5], w.loras) < 0) return NULL;
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = lora_delta(&w, PTR(v[0]), v[1], PTR(v[2]), v[3], slots, v[5], (int)v[20]);
    Py_END_ALLOW_THREADS
    if (status < 0) return PyErr_NoMemory();
    Py_RETURN_NONE;
}
