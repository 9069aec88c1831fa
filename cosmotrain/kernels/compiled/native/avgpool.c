/* Average pooling, zero padding counted (divisor kd*kh*kw everywhere, the CosmoFlow
 * k3 s2 p1 pooling), float32, forward and backward, any kernel, stride and asymmetric
 * padding.
 *
 * Why in C: the numpy kernel (pool3d.py) sums its windows separably with strided slice
 * operations; on the paper network's first pooling (16 x 128^3 floats a sample) it took
 * 30 ms forward and 50 ms backward of a 0.5 s step.  Here each output plane sums its
 * window's input planes row by row (contiguous adds), then each output its rows and W
 * taps; the backward gathers per input plane, then spreads along H and W.  Both add in
 * exactly numpy's order (see each function), so the results are its bits.
 *
 * Strides in elements; rows contiguous along W. */

#pragma GCC optimize("O3", "fp-contract=off")

#include <stdlib.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

/* Copy a finished row past the caches (16-byte streaming stores where the target is
 * aligned and the length whole vectors; a plain copy otherwise): see the backward. */
static void stream_row(float *out, const float *row, int len) {
#if defined(__SSE2__)
    if ((unsigned long)out % 16 == 0 && len % 4 == 0) {
        for (int i = 0; i < len; i += 4) _mm_stream_ps(out + i, _mm_loadu_ps(row + i));
        return;
    }
#endif
    for (int i = 0; i < len; i++) out[i] = row[i];
}

/* The outputs whose windows hold input i along one dimension, in the order numpy's
 * `_spread` (pool3d.py) adds them: for i's residue class mod s, the taps whose part
 * covers the whole class first, then the others, each in tap order.  `out` gets up to
 * k output indices; returns how many. */
static int spread_order(int k, int s, int lo, int n_in, int n_out, int i, int *out) {
    const int r = i % s, m = i / s, count = (n_in - r + s - 1) / s;
    int n = 0;
    for (int pass = 0; pass < 2; pass++)
        for (int e = 0; e < k; e++) {
            const int num = r + lo - e;
            if (((num % s) + s) % s) continue;
            const int q = (num - (((num % s) + s) % s)) / s;  /* floor division */
            const int m0 = q < 0 ? -q : 0, m1 = count < n_out - q ? count : n_out - q;
            const int full = m0 == 0 && m1 == count;
            if (m1 <= m0 || full != (pass == 0) || m < m0 || m >= m1) continue;
            out[n++] = m + q;
        }
    return n;
}

/* Left-to-right sum of the rows src + idx[t] * pitch (t < n) into dst, numpy's order of
 * additions; zeros when n == 0. */
static void sum_rows(float *dst, const float *src, long pitch, const int *idx, int n,
                     int len) {
    if (n == 0) {
        for (int i = 0; i < len; i++) dst[i] = 0.0f;
        return;
    }
    for (int i = 0; i < len; i++) dst[i] = src[idx[0] * pitch + i];
    for (int t = 1; t < n; t++)
        for (int i = 0; i < len; i++) dst[i] += src[idx[t] * pitch + i];
}

/* For every input index of one dimension, its contributing outputs in `_spread`'s order:
 * table[i * k + t], t < counts[i]. */
static void spread_table(int k, int s, int lo, int n_in, int n_out, int *table, int *counts) {
    for (int i = 0; i < n_in; i++)
        counts[i] = spread_order(k, s, lo, n_in, n_out, i, table + i * k);
}

static int floor_div(int a, int b) { return (a - (((a % b) + b) % b)) / b; }

/* The inputs in output j's window along one dimension, in the order numpy's `_window`
 * (pool3d.py) adds them: the taps whose part covers every output first, then the
 * others, each in tap order.  Returns how many (<= k) went into `out`. */
static int window_order(int k, int s, int lo, int n_in, int n_out, int j, int *out) {
    int n = 0;
    for (int pass = 0; pass < 2; pass++)
        for (int e = 0; e < k; e++) {
            const int j0 = -floor_div(e - lo, s) > 0 ? -floor_div(e - lo, s) : 0;
            int j1 = floor_div(n_in - 1 - e + lo, s) + 1;
            if (j1 > n_out) j1 = n_out;
            if (j1 <= j0) continue;
            const int full = j0 == 0 && j1 == n_out;
            if (full != (pass == 0) || j < j0 || j >= j1) continue;
            out[n++] = j * s + e - lo;
        }
    return n;
}

static void window_table(int k, int s, int lo, int n_in, int n_out, int *table, int *counts) {
    for (int j = 0; j < n_out; j++)
        counts[j] = window_order(k, s, lo, n_in, n_out, j, table + j * k);
}

/* Whether a window / spread table's row i holds exactly n entries base + off[q], in
 * order: the rows the vectorised stride-2 paths below may take. */
static int row_is(const int *table, const int *counts, int k, int i, int n, const int *off,
                  int base) {
    if (counts[i] != n) return 0;
    for (int q = 0; q < n; q++)
        if (table[i * k + q] != base + off[q]) return 0;
    return 1;
}

/* Left-to-right sum of v[idx[q]], q < n (0 when n == 0): the W taps of one output (its
 * window's column sums in `_window`'s order) and the W spread of one input column (its
 * outputs' values in `_spread`'s order). */
static inline float indexed_sum(const float *v, const int *idx, int n) {
    float total = n ? v[idx[0]] : 0.0f;
    for (int q = 1; q < n; q++) total += v[idx[q]];
    return total;
}

/* Stride 2: away from the edges every output takes the same taps relative to 2 w, in the
 * same order, so with the column sums split into even and odd columns its W stage is a
 * few contiguous adds, each output adding exactly what `indexed_sum` adds.  Outputs
 * lo <= w < hi qualify. */
typedef struct {
    int lo, hi, n, off[8];  /* tap q reads column 2 w + off[q] */
} Taps;

static Taps stride2_taps(int kw, int sw, int w_out, const int *wtab, const int *wn) {
    Taps taps = {0, 0, 0, {0}};
    if (sw != 2 || kw > 8 || w_out < 4) return taps;
    const int mid = w_out / 2;
    taps.n = wn[mid];
    for (int q = 0; q < taps.n; q++) taps.off[q] = wtab[mid * kw + q] - 2 * mid;
    taps.lo = taps.hi = mid;
    while (taps.lo > 0 && row_is(wtab, wn, kw, taps.lo - 1, taps.n, taps.off, 2 * (taps.lo - 1)))
        taps.lo--;
    while (taps.hi < w_out && row_is(wtab, wn, kw, taps.hi, taps.n, taps.off, 2 * taps.hi))
        taps.hi++;
    return taps;
}

static void window_taps(float *out, const float *rowsum, const Taps *taps, float *even,
                        float *odd, int w_in, float scale) {
    for (int i = 0; i < w_in / 2; i++) {
        even[i] = rowsum[2 * i];
        odd[i] = rowsum[2 * i + 1];
    }
    if (w_in % 2) even[w_in / 2] = rowsum[w_in - 1];
    const int lo = taps->lo, n = taps->hi - lo;
    float *o = out + lo;
    if (!taps->n) {
        for (int m = 0; m < n; m++) o[m] = 0.0f;
        return;
    }
    const float *src[8];
    for (int q = 0; q < taps->n; q++) {  /* column 2 w + off = 2 (w + floor(off / 2)) + parity */
        const int off = taps->off[q], half = off >= 0 ? off / 2 : -((1 - off) / 2);
        src[q] = (off - 2 * half ? odd : even) + lo + half;
    }
    for (int m = 0; m < n; m++) o[m] = src[0][m];
    for (int q = 1; q < taps->n; q++)
        for (int m = 0; m < n; m++) o[m] += src[q][m];
    for (int m = 0; m < n; m++) o[m] *= scale;
}

/* Forward, bit for bit numpy's (pool3d.avg_pool3d_forward): for each output plane the
 * input planes of its window are summed (in `_window`'s order on numpy's whole-volume
 * path, `whole`, else in ascending order as its plane-by-plane path does), then the
 * rows of each output row's window and the W taps, each in `_window`'s order, then
 * scaled.  Every output keeps that order on any block holding its window.
 * work: (h_in + 2) * w_in + 1 floats.  Returns -1 when out of memory. */
int cosmotrain_avgpool_forward(
        const float *x, long x_c, long x_d, long x_h,
        float *y, long y_c, long y_d, long y_h, int channels,
        int kd, int kh, int kw, int sd, int sh, int sw, int dl, int hl, int wl,
        int d_in, int h_in, int w_in, int d_out, int h_out, int w_out,
        float scale, float *work, int whole) {
    int *dtab = malloc(sizeof(int) * ((size_t)d_out * kd + (size_t)h_out * kh
                                      + (size_t)w_out * kw + d_out + h_out + w_out));
    if (!dtab) return -1;
    int *htab = dtab + (long)d_out * kd, *wtab = htab + (long)h_out * kh;
    int *dn = wtab + (long)w_out * kw, *hn = dn + d_out, *wn = hn + h_out;
    if (whole) {
        window_table(kd, sd, dl, d_in, d_out, dtab, dn);
    } else {
        for (int z = 0; z < d_out; z++) {  /* ascending: numpy's plane-by-plane path */
            dn[z] = 0;
            for (int a = 0; a < kd; a++) {
                const int p = z * sd + a - dl;
                if (p >= 0 && p < d_in) dtab[z * kd + dn[z]++] = p;
            }
        }
    }
    window_table(kh, sh, hl, h_in, h_out, htab, hn);
    window_table(kw, sw, wl, w_in, w_out, wtab, wn);
    float *plane = work, *rowsum = work + (long)h_in * w_in;
    float *even = rowsum + w_in, *odd = even + (w_in + 1) / 2;
    const Taps taps = stride2_taps(kw, sw, w_out, wtab, wn);
    for (int c = 0; c < channels; c++)
    for (int z = 0; z < d_out; z++) {
        const float *xc = x + c * x_c;
        const int *ps = dtab + z * kd, nplanes = dn[z];
        for (int r = 0; r < h_in; r++) {  /* the window's planes, summed row by row */
            float *dst = plane + (long)r * w_in;
            if (nplanes == 0) {
                for (int w = 0; w < w_in; w++) dst[w] = 0.0f;
                continue;
            }
            for (int w = 0; w < w_in; w++) dst[w] = xc[ps[0] * x_d + r * x_h + w];
            for (int q = 1; q < nplanes; q++)
                for (int w = 0; w < w_in; w++) dst[w] += xc[ps[q] * x_d + r * x_h + w];
        }
        for (int h = 0; h < h_out; h++) {
            /* the window's rows summed for every input column at once (contiguous), then
             * the W taps of those sums: each column's sum is the one numpy forms */
            sum_rows(rowsum, plane, w_in, htab + h * kh, hn[h], w_in);
            float *out = y + c * y_c + z * y_d + h * y_h;
            int w = 0;
            if (taps.hi > taps.lo) {
                for (; w < taps.lo; w++) out[w] = indexed_sum(rowsum, wtab + w * kw, wn[w]) * scale;
                window_taps(out, rowsum, &taps, even, odd, w_in, scale);
                w = taps.hi;
            }
            for (; w < w_out; w++) out[w] = indexed_sum(rowsum, wtab + w * kw, wn[w]) * scale;
        }
    }
    free(dtab);
    return 0;
}

/* Stride 2 (CosmoFlow's pooling): away from the edges every even input column takes the
 * same outputs relative to it, in the same order, and so does every odd one, so a row's
 * spread is two contiguous sums over the outputs and one interleaving store, each column
 * adding exactly what `indexed_sum` adds.  Pairs (2m, 2m + 1) for lo <= m < hi qualify. */
typedef struct {
    int lo, hi, n[2], off[2][8];
} Pairs;

static int pair_is(const int *wtab, const int *wn, int kw, const Pairs *pairs, int m) {
    return row_is(wtab, wn, kw, 2 * m, pairs->n[0], pairs->off[0], m)
           && row_is(wtab, wn, kw, 2 * m + 1, pairs->n[1], pairs->off[1], m);
}

static Pairs stride2_pairs(int kw, int sw, int w_in, const int *wtab, const int *wn) {
    Pairs pairs = {0, 0, {0, 0}, {{0}}};
    if (sw != 2 || kw > 8 || w_in < 8) return pairs;
    const int mid = w_in / 4;  /* the pair (2 mid, 2 mid + 1): interior */
    for (int e = 0; e < 2; e++) {
        const int i = 2 * mid + e;
        pairs.n[e] = wn[i];
        for (int q = 0; q < wn[i]; q++) pairs.off[e][q] = wtab[i * kw + q] - mid;
    }
    pairs.lo = pairs.hi = mid;
    while (pairs.lo > 0 && pair_is(wtab, wn, kw, &pairs, pairs.lo - 1)) pairs.lo--;
    while (2 * pairs.hi + 1 < w_in && pair_is(wtab, wn, kw, &pairs, pairs.hi)) pairs.hi++;
    return pairs;
}

static void spread_pairs(float *out, const float *t, const Pairs *pairs, float *even,
                         float *odd) {
    const int lo = pairs->lo, n = pairs->hi - lo;
    float *v[2] = {even, odd};
    for (int e = 0; e < 2; e++) {
        const int count = pairs->n[e];
        if (!count) {
            for (int m = 0; m < n; m++) v[e][m] = 0.0f;
            continue;
        }
        const float *first = t + lo + pairs->off[e][0];
        for (int m = 0; m < n; m++) v[e][m] = first[m];
        for (int q = 1; q < count; q++) {
            const float *next = t + lo + pairs->off[e][q];
            for (int m = 0; m < n; m++) v[e][m] += next[m];
        }
    }
    float *o = out + 2 * lo;
    for (int m = 0; m < n; m++) {
        o[2 * m] = even[m];
        o[2 * m + 1] = odd[m];
    }
}

/* Backward, bit for bit numpy's (pool3d.avg_pool3d_backward): per input plane the
 * output planes are summed (in `_spread`'s order on numpy's whole-volume path, `whole`,
 * else in ascending order as its plane-by-plane path does) and scaled (before the sum on
 * the whole path, after it otherwise, as numpy does), then spread along H and W in
 * `_spread`'s order.  Matching numpy's grouping matters beyond its bits: the spatial
 * layers add their halo gradients per dimension, and this separable order is what gives
 * one process's results on the splits (tests/test_hybrid_mpi.py).  The call covers all
 * d_in input planes.  `stream`: rows are finished in the work buffer and copied past the
 * caches (a gradient far larger than them, which its reader takes from memory anyway:
 * the paper network's pool1, 134 MB a sample; a plain store first reads each line it
 * writes).  `ya` (not NULL): the output of a LeakyReLU before the pooling (its input,
 * laid out as dx with the strides ya_c, ya_d, ya_h), whose backward then follows in the
 * same pass: each finished row times (ya > 0 ? up : down), native/activation.c's
 * products.  work: (h_out + 1) * w_out + 3 w_in floats.  Returns -1 when out of memory. */
int cosmotrain_avgpool_backward(
        const float *dy, long y_c, long y_d, long y_h,
        float *dx, long x_c, long x_d, long x_h, int channels,
        int kd, int kh, int kw, int sd, int sh, int sw, int dl, int hl, int wl,
        int d_out, int h_out, int w_out, int d_in, int h_in, int w_in,
        float scale, float *work, int whole, int stream,
        const float *ya, long ya_c, long ya_d, long ya_h, float up, float down) {
    int *ztab = malloc(sizeof(int) * ((size_t)d_in * kd + (size_t)h_in * kh + (size_t)w_in * kw
                                      + d_in + h_in + w_in));
    if (!ztab) return -1;
    int *htab = ztab + (long)d_in * kd, *wtab = htab + (long)h_in * kh;
    int *zn = wtab + (long)w_in * kw, *hn = zn + d_in, *wn = hn + h_in;
    if (whole) {
        spread_table(kd, sd, dl, d_in, d_out, ztab, zn);
    } else {
        for (int p = 0; p < d_in; p++) {  /* ascending: numpy's plane-by-plane path */
            zn[p] = 0;
            for (int z = 0; z < d_out; z++) {
                const int a = p + dl - z * sd;
                if (a >= 0 && a < kd) ztab[p * kd + zn[p]++] = z;
            }
        }
    }
    spread_table(kh, sh, hl, h_in, h_out, htab, hn);
    spread_table(kw, sw, wl, w_in, w_out, wtab, wn);
    float *g = work, *t = work + (long)h_out * w_out;
    float *even = t + w_out, *odd = even + w_in, *finished = odd + w_in;
    const Pairs pairs = stride2_pairs(kw, sw, w_in, wtab, wn);
    for (int c = 0; c < channels; c++)
    for (int p = 0; p < d_in; p++) {
        const int *zs = ztab + p * kd, nz = zn[p];
        const float *dyc = dy + c * y_c;
        for (int h = 0; h < h_out; h++) {
            float *gr = g + (long)h * w_out;
            if (!whole) {
                sum_rows(gr, dyc + h * y_h, y_d, zs, nz, w_out);
                for (int j = 0; j < w_out; j++) gr[j] *= scale;
                continue;
            }
            if (nz == 0) {  /* numpy scales dy first, then sums the planes */
                for (int j = 0; j < w_out; j++) gr[j] = 0.0f;
                continue;
            }
            for (int j = 0; j < w_out; j++) gr[j] = dyc[zs[0] * y_d + h * y_h + j] * scale;
            for (int q = 1; q < nz; q++)
                for (int j = 0; j < w_out; j++)
                    gr[j] += dyc[zs[q] * y_d + h * y_h + j] * scale;
        }
        for (int r = 0; r < h_in; r++) {
            sum_rows(t, g, w_out, htab + r * kh, hn[r], w_out);
            float *target = dx + c * x_c + p * x_d + r * x_h;
            float *out = stream ? finished : target;
            int w = 0;
            if (pairs.hi > pairs.lo) {
                for (; w < 2 * pairs.lo; w++) out[w] = indexed_sum(t, wtab + w * kw, wn[w]);
                spread_pairs(out, t, &pairs, even, odd);
                w = 2 * pairs.hi;
            }
            for (; w < w_in; w++) out[w] = indexed_sum(t, wtab + w * kw, wn[w]);
            if (ya) {
                const float *yr = ya + c * ya_c + p * ya_d + r * ya_h;
                for (w = 0; w < w_in; w++) out[w] = out[w] * (yr[w] > 0.0f ? up : down);
            }
            if (stream) stream_row(target, finished, w_in);
        }
    }
#if defined(__SSE2__)
    if (stream) _mm_sfence();  /* streamed stores are weakly ordered */
#endif
    free(ztab);
    return 0;
}
