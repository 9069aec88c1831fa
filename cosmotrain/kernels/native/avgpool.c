/* Average pooling, zero padding counted (divisor kd*kh*kw everywhere, the CosmoFlow
 * k3 s2 p1 pooling), float32, forward and backward, any kernel, stride and asymmetric
 * padding.
 *
 * Why in C: the numpy kernel (pool3d.py) sums its windows separably with strided slice
 * operations; on the paper network's first pooling (16 x 128^3 floats a sample) it took
 * 30 ms forward and 66 ms backward of a 0.5 s step.  Here each output row sums its
 * kd x kh input rows into a row buffer (contiguous adds) and then its kw taps along W;
 * the backward gathers, for each input row, the output rows whose windows hold it, then
 * adds them along W tap by tap.  Each output (input gradient) element sums its terms in one fixed
 * order (depth taps, then rows, then W taps, each ascending) whatever part of the
 * volume a call covers: slabs of planes give the results of one call, bit for bit.
 *
 * Strides in elements; rows contiguous along W.  row: scratch of max(w_in, wo) floats. */

#pragma GCC optimize("O3")

static void add_row(float *dst, const float *src, int n, int first) {
    if (first)
        for (int i = 0; i < n; i++) dst[i] = src[i];
    else
        for (int i = 0; i < n; i++) dst[i] += src[i];
}

void cosmotrain_avgpool_forward(
        const float *x, long x_c, long x_d, long x_h,
        float *y, long y_c, long y_d, long y_h, int channels,
        int kd, int kh, int kw, int sd, int sh, int sw, int dl, int hl, int wl,
        int d_in, int h_in, int w_in, int z0, int z1, int ho, int wo,
        float scale, float *row) {
    for (int c = 0; c < channels; c++)
    for (int z = z0; z < z1; z++)
    for (int h = 0; h < ho; h++) {
        int first = 1;
        for (int a = 0; a < kd; a++) {
            const int p = z * sd + a - dl;
            if (p < 0 || p >= d_in) continue;
            for (int b = 0; b < kh; b++) {
                const int r = h * sh + b - hl;
                if (r < 0 || r >= h_in) continue;
                add_row(row, x + c * x_c + p * x_d + r * x_h, w_in, first);
                first = 0;
            }
        }
        float *out = y + c * y_c + (z - z0) * y_d + h * y_h;
        for (int w = 0; w < wo; w++) {
            float total = 0.0f;
            if (!first)
                for (int e = 0; e < kw; e++) {
                    const int i = w * sw + e - wl;
                    if (i >= 0 && i < w_in) total += row[i];
                }
            out[w] = total * scale;
        }
    }
}

void cosmotrain_avgpool_backward(
        const float *dy, long y_c, long y_d, long y_h,
        float *dx, long x_c, long x_d, long x_h, int channels,
        int kd, int kh, int kw, int sd, int sh, int sw, int dl, int hl, int wl,
        int d_out, int h_out, int w_out, int p0, int p1, int h_in, int w_in,
        float scale, float *row) {
    for (int c = 0; c < channels; c++)
    for (int p = p0; p < p1; p++)
    for (int r = 0; r < h_in; r++) {
        int first = 1;
        for (int a = 0; a < kd; a++) {
            const int zq = p + dl - a;
            if (zq < 0 || zq % sd) continue;
            const int z = zq / sd;
            if (z >= d_out) continue;
            for (int b = 0; b < kh; b++) {
                const int hq = r + hl - b;
                if (hq < 0 || hq % sh) continue;
                const int h = hq / sh;
                if (h >= h_out) continue;
                add_row(row, dy + c * y_c + z * y_d + h * y_h, w_out, first);
                first = 0;
            }
        }
        float *out = dx + c * x_c + (p - p0) * x_d + r * x_h;
        for (int w = 0; w < w_in; w++) out[w] = 0.0f;
        if (first) continue;
        for (int e = 0; e < kw; e++) {  /* out[j*sw + e - wl] += row[j], taps ascending */
            int j0 = 0, j1 = w_out;
            while (j0 < j1 && j0 * sw + e - wl < 0) j0++;
            while (j1 > j0 && (j1 - 1) * sw + e - wl >= w_in) j1--;
            float *o = out + e - wl;
            for (int j = j0; j < j1; j++) o[j * sw] += row[j];
        }
        for (int w = 0; w < w_in; w++) out[w] *= scale;
    }
}
