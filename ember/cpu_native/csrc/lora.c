/* The LoRA delta of rows under different adapters (ember/ops/lora.py): for each row t whose adapter slot
 * s = slots[t] is not -1, xa = A[s] x[t] (all slices' ranks side by side), then for each slice i,
 * y[t, off_i + c] += sum_k xa[i R + k] B_i[s, k, c]. Part of kernels.c's one translation unit.
 *
 * Rows are taken slot by slot, so a call reads each slot's A and B once whatever its rows (a chunk of B
 * stays in L1 across them) and never reads a slot no row uses; PyTorch's one-hot form (TorchLoRA)
 * multiplied every slot for every row in ~8 ops a projection. Each row's sums run in one fixed order,
 * whatever the other rows, so a row's delta does not depend on its batch.
 *
 * The slots hold float32 or bfloat16 (`--lora-dtype bfloat16`: half the memory), summed in float32 either
 * way: a bf16 value widens to float32 exactly, so a bf16 slot gives the float32 kernel's numbers for the
 * same rounded weights. */

#include "kernels.h"

#define LORA_COLS 64                /* output columns a thread adds at once: four vectors of accumulators */
#define LORA_PARALLEL_MIN (1 << 14) /* values of weights a call reads below which it runs on one thread */

typedef struct {
    const void *a;        /* [loras, slices * rank, K] */
    const void *b[3];     /* per slice [loras, rank, n_i] */
    int64_t n[3], off[3]; /* per slice: width, first output column */
    int64_t slices, rank, K, loras;
    int bf16; /* a and b hold bfloat16 (else float32) */
} lora_ref;

/* element i of a slot tensor, widened to float32 */
static inline float lora_value(const void *p, int64_t i, int bf16) {
    return bf16 ? bf16_value(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* the address of element i of a slot tensor */
static inline const void *lora_at_elem(const void *p, int64_t i, int bf16) {
    return (const char *)p + i * (bf16 ? 2 : 4);
}

#define LORA_ROWS 4 /* rows of one slot a weight vector, once loaded, is multiplied with */
#ifndef LORA_AHEAD
#define LORA_AHEAD 4 /* chunks of B ahead that the expand prefetches */
#endif
#define ALWAYS_INLINE static inline __attribute__((always_inline))

#ifdef __AVX512F__
/* elements i .. i + 16 of a slot tensor as floats, all present */
ALWAYS_INLINE __m512 lora_vec16(const void *p, int64_t i, const int bf16) {
    return bf16 ? bf16_widen16(_mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i)))
                : _mm512_loadu_ps((const float *)p + i);
}

/* elements i .. i + 16 of a slot tensor as floats, lanes at and past `left` zero and not read (none when
 * left <= 0: a chunk's vectors past a slice's last column) */
ALWAYS_INLINE __m512 lora_vec(const void *p, int64_t i, int64_t left, const int bf16) {
    if (left >= 16) return lora_vec16(p, i, bf16);
    if (left <= 0) return _mm512_setzero_ps();
    if (!bf16) return _mm512_maskz_loadu_ps(tail_mask(left), (const float *)p + i);
    uint16_t t[16] = {0};
    memcpy(t, (const uint16_t *)p + i, sizeof(uint16_t) * (size_t)left);
    return bf16_widen16(_mm256_loadu_si256((const __m256i *)t));
}
#endif

#ifdef __AVX512F__
/* out[r] = dot(a, x[r]) over K values for r < NX, each in 16 lanes then their sum; one load of a serves the
 * NX rows. A row's sums are the same whatever NX (lanes and rows are independent). */
ALWAYS_INLINE void lora_dots(const void *a, const float *const *x, int64_t K, float *out, const int NX,
                             const int bf16) {
    __m512 acc[LORA_ROWS];
    UNROLL for (int r = 0; r < NX; r++) acc[r] = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= K; i += 16) {
        PREFETCH(lora_at_elem(a, i, bf16));
        const __m512 av = lora_vec16(a, i, bf16);
        UNROLL for (int r = 0; r < NX; r++) acc[r] = _mm512_fmadd_ps(av, _mm512_loadu_ps(x[r] + i), acc[r]);
    }
    if (i < K) {
        const __m512 av = lora_vec(a, i, K - i, bf16);
        UNROLL for (int r = 0; r < NX; r++) acc[r] =
            _mm512_fmadd_ps(av, _mm512_maskz_loadu_ps(tail_mask(K - i), x[r] + i), acc[r]);
    }
    UNROLL for (int r = 0; r < NX; r++) out[r] = _mm512_reduce_add_ps(acc[r]);
}

/* y[r][c] += sum_k xa[r][k] b[k * stride + c] for c < width (<= LORA_COLS) and r < NY: one load of b serves
 * the NY rows */
ALWAYS_INLINE void lora_expand_rows(const float *const *xa, const void *b, int64_t stride, int64_t rank,
                                    float *const *y, int64_t width, const int NY, const int bf16) {
    __m512 acc[LORA_ROWS][LORA_COLS / 16];
    __mmask16 m[LORA_COLS / 16];
    UNROLL for (int v = 0; v < LORA_COLS / 16; v++) {
        m[v] = width > v * 16 ? tail_mask(width - v * 16) : 0;
        UNROLL for (int r = 0; r < NY; r++) acc[r][v] = _mm512_setzero_ps();
    }
    for (int64_t k = 0; k < rank; k++) {
        __m512 bv[LORA_COLS / 16];
        UNROLL for (int v = 0; v < LORA_COLS / 16; v++) bv[v] = lora_vec(b, k * stride + v * 16, width - v * 16, bf16);
        UNROLL for (int r = 0; r < NY; r++) {
            const __m512 xv = _mm512_set1_ps(xa[r][k]);
            UNROLL for (int v = 0; v < LORA_COLS / 16; v++) acc[r][v] = _mm512_fmadd_ps(xv, bv[v], acc[r][v]);
        }
    }
    UNROLL for (int r = 0; r < NY; r++) UNROLL for (int v = 0; v < LORA_COLS / 16; v++)
        _mm512_mask_storeu_ps(y[r] + v * 16, m[v], _mm512_add_ps(_mm512_maskz_loadu_ps(m[v], y[r] + v * 16), acc[r][v]));
}
#else
ALWAYS_INLINE void lora_dots(const void *a, const float *const *x, int64_t K, float *out, const int NX,
                             const int bf16) {
    for (int r = 0; r < NX; r++) {
        float s = 0.f;
        for (int64_t i = 0; i < K; i++) s += lora_value(a, i, bf16) * x[r][i];
        out[r] = s;
    }
}

ALWAYS_INLINE void lora_expand_rows(const float *const *xa, const void *b, int64_t stride, int64_t rank,
                                    float *const *y, int64_t width, const int NY, const int bf16) {
    for (int r = 0; r < NY; r++)
        for (int64_t c = 0; c < width; c++) {
            float s = 0.f;
            for (int64_t k = 0; k < rank; k++) s += xa[r][k] * lora_value(b, k * stride + c, bf16);
            y[r][c] += s;
        }
}
#endif

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

/* A call's rows grouped by slot: order[start[s] .. start[s + 1]) are slot s's rows, used[0 .. n_used) the
 * slots some row has; xa [M, slices * rank] the shrink's output. */
typedef struct {
    int64_t *start, *order, *used, n_used;
    float *xa;
} lora_plan;

static void lora_plan_free(lora_plan *p) { free(p->start), free(p->order), free(p->xa); }

/* -1 when out of memory (nothing to free then) */
static int lora_plan_make(lora_plan *p, const lora_ref *w, const int32_t *slots, int64_t M) {
    const int64_t L = w->loras, SR = w->slices * w->rank;
    p->start = calloc((size_t)(3 * L + 1), sizeof(int64_t));
    p->order = malloc(sizeof(int64_t) * (size_t)(M + 1));
    p->xa = malloc(sizeof(float) * (size_t)(M * SR + 1));
    if (!p->start || !p->order || !p->xa) {
        lora_plan_free(p);
        return -1;
    }
    int64_t *start = p->start, *fill = start + 2 * L + 1;
    p->used = start + L + 1;
    p->n_used = 0;
    for (int64_t t = 0; t < M; t++)
        if (slots[t] >= 0) start[slots[t] + 1]++;
    for (int64_t s = 0; s < L; s++) {
        if (start[s + 1]) p->used[p->n_used++] = s;
        start[s + 1] += start[s];
        fill[s] = start[s];
    }
    for (int64_t t = 0; t < M; t++)
        if (slots[t] >= 0) p->order[fill[slots[t]]++] = t;
    return 0;
}

/* The values of adapter weights a call of this plan reads */
static int64_t lora_plan_values(const lora_plan *p, const lora_ref *w) {
    int64_t width = 0;
    for (int64_t i = 0; i < w->slices; i++) width += w->n[i];
    return p->n_used * (w->slices * w->rank * w->K + w->rank * width);
}

/* The shrink of one A row for a slot's rows g0 .. g1 (of `order`), LORA_ROWS at a time; BF16 a constant */
ALWAYS_INLINE void lora_shrink_rows(const void *arow, const lora_plan *p, const float *x, int64_t x_stride, int64_t K,
                                    int64_t SR, int64_t j, int64_t g0, int64_t g1, const int bf16) {
    const float *xr[LORA_ROWS];
    float out[LORA_ROWS];
    int64_t g = g0;
    for (; g + LORA_ROWS <= g1; g += LORA_ROWS) {
        UNROLL for (int r = 0; r < LORA_ROWS; r++) xr[r] = x + p->order[g + r] * x_stride;
        lora_dots(arow, xr, K, out, LORA_ROWS, bf16);
        UNROLL for (int r = 0; r < LORA_ROWS; r++) p->xa[p->order[g + r] * SR + j] = out[r];
    }
    for (; g < g1; g++) {
        xr[0] = x + p->order[g] * x_stride;
        lora_dots(arow, xr, K, out, 1, bf16);
        p->xa[p->order[g] * SR + j] = out[0];
    }
}

/* The shrink's unit u of n_used * slices * rank: one per (used slot, row of its A), for every row of that
 * slot */
static void lora_shrink_unit(const lora_ref *w, const lora_plan *p, const float *x, int64_t x_stride, int64_t u) {
    const int64_t SR = w->slices * w->rank, s = p->used[u / SR], j = u % SR;
    const void *arow = lora_at_elem(w->a, (s * SR + j) * w->K, w->bf16);
    if (w->bf16)
        lora_shrink_rows(arow, p, x, x_stride, w->K, SR, j, p->start[s], p->start[s + 1], 1);
    else
        lora_shrink_rows(arow, p, x, x_stride, w->K, SR, j, p->start[s], p->start[s + 1], 0);
}

/* The expand of one B chunk (its first column y's) for a slot's rows g0 .. g1 (of `order`), LORA_ROWS at a
 * time; BF16 a constant */
ALWAYS_INLINE void lora_expand_slot(const lora_ref *w, const lora_plan *p, int64_t i, const void *b, int64_t cw,
                                    float *y, int64_t y_stride, int64_t g0, int64_t g1, const int bf16) {
    const int64_t R = w->rank, SR = w->slices * R, n = w->n[i], col = w->off[i];
    const float *xa[LORA_ROWS];
    float *yr[LORA_ROWS];
    int64_t g = g0;
    for (; g + LORA_ROWS <= g1; g += LORA_ROWS) {
        UNROLL for (int r = 0; r < LORA_ROWS; r++) {
            xa[r] = p->xa + p->order[g + r] * SR + i * R;
            yr[r] = y + p->order[g + r] * y_stride + col;
        }
        lora_expand_rows(xa, b, n, R, yr, cw, LORA_ROWS, bf16);
    }
    for (; g < g1; g++) {
        xa[0] = p->xa + p->order[g] * SR + i * R;
        yr[0] = y + p->order[g] * y_stride + col;
        lora_expand_rows(xa, b, n, R, yr, cw, 1, bf16);
    }
}

/* Into L2, the lines of a slot's B rows LORA_AHEAD chunks on (a chunk's rows are rank streams a slot, more
 * than the hardware prefetchers follow) */
static inline void lora_prefetch_b(const void *b, int64_t stride, int64_t rank, int bf16) {
#ifdef __AVX512F__
    const int64_t elem = bf16 ? 2 : 4;
    const char *next = (const char *)b + LORA_AHEAD * LORA_COLS * elem;
    for (int64_t k = 0; k < rank; k++)
        for (int64_t line = 0; line < LORA_COLS * elem; line += 64)
            _mm_prefetch(next + k * stride * elem + line, _MM_HINT_T1);
#endif
}

/* Slice i's columns c0 .. c0 + cw (cw <= LORA_COLS, relative to the slice) of every used slot's rows */
static void lora_expand_chunk(const lora_ref *w, const lora_plan *p, int64_t i, int64_t c0, int64_t cw, float *y,
                              int64_t y_stride) {
    const int64_t R = w->rank, n = w->n[i];
    for (int64_t k = 0; k < p->n_used; k++) {
        const int64_t s = p->used[k];
        const void *b = lora_at_elem(w->b[i], s * R * n + c0, w->bf16);
        lora_prefetch_b(b, n, R, w->bf16);
        if (w->bf16)
            lora_expand_slot(w, p, i, b, cw, y + c0, y_stride, p->start[s], p->start[s + 1], 1);
        else
            lora_expand_slot(w, p, i, b, cw, y + c0, y_stride, p->start[s], p->start[s + 1], 0);
    }
}

/* The expand of output columns c0 .. c1 (of all slices side by side, off[i] being slice i's first), in
 * chunks of LORA_COLS. Each column's sum is the same whatever the chunk it falls in (lanes are
 * independent), so any split of the columns gives the same numbers. */
static void lora_expand_range(const lora_ref *w, const lora_plan *p, int64_t c0, int64_t c1, float *y,
                              int64_t y_stride) {
    for (int64_t i = 0; i < w->slices; i++) {
        const int64_t lo = c0 > w->off[i] ? c0 - w->off[i] : 0, hi = c1 - w->off[i] < w->n[i] ? c1 - w->off[i] : w->n[i];
        for (int64_t c = lo; c < hi; c += LORA_COLS)
            lora_expand_chunk(w, p, i, c, hi - c < LORA_COLS ? hi - c : LORA_COLS, y, y_stride);
    }
}

/* The delta of w's adapters added to y [M, y_stride] for x [M, x_stride] (slots checked); -1 when out of
 * memory. Runs without the GIL. */
static int lora_delta(const lora_ref *w, const float *x, int64_t x_stride, float *y, int64_t y_stride,
                      const int32_t *slots, int64_t M, int threads) {
    lora_plan p;
    if (lora_plan_make(&p, w, slots, M) < 0) return -1;
    if (!p.n_used) {
        lora_plan_free(&p);
        return 0;
    }
    const int64_t SR = w->slices * w->rank;
    int64_t cols = 0, chunks[3] = {0, 0, 0};
    for (int64_t i = 0; i < w->slices; i++) cols += chunks[i] = (w->n[i] + LORA_COLS - 1) / LORA_COLS;
    if (lora_plan_values(&p, w) < LORA_PARALLEL_MIN) threads = 1;
#pragma omp parallel num_threads(threads)
    {
        int64_t u;
#pragma omp for schedule(static)
        for (u = 0; u < p.n_used * SR; u++) lora_shrink_unit(w, &p, x, x_stride, u);
        /* expand: one unit per (slice, LORA_COLS columns of it), for every used slot and its rows */
#pragma omp for schedule(static)
        for (u = 0; u < cols; u++) {
            int64_t i = 0, c = u;
            while (c >= chunks[i]) c -= chunks[i++];
            const int64_t c0 = c * LORA_COLS;
            lora_expand_chunk(w, &p, i, c0, w->n[i] - c0 < LORA_COLS ? w->n[i] - c0 : LORA_COLS, y, y_stride);
        }
    }
    lora_plan_free(&p);
    return 0;
}

/* lora_delta(x, x_stride, y, y_stride, slots, M, a, b0, b1, b2, n0, n1, n2, off0, off1, off2, slices, rank,
 *            K, loras, bf16, threads): x float32 [M, K] rows x_stride apart, y float32 [M, >= off + n] rows
 *            y_stride apart, slots int32 [M] (-1: no adapter), a [loras, slices * rank, K], b_i [loras, rank,
 *            n_i] (unused slices 0), a and b float32, or bfloat16 where bf16 is 1 */
static PyObject *lora_delta_entry(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    int64_t v[22];
    if (parse(args, nargs, 22, "lora_delta", v, NULL, 0) < 0) return NULL;
    const lora_ref w = {PTR(v[6]), {PTR(v[7]), PTR(v[8]), PTR(v[9])}, {v[10], v[11], v[12]}, {v[13], v[14], v[15]},
                        v[16], v[17], v[18], v[19], v[20] != 0};
    const int32_t *slots = PTR(v[4]);
    if (w.slices < 1 || w.slices > 3) {
        PyErr_SetString(PyExc_ValueError, "lora_delta: 1 to 3 slices");
        return NULL;
    }
    if (lora_check_slots("lora_delta", slots, v[5], w.loras) < 0) return NULL;
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = lora_delta(&w, PTR(v[0]), v[1], PTR(v[2]), v[3], slots, v[5], (int)v[21]);
    Py_END_ALLOW_THREADS
    if (status < 0) return PyErr_NoMemory();
    Py_RETURN_NONE;
}
