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

/* One row of outputs: taps in offset order, each a branch-free "strictly greater" select
 * over SPAN outputs (what the compiler vectorises); a row that met a NaN is redone by
 * the exact rule. */
__attribute__((target_clones("avx512f", "avx2", "default")))
static void pool_row(const float *r[4], float *yr, signed char *ar, int ws) {
    for (int w0 = 0; w0 < ws; w0 += SPAN) {
        const int n = ws - w0 < SPAN ? ws - w0 : SPAN;
        float best[SPAN];
        int k[SPAN];  /* as wide as the floats: one vector lane each */
        int unordered = 0;
        for (int w = 0; w < n; w++) {
            best[w] = r[0][2 * (w0 + w)];
            k[w] = 0;
            unordered |= best[w] != best[w];
        }
        for (int j = 1; j < 8; j++) {
            const float *row = r[j >> 1] + 2 * w0 + (j & 1);
            for (int w = 0; w < n; w++) {
                const float v = row[2 * w];
                const int greater = v > best[w];
                best[w] = greater ? v : best[w];
                k[w] = greater ? j : k[w];
                unordered |= v != v;
            }
        }
        for (int w = 0; w < n; w++) { yr[w0 + w] = best[w]; ar[w0 + w] = (signed char)k[w]; }
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
        const float *gr = dy + c * y_c + z * y_d + h * y_h;
        const signed char *ar = arg + c * y_c + z * y_d + h * y_h;
        for (int w = 0; w < ws; w++) {
            const int k = ar[w];
            for (int j = 0; j < 8; j++)
                r[j >> 1][2 * w + (j & 1)] = j == k ? gr[w] : 0.0f;
        }
    }
}
