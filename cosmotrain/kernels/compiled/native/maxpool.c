/* Max pooling over 2x2x2 windows that tile the input (kernel = stride = 2, no padding),
 * float32: the MLPerf network's pooling after every convolution.
 *
 * Why in C: the numpy kernel (maxpool_tiled.py) needs a dozen passes over strided and
 * boolean arrays; on the first MLPerf block (2 x 32 x 128^3 floats) its forward took
 * 210 ms of a 2.0 s step, more than PyTorch's.  Here each window is read once: the
 * maximum and its offset (4a + 2b + e, the first of equal maxima, or the first NaN, as
 * the general kernel rules) in one pass, and the backward writes every input element
 * once (dy at the window's argmax, 0 elsewhere: no products, so an infinite dy stays in
 * its tap).  Plain C for any x86-64: these loops are bound by memory, not arithmetic.
 *
 * Strides are in elements; x / dx rows are contiguous along W.  The caller zeroes the
 * input gradient's leftover plane, row or column of odd sizes (in no window). */

#pragma GCC optimize("O3")

#include <math.h>

/* The exact rule for one window: the first of equal maxima, or the first NaN. */
static void window_exact(const float *r[4], int w, float *best_out, signed char *k_out) {
    float best = r[0][2 * w];
    int k = 0, nan_k = isnan(best) ? 0 : -1;
    for (int j = 1; j < 8; j++) {
        const float v = r[j >> 1][2 * w + (j & 1)];
        if (v > best) { best = v; k = j; }
        if (nan_k < 0 && isnan(v)) nan_k = j;
    }
    if (nan_k >= 0) { k = nan_k; best = r[k >> 1][2 * w + (k & 1)]; }
    *best_out = best;
    *k_out = (signed char)k;
}

#define SPAN 64  /* outputs of a row handled together (vectorised selects) */

/* One row of outputs in two contiguous stages, both of which the compiler vectorises
 * without strided loads: across the 4 rows (a, b) for every input column (the first
 * row holding the maximum wins), then across each column pair (e = 0, 1).  The second
 * stage keeps the first of equal maxima in offset order 2 q + e (q = 2a + b): column 1
 * wins a tie only from an earlier row.  A row that met a NaN is redone by the exact
 * rule.  One core, MLPerf pool1 (32 x 128^3): 53 ms before (eight stride-2 reads per
 * output), see docs/PERFORMANCE.md. */
__attribute__((target_clones("avx512f", "avx2", "default")))
static void pool_row(const float *r[4], float *yr, signed char *ar, int ws) {
    for (int w0 = 0; w0 < ws; w0 += SPAN) {
        const int n = ws - w0 < SPAN ? ws - w0 : SPAN;
        float col[2 * SPAN];
        int row[2 * SPAN];  /* as wide as the floats: one vector lane each */
        int unordered = 0;
        const float *r0 = r[0] + 2 * w0, *r1 = r[1] + 2 * w0;
        const float *r2 = r[2] + 2 * w0, *r3 = r[3] + 2 * w0;
        for (int i = 0; i < 2 * n; i++) {
            const float v0 = r0[i], v1 = r1[i], v2 = r2[i], v3 = r3[i];
            float best = v0;
            int q = 0;
            if (v1 > best) { best = v1; q = 1; }
            if (v2 > best) { best = v2; q = 2; }
            if (v3 > best) { best = v3; q = 3; }
            col[i] = best;
            row[i] = q;
            unordered |= (v0 != v0) | (v1 != v1) | (v2 != v2) | (v3 != v3);
        }
        for (int w = 0; w < n; w++) {
            const float v0 = col[2 * w], v1 = col[2 * w + 1];
            const int q0 = row[2 * w], q1 = row[2 * w + 1];
            const int second = v1 > v0 || (v1 == v0 && q1 < q0);
            yr[w0 + w] = second ? v1 : v0;
            ar[w0 + w] = (signed char)(second ? 2 * q1 + 1 : 2 * q0);
        }
        if (unordered)
            for (int w = 0; w < n; w++) window_exact(r, w0 + w, &yr[w0 + w], &ar[w0 + w]);
    }
}

void cosmotrain_maxpool2_forward(
        const float *x, long x_c, long x_d, long x_h,
        float *y, signed char *arg, long y_c, long y_d, long y_h,
        int channels, int zs, int hs, int ws) {
    for (int c = 0; c < channels; c++)
    for (int z = 0; z < zs; z++)
    for (int h = 0; h < hs; h++) {
        const float *r[4];
        for (int a = 0; a < 2; a++)
            for (int b = 0; b < 2; b++)
                r[2 * a + b] = x + c * x_c + (2 * z + a) * x_d + (2 * h + b) * x_h;
        pool_row(r, y + c * y_c + z * y_d + h * y_h, arg + c * y_c + z * y_d + h * y_h, ws);
    }
}

/* Every input element once: dy at its window's argmax, 0 elsewhere.  Per output row,
 * each window's gradient and "tap - e" are spread over its two columns once; the four
 * input rows are then contiguous selects. */
__attribute__((target_clones("avx512f", "avx2", "default")))
static void unpool_row(float *r[4], const float *gr, const signed char *ar, int ws) {
    for (int w0 = 0; w0 < ws; w0 += SPAN) {
        const int n = ws - w0 < SPAN ? ws - w0 : SPAN;
        float g[2 * SPAN];
        int tap[2 * SPAN];  /* k - e: equals 2 q where row q holds the winner */
        for (int w = 0; w < n; w++) {
            g[2 * w] = g[2 * w + 1] = gr[w0 + w];
            tap[2 * w] = ar[w0 + w];
            tap[2 * w + 1] = ar[w0 + w] - 1;
        }
        for (int q = 0; q < 4; q++) {
            float *out = r[q] + 2 * w0;
            for (int i = 0; i < 2 * n; i++) out[i] = tap[i] == 2 * q ? g[i] : 0.0f;
        }
    }
}

void cosmotrain_maxpool2_backward(
        const float *dy, const signed char *arg, long y_c, long y_d, long y_h,
        float *dx, long x_c, long x_d, long x_h,
        int channels, int zs, int hs, int ws) {
    for (int c = 0; c < channels; c++)
    for (int z = 0; z < zs; z++)
    for (int h = 0; h < hs; h++) {
        float *r[4];
        for (int a = 0; a < 2; a++)
            for (int b = 0; b < 2; b++)
                r[2 * a + b] = dx + c * x_c + (2 * z + a) * x_d + (2 * h + b) * x_h;
        unpool_row(r, dy + c * y_c + z * y_d + h * y_h, arg + c * y_c + z * y_d + h * y_h,
                   ws);
    }
}
