/* Greedy sampling's argmax over float32 logits rows (part of kernels.c's one translation unit: see there).
 * torch's argmax over the default model's 49152 logits took 43 us a row (340 us at 16 rows, 2026-12-05),
 * most of a CPU step's sampling; one vector pass for the maximum and one for its first index take a few. */

#include "kernels.h"

/* torch.argmax's pick, element by element: the first index of the largest value, a NaN larger than any
 * number (the first NaN) */
static int64_t argmax_scalar(const float *x, int64_t n) {
    int64_t best = 0;
    for (int64_t i = 1; i < n && x[best] == x[best]; i++)
        if (x[i] > x[best] || x[i] != x[i]) best = i;
    return best;
}

static int64_t argmax_row(const float *x, int64_t n) {
#ifdef __AVX512F__
    __m512 mx = _mm512_set1_ps(-INFINITY);
    __mmask16 nan = 0;
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512 v = _mm512_loadu_ps(x + i);
        nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        mx = _mm512_max_ps(mx, v);
    }
    float m = _mm512_reduce_max_ps(mx);
    for (int64_t j = i; j < n; j++) {
        nan |= x[j] != x[j];
        m = x[j] > m ? x[j] : m;
    }
    if (nan) return argmax_scalar(x, n);
    const __m512 target = _mm512_set1_ps(m);
    for (i = 0; i + 16 <= n; i += 16) {
        __mmask16 hit = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + i), target, _CMP_EQ_OQ);
        if (hit) return i + __builtin_ctz(hit);
    }
    for (; i < n; i++)
        if (x[i] == m) return i;
    return 0; /* not reached: m is one of the values */
#else
    return argmax_scalar(x, n);
#endif
}

/* argmax(x, out, M, N, row_stride, threads): out int64 [M] = the argmax of each row of x float32 */
static PyObject *argmax(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    int64_t v[6];
    if (parse(args, nargs, 6, "argmax", v, NULL, 0) < 0) return NULL;
    const float *x = PTR(v[0]);
    int64_t *out = PTR(v[1]);
    const int64_t M = v[2], N = v[3], stride = v[4];
    int threads = M * N < ROWS_PARALLEL_MIN ? 1 : (int)v[5];
    Py_BEGIN_ALLOW_THREADS
    int64_t m;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (m = 0; m < M; m++) out[m] = argmax_row(x + m * stride, N);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}
