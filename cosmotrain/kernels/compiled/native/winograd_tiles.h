/* The Winograd F(m,3) tile transforms along W, m = 2 or 4, VL tiles at a time in
 * vector registers, for winograd_body.h (included there, once per instruction set,
 * after direct_body.h, whose VEC, load and mask it uses):
 *   - input_components: B^T of the input tiles into the m + 2 component planes;
 *   - the dy components of the filter gradient (A of the output gradients);
 *   - output_tiles / store_tiles: A^T of the component sums, interleaved into outputs.
 * Each is one vector expression for every tile (rows too short for a vector share one
 * with the next rows), so a tile's bits do not depend on where the chunking puts it. */

/* p[j][t] = x[m t + j] for t < VL, j < m + 2 (j < m without `overlap`): the inputs of
 * VL consecutive tiles by their place in the tile (m VL floats read from x, and 2 more
 * with `overlap`), split by vector shuffles. */
static inline void CAT(tile_inputs, SUFFIX)(VEC p[6], const float *x, int m, int overlap) {
#if VL == 16
    const CAT(mask, SUFFIX) even = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
    const CAT(mask, SUFFIX) odd = {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};
    const CAT(mask, SUFFIX) quarter[4] = {
        {0, 4, 8, 12, 16, 20, 24, 28, 0, 0, 0, 0, 0, 0, 0, 0},
        {1, 5, 9, 13, 17, 21, 25, 29, 0, 0, 0, 0, 0, 0, 0, 0},
        {2, 6, 10, 14, 18, 22, 26, 30, 0, 0, 0, 0, 0, 0, 0, 0},
        {3, 7, 11, 15, 19, 23, 27, 31, 0, 0, 0, 0, 0, 0, 0, 0}};
    const CAT(mask, SUFFIX) join = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
    const CAT(mask, SUFFIX) next = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16};
#else
    const CAT(mask, SUFFIX) even = {0, 2, 4, 6, 8, 10, 12, 14};
    const CAT(mask, SUFFIX) odd = {1, 3, 5, 7, 9, 11, 13, 15};
    const CAT(mask, SUFFIX) quarter[4] = {{0, 4, 8, 12, 0, 0, 0, 0}, {1, 5, 9, 13, 0, 0, 0, 0},
                                          {2, 6, 10, 14, 0, 0, 0, 0}, {3, 7, 11, 15, 0, 0, 0, 0}};
    const CAT(mask, SUFFIX) join = {0, 1, 2, 3, 8, 9, 10, 11};
    const CAT(mask, SUFFIX) next = {1, 2, 3, 4, 5, 6, 7, 8};
#endif
    VEC a[4];
    for (int i = 0; i < m; i++) a[i] = CAT(load, SUFFIX)(x + i * VL);
    if (m == 2) {
        p[0] = __builtin_shuffle(a[0], a[1], even);
        p[1] = __builtin_shuffle(a[0], a[1], odd);
    } else {
        for (int j = 0; j < 4; j++)
            p[j] = __builtin_shuffle(__builtin_shuffle(a[0], a[1], quarter[j]),
                                     __builtin_shuffle(a[2], a[3], quarter[j]), join);
    }
    if (!overlap)
        return;
    const VEC zero = {0};  /* the last tile's inputs m and m + 1: the next tile's 0 and 1 */
    p[m] = __builtin_shuffle(p[0], zero + x[m * VL], next);
    p[m + 1] = __builtin_shuffle(p[1], zero + x[m * VL + 1], next);
}

/* out[i * stride + l] = v[i][l] for i < count, l < n (n <= VL): components of n tiles. */
static inline void CAT(store_lanes, SUFFIX)(float *out, long stride, const VEC *v, int count,
                                            int n) {
    for (int i = 0; i < count; i++) {
        if (n == VL)
            __builtin_memcpy(out + i * stride, &v[i], sizeof(VEC));
        else
            __builtin_memcpy(out + i * stride, &v[i], sizeof(float) * n);
    }
}

/* The input transform (B^T) of VL tiles from their inputs p (tile_inputs): v[i] =
 * component i of each tile (lane t). */
static inline void CAT(components_of, SUFFIX)(VEC v[6], const VEC p[6], int m) {
    if (m == 2) {
        v[0] = p[0] - p[2];
        v[1] = p[1] + p[2];
        v[2] = p[2] - p[1];
        v[3] = p[1] - p[3];
        return;
    }
    /* F(4,3): points 0, 1, -1, 2, -2, infinity */
    v[0] = 4.0f * p[0] - 5.0f * p[2] + p[4];
    v[1] = -4.0f * (p[1] + p[2]) + p[3] + p[4];
    v[2] = 4.0f * (p[1] - p[2]) - p[3] + p[4];
    v[3] = 2.0f * (p[3] - p[1]) - p[2] + p[4];
    v[4] = 2.0f * (p[1] - p[3]) - p[2] + p[4];
    v[5] = 4.0f * p[1] - 5.0f * p[3] + p[5];
}

/* The input transform of VL tiles of one row (m VL + 2 floats at x). */
static inline void CAT(tile_components, SUFFIX)(VEC v[6], const float *x, int m) {
    VEC p[6];
    CAT(tile_inputs, SUFFIX)(p, x, m, 1);
    CAT(components_of, SUFFIX)(v, p, m);
}

/* Rows of fewer than VL tiles, g = VL / T whole rows a vector: rows[k] (NULL: a row of
 * the padding, zeros) is laid end to end in a zeroed buffer, m T floats each, and the
 * last tile of each row takes its own row's inputs m T and m T + 1 rather than the next
 * row's first two.  out[i * component + k T + t] gets component i of row k's tile t, for
 * n <= g rows: rows of a plane follow each other in the component planes. */
static inline void CAT(short_rows_components, SUFFIX)(float *out, long component,
                                                       const float *const *rows, int n,
                                                       int tiles, int m) {
    float x[4 * VL + 2] = {0};
    float last[VL][2] = {{0}};
    for (int k = 0; k < n; k++) {
        if (!rows[k]) continue;
        for (int i = 0; i < m * tiles; i++) x[k * m * tiles + i] = rows[k][i];
        last[k][0] = rows[k][m * tiles];
        last[k][1] = rows[k][m * tiles + 1];
    }
    VEC p[6], v[6];
    CAT(tile_inputs, SUFFIX)(p, x, m, 1);
    for (int k = 0; k < n; k++) {
        p[m][(k + 1) * tiles - 1] = last[k][0];
        p[m + 1][(k + 1) * tiles - 1] = last[k][1];
    }
    CAT(components_of, SUFFIX)(v, p, m);
    CAT(store_lanes, SUFFIX)(out, component, v, m + 2, n * tiles);
}

/* Row (d, r) of channel c of a chunk's input window: len floats, column k being input
 * (d0 + d, h0 + r, w0 + k) of the sample at `base`, described by win[] = {stride c,
 * stride d, stride h, origin d0, h0, w0, extents D, H, W}.  NULL for a row wholly in the
 * padding (zero components: B^T 0 = 0); the row where it lies when it is inside the
 * input; else a copy into `padded` with zeros in the W padding. */
static inline const float *CAT(window_row, SUFFIX)(const float *base, const long *win,
                                                    int c, int d, int r, int len,
                                                    float *padded) {
    const long sd = win[3] + d, sr = win[4] + r, w0 = win[5], nw = win[8];
    if (sd < 0 || sd >= win[6] || sr < 0 || sr >= win[7]) return NULL;
    const float *source = base + c * win[0] + sd * win[1] + sr * win[2];
    if (w0 >= 0 && w0 + len <= nw) return source + w0;
    for (int k = 0; k < len; k++)
        padded[k] = w0 + k >= 0 && w0 + k < nw ? source[w0 + k] : 0.0f;
    return padded;
}

/* input_components for rows of fewer than VL tiles (8^3 and 16^3 planes, 32-wide rows
 * under F(4,3)): VL / T rows a vector (short_rows_components).  Against a scalar loop
 * per tile: the paper network's conv3 (32^3) forward / data / filter gradient 8.1 / 9.9
 * / 9.8 -> 7.8 / 9.7 / 9.3 ms (2 threads, 2026-11-27). */
static void CAT(short_input_components, SUFFIX)(const float *base, const long *win,
                                                 int c_in, int depth, int hp, int tiles,
                                                 int m, float *work) {
    const long plane = (long)hp * tiles, channel = depth * plane;
    const long component = c_in * channel;
    const int group = VL / tiles;
    const float *rows[VL];
    float padded[VL][4 * VL + 2];
    for (int c = 0; c < c_in; c++)
    for (int d = 0; d < depth; d++)
    for (int r0 = 0; r0 < hp; r0 += group) {
        const int n = hp - r0 < group ? hp - r0 : group;
        for (int k = 0; k < n; k++)
            rows[k] = CAT(window_row, SUFFIX)(base, win, c, d, r0 + k, m * tiles + 2, padded[k]);
        CAT(short_rows_components, SUFFIX)(work + c * channel + d * plane + r0 * tiles,
                                           component, rows, n, tiles, m);
    }
}

/* Every tile of the chunk's input window (window_row) into its m + 2 components, then
 * RUN zeros.  The window is read from the sample's input in place: rows inside the input
 * where they lie, rows reaching into the W padding from a zero-padded copy in L1.  (A
 * zero-padded slab copy of each chunk's input took 2.4 / 4.5 / 2.9 ms of the paper
 * network's conv2 forward / data / filter gradient, 20 / 26.5 / 21 ms, on each of 2
 * workers.)  A row's m T + 2 floats: at least VL tiles go VL tiles at a time, a last
 * group of fewer copied into a zero-padded row first (a scalar loop per tile was 7-13%
 * of those passes, perf); shorter rows go to short_input_components. */
static void CAT(input_components, SUFFIX)(
        const float *base, const long *win,
        int c_in, int depth, int hp, int tiles, int m, float *work) {
    const long plane = (long)hp * tiles, channel = depth * plane;
    const long component = c_in * channel;
    const int len = m * tiles + 2;  /* floats of a window row the tiles read */
    float tail[4 * VL + 2];
    float padded[len];
    for (int i = 0; i < RUN; i++) work[(m + 2) * component + i] = 0.0f;
    if (tiles < VL) {
        CAT(short_input_components, SUFFIX)(base, win, c_in, depth, hp, tiles, m, work);
        return;
    }
    for (int c = 0; c < c_in; c++)
    for (int d = 0; d < depth; d++)
    for (int r = 0; r < hp; r++) {
        float *out = work + c * channel + d * plane + r * tiles;
        const float *row = CAT(window_row, SUFFIX)(base, win, c, d, r, len, padded);
        if (!row) {
            for (int i = 0; i < m + 2; i++)
                for (int t = 0; t < tiles; t++) out[i * component + t] = 0.0f;
            continue;
        }
        for (int t = 0; t < tiles; t += VL) {
            const int n = tiles - t < VL ? tiles - t : VL;
            const float *x = row + (long)m * t;
            if (n < VL) {
                for (int i = 0; i < m * VL + 2; i++) tail[i] = i < m * n + 2 ? x[i] : 0.0f;
                x = tail;
            }
            VEC v[6];
            CAT(tile_components, SUFFIX)(v, x, m);
            CAT(store_lanes, SUFFIX)(out + t, component, v, m + 2, n);
        }
    }
}

/* The output transform (A^T) of VL consecutive tiles of one filter at once, lane l for
 * tile l: q[i * stride + l] is component i's sum; y[j] gets output j of each tile, plus
 * bias.  F(2,3): y0 = q0 + q1 + q2, y1 = q1 - q2 - q3; F(4,3): y0 = q0 + (q1 + q2) +
 * (q3 + q4), y1 = (q1 - q2) + 2 (q3 - q4), y2 = (q1 + q2) + 4 (q3 + q4), y3 = (q1 - q2) +
 * 8 (q3 - q4) + q5.  Every tile takes these same vector operations, whatever its place,
 * so its bits do not depend on the chunking or the rank's block. */
static inline void CAT(output_tiles, SUFFIX)(VEC y[4], const float *q, long stride, int m,
                                             float bias) {
    VEC v[6];
    for (int i = 0; i < 6; i++) v[i] = i < m + 2 ? CAT(load, SUFFIX)(q + i * stride) : (VEC){0};
    if (m == 2) {
        y[0] = v[0] + v[1] + v[2] + bias;
        y[1] = v[1] - v[2] - v[3] + bias;
        return;
    }
    const VEC sum12 = v[1] + v[2], diff12 = v[1] - v[2];
    const VEC sum34 = v[3] + v[4], diff34 = v[3] - v[4];
    y[0] = v[0] + sum12 + sum34 + bias;
    y[1] = diff12 + 2.0f * diff34 + bias;
    y[2] = sum12 + 4.0f * sum34 + bias;
    y[3] = diff12 + 8.0f * diff34 + v[5] + bias;
}

/* y[0..m) of VL tiles, interleaved tile by tile into m VL consecutive floats at out:
 * out[m t + j] = y[j][t] (F(2,3): one pass of pairs; F(4,3): pairs of pairs). */
static inline void CAT(store_tiles, SUFFIX)(float *out, const VEC y[4], int m) {
#if VL == 16
    const CAT(mask, SUFFIX) lo = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23};
    const CAT(mask, SUFFIX) hi = {8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
    const CAT(mask, SUFFIX) lo2 = {0, 1, 16, 17, 2, 3, 18, 19, 4, 5, 20, 21, 6, 7, 22, 23};
    const CAT(mask, SUFFIX) hi2 = {8, 9, 24, 25, 10, 11, 26, 27, 12, 13, 28, 29, 14, 15,
                                   30, 31};
#else
    const CAT(mask, SUFFIX) lo = {0, 8, 1, 9, 2, 10, 3, 11}, hi = {4, 12, 5, 13, 6, 14, 7, 15};
    const CAT(mask, SUFFIX) lo2 = {0, 1, 8, 9, 2, 3, 10, 11};
    const CAT(mask, SUFFIX) hi2 = {4, 5, 12, 13, 6, 7, 14, 15};
#endif
    const VEC a_lo = __builtin_shuffle(y[0], y[1], lo), a_hi = __builtin_shuffle(y[0], y[1], hi);
    if (m == 2) {
        __builtin_memcpy(out, &a_lo, sizeof(VEC));
        __builtin_memcpy(out + VL, &a_hi, sizeof(VEC));
        return;
    }
    const VEC b_lo = __builtin_shuffle(y[2], y[3], lo), b_hi = __builtin_shuffle(y[2], y[3], hi);
    const VEC out4[4] = {__builtin_shuffle(a_lo, b_lo, lo2), __builtin_shuffle(a_lo, b_lo, hi2),
                         __builtin_shuffle(a_hi, b_hi, lo2), __builtin_shuffle(a_hi, b_hi, hi2)};
    __builtin_memcpy(out, out4, sizeof out4);
}

/* The dy components of one tile from its m output gradients d (zeros past wo): F(2,3)
 * D = (d0, d0 + d1, d0 - d1, -d1), F(4,3) D_0 = d0, D_1,2 = (d0 + d2) +- (d1 + d3),
 * D_3,4 = (d0 + 4 d2) +- (2 d1 + 8 d3), D_5 = d3.  T: float or VEC. */
#define DY_COMPONENTS(T, D, d, m)                                                     \
    do {                                                                              \
        if ((m) == 2) {                                                               \
            D[0] = d[0], D[1] = d[0] + d[1], D[2] = d[0] - d[1], D[3] = -d[1];        \
            break;                                                                    \
        }                                                                             \
        const T even_ = d[0] + d[2], odd_ = d[1] + d[3];                              \
        const T even4_ = d[0] + 4.0f * d[2], odd8_ = 2.0f * d[1] + 8.0f * d[3];       \
        D[0] = d[0], D[1] = even_ + odd_, D[2] = even_ - odd_;                        \
        D[3] = even4_ + odd8_, D[4] = even4_ - odd8_, D[5] = d[3];                    \
    } while (0)

/* The dy components of rows of fewer than VL tiles, VL / T rows a vector: rows[k] of
 * n <= VL / T rows end to end, zeros past wo, into out[i dcomp + k T + t] (the rows of a
 * plane follow each other there). */
static void CAT(dy_short_rows, SUFFIX)(float *out, long dcomp, const float *const *rows,
                                       int n, int tiles, int wo, int m) {
    float x[4 * VL] = {0};
    const int width = wo < m * tiles ? wo : m * tiles;
    for (int k = 0; k < n; k++)
        for (int i = 0; i < width; i++) x[k * m * tiles + i] = rows[k][i];
    VEC d[6], D[6];  /* d: tile_inputs fills m of its 6 here */
    CAT(tile_inputs, SUFFIX)(d, x, m, 0);
    DY_COMPONENTS(VEC, D, d, m);
    CAT(store_lanes, SUFFIX)(out, dcomp, D, m + 2, n * tiles);
}

/* The same for a row of at least VL tiles, VL tiles at a time; the last group, when it
 * has fewer tiles or reaches past wo, from a copy zero-padded past wo (a scalar loop per
 * tile was about a fifth of the paper network's conv2 filter gradient, perf). */
static void CAT(dy_row_vectors, SUFFIX)(float *out, long dcomp, const float *row, int tiles,
                                        int wo, int m) {
    float tail[4 * VL];
    for (int t = 0; t < tiles; t += VL) {
        const int n = tiles - t < VL ? tiles - t : VL;
        const float *x = row + (long)m * t;
        if (n < VL || m * (t + VL) > wo) {
            for (int i = 0; i < m * VL; i++) tail[i] = m * t + i < wo ? x[i] : 0.0f;
            x = tail;
        }
        VEC d[6], D[6];  /* d: tile_inputs fills m of its 6 here */
        CAT(tile_inputs, SUFFIX)(d, x, m, 0);
        DY_COMPONENTS(VEC, D, d, m);
        CAT(store_lanes, SUFFIX)(out + t, dcomp, D, m + 2, n);
    }
}
#undef DY_COMPONENTS
