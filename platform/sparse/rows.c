/* The table side of the one-process sparse step on the CPU, each as one pass over the batch's rows.

   Built at install (setup.py's optional extension `_rows`) and called through `kernels.py`'s ctypes on the
   tensors' memory (`kernels.py` checks dtypes and shapes; the loops check ids). Tables are float32 [R, K], rows int64, row by row contiguous.
   Each function does what the torch ops of `store.py` / `rules.py` do, in the same order of
   floating-point operations per element (tests/test_cpu_rows.py: the same bits, except Adagrad's square
   root, correctly rounded here while torch's vectorised one may be 1 ulp off).
   Why: torch's ops took 11.2 ms of a bf16 step's operator time at Criteo's shapes on 2 cores (a sort
   inside torch.unique, the per-row sum, four gathers/scatters of the row update); these loops take
   1-2 ms each, 4-5 ms together, inside a step. */

#include <math.h>
#include <stdint.h>
#include <string.h>

#ifndef MARIANA_ROWS_SOURCE
#define MARIANA_ROWS_SOURCE "unknown"
#endif

/* The identity of this file's text, as setup.py computed it (`kernels.source_id`): a library built from an
   older text is refused rather than called with the newer signatures. */
const char *mariana_rows_source(void) { return MARIANA_ROWS_SOURCE; }

/* Rows are scattered over tables of hundreds of MB: each access misses the caches. Asking for the row
   AHEAD positions on keeps that many misses in flight (the loops are otherwise latency-bound: 9.3 ms
   together in a training step against 2.5 ms on a cache-resident table; 6-7 ms with the prefetch). */
#define AHEAD 16
#define PREFETCH(p, rw) __builtin_prefetch((p), (rw), 0)

/* One portable build for every x86-64 CPU of a shared home, each function also compiled for x86-64-v3
   (AVX2, FMA) and v4 (AVX-512), the loader picking the clone the CPU runs (an ifunc): the loops measured
   about 2x faster with AVX2 than at the x86-64 baseline (`platform/README.md`, "Measured choices"). */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define CLONES __attribute__((target_clones("default", "arch=x86-64-v3", "arch=x86-64-v4")))
#else
#define CLONES
#endif

/* rows0 [n] <- table[ids, 0]; rest [n, K - 1] <- table[ids, 1:] (F.embedding, then the split into the
   linear weight and the embedding vector). Returns -1, or the first position whose id is outside [0, R)
   (nothing read past it). */
CLONES int64_t mariana_gather_split(const float *table, int64_t num_rows, int64_t k, const int64_t *ids, int64_t n,
                             float *rows0, float *rest) {
    const int64_t k1 = k - 1;
    for (int64_t i = 0; i < n; i++) {
        if (ids[i] < 0 || ids[i] >= num_rows) return i;
        if (i + AHEAD < n && ids[i + AHEAD] >= 0 && ids[i + AHEAD] < num_rows) {
            const float *next = table + ids[i + AHEAD] * k;
            PREFETCH(next, 0);
            PREFETCH(next + k - 1, 0); /* a row of 17 floats may straddle two cache lines */
        }
        const float *src = table + ids[i] * k;
        rows0[i] = src[0];
        memcpy(rest + i * k1, src + 1, (size_t)k1 * sizeof(float));
    }
    return -1;
}

/* The distinct rows of ids [n] in order of first appearance -> rows [U] (returns U), and each row's
   gradient sums [U, K]: column 0 from g0 [n], columns 1.. from grest [n, K - 1], added in the order of
   the positions (as index_add_ does, starting from 0). slot [R] int32 must hold -1 everywhere on entry;
   it does again on return. An id outside [0, R) at position i: returns -1 - i. */
CLONES int64_t mariana_unique_sum(const int64_t *ids, int64_t n, int64_t num_rows, const float *g0, const float *grest,
                           int64_t k, int32_t *slot, int64_t *rows, float *sums) {
    const int64_t k1 = k - 1;
    int64_t u = 0, bad = 0;
    for (int64_t i = 0; i < n; i++) {
        const int64_t r = ids[i];
        if (r < 0 || r >= num_rows) {
            bad = -1 - i;
            break;
        }
        if (i + AHEAD < n && ids[i + AHEAD] >= 0 && ids[i + AHEAD] < num_rows) PREFETCH(slot + ids[i + AHEAD], 1);
        int32_t s = slot[r];
        float *out = sums + (int64_t)(s < 0 ? u : s) * k;
        const float *g = grest + i * k1;
        if (s < 0) { /* 0 + g, not g: -0.0 becomes +0.0 as in index_add_ into zeros */
            slot[r] = (int32_t)u;
            rows[u++] = r;
            out[0] = 0.0f + g0[i];
            for (int64_t c = 0; c < k1; c++) out[c + 1] = 0.0f + g[c];
        } else {
            out[0] += g0[i];
            for (int64_t c = 0; c < k1; c++) out[c + 1] += g[c];
        }
    }
    for (int64_t s = 0; s < u; s++) slot[rows[s]] = -1;
    return bad < 0 ? bad : u;
}

/* The row optimiser on the U distinct rows: grad [U, K] (changed: l2 * w added when l2 > 0), table and
   acc [R, K] float32, seen [R] bytes set to 1. rule 0: sgd (w -= lr * g); 1: adagrad
   (a += g * g; w -= lr * g / (sqrt(a) + eps)); the multiply-adds fused, as in torch's
   vectorised addcmul_ and sub_(alpha=lr). Returns -1, or the first s whose row is outside [0, R): then
   nothing was written (every row is checked before the first write). */
CLONES int64_t mariana_update_rows(float *table, int64_t num_rows, float *acc, uint8_t *seen, int64_t k,
                            const int64_t *rows, int64_t u, float *grad, int rule, float lr, float eps,
                            float l2) {
    for (int64_t s = 0; s < u; s++)
        if (rows[s] < 0 || rows[s] >= num_rows) return s;
    for (int64_t s = 0; s < u; s++) {
        const int64_t r = rows[s];
        if (s + AHEAD < u) {
            const int64_t rn = rows[s + AHEAD];
            PREFETCH(table + rn * k, 1);
            PREFETCH(table + rn * k + k - 1, 1);
            if (rule != 0) {
                PREFETCH(acc + rn * k, 1);
                PREFETCH(acc + rn * k + k - 1, 1);
            }
            PREFETCH(seen + rn, 1);
        }
        float *w = table + r * k, *g = grad + s * k;
        if (l2 > 0.0f)
            for (int64_t c = 0; c < k; c++) g[c] = fmaf(l2, w[c], g[c]);
        if (rule == 0) {
            for (int64_t c = 0; c < k; c++) w[c] = fmaf(-lr, g[c], w[c]);
        } else {
            float *a = acc + r * k;
            for (int64_t c = 0; c < k; c++) {
                const float an = fmaf(g[c], g[c], a[c]);
                a[c] = an;
                w[c] = fmaf(-lr, g[c] / (sqrtf(an) + eps), w[c]);
            }
        }
        seen[r] = 1;
    }
    return -1;
}
