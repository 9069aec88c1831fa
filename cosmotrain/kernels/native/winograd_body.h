/* Winograd F(m,3) along W, m = 2 or 4, included by direct.c after direct_body.h (whose
 * register blocks it reuses) once per instruction set.
 *
 * Input tiles of m + 2 along W with stride m give m + 2 component planes (B^T; F(2,3):
 * d0-d2, d1+d2, d2-d1, d1-d3), stored flat: rows of T = ceil(wo/m) tiles with no padding
 * along W, so a kernel row shift is a shift by T and register runs sweep whole planes
 * (narrow layers waste nothing).  Layout of a chunk's components in `work`:
 * [m + 2][c_in][depth][hp * T], then RUN zeros (the last run reads past the end). */

static void CAT(input_components, SUFFIX)(
        const float *s, long s_c, long s_d, long s_h,
        int c_in, int depth, int hp, int tiles, int m, float *work) {
    const long plane = (long)hp * tiles, channel = depth * plane;
    const long component = c_in * channel;
    for (int c = 0; c < c_in; c++)
    for (int d = 0; d < depth; d++)
    for (int r = 0; r < hp; r++) {
        const float *row = s + c * s_c + d * s_d + r * s_h;
        float *v[6];
        v[0] = work + c * channel + d * plane + r * tiles;
        for (int i = 1; i < m + 2; i++) v[i] = v[i - 1] + component;
        if (m == 2) {
            for (int t = 0; t < tiles; t++) {
                const float *x = row + 2 * t;
                v[0][t] = x[0] - x[2];
                v[1][t] = x[1] + x[2];
                v[2][t] = x[2] - x[1];
                v[3][t] = x[1] - x[3];
            }
            continue;
        }
        for (int t = 0; t < tiles; t++) {  /* F(4,3): points 0, 1, -1, 2, -2, infinity */
            const float *x = row + 4 * t;
            v[0][t] = 4.0f * x[0] - 5.0f * x[2] + x[4];
            v[1][t] = -4.0f * (x[1] + x[2]) + x[3] + x[4];
            v[2][t] = 4.0f * (x[1] - x[2]) - x[3] + x[4];
            v[3][t] = 2.0f * (x[3] - x[1]) - x[2] + x[4];
            v[4][t] = 2.0f * (x[1] - x[3]) - x[2] + x[4];
            v[5][t] = 4.0f * x[1] - 5.0f * x[3] + x[5];
        }
    }
    for (int i = 0; i < RUN; i++) work[(m + 2) * component + i] = 0.0f;
}

/* One output tile from its component sums q[i] (A^T), `valid` of its m outputs written. */
static inline void CAT(output_tile, SUFFIX)(float *out, const float *q, int m, int valid,
                                            float bias) {
    if (m == 2) {
        out[0] = q[0] + q[1] + q[2] + bias;
        if (valid > 1) out[1] = q[1] - q[2] - q[3] + bias;
        return;
    }
    const float sum12 = q[1] + q[2], diff12 = q[1] - q[2];
    const float sum34 = q[3] + q[4], diff34 = q[3] - q[4];
    const float y[4] = {q[0] + sum12 + sum34 + bias, diff12 + 2.0f * diff34 + bias,
                        sum12 + 4.0f * sum34 + bias, diff12 + 8.0f * diff34 + q[5] + bias};
    for (int j = 0; j < valid; j++) out[j] = y[j];
}

/* y = conv(s, w) for kernels of width 3, unit stride, with (m + 2) * 9 multiplications
 * per m outputs instead of 27 m (F(2,3): 1.5x fewer, F(4,3): 2x): each component plane
 * is convolved over (C, D, H) with its transformed kernel up[i] (G g: F(2,3) g0,
 * (g0+g1+g2)/2, (g0-g1+g2)/2, g2) packed as (blocks, C, kd, kh, FB), and the outputs are
 * A^T of the sums.  work: (m + 2) * c_in * depth * hp * T + RUN floats.  The slab's rows
 * hold m T + 2 floats. */
void CAT(cosmotrain_winograd_w_forward, SUFFIX)(
        const float *s, long s_c, long s_d, long s_h,
        int c_in, int kd, int kh,
        const float *up, int filters, const float *bias,
        float *y, long y_f, long y_d, long y_h,
        int nz, int ho, int wo, float *work, int m) {
    const int tiles = (wo + m - 1) / m, depth = nz + kd - 1, hp = ho + kh - 1;
    const long plane = (long)hp * tiles, channel = depth * plane;
    const long component = c_in * channel;
    CAT(input_components, SUFFIX)(s, s_c, s_d, s_h, c_in, depth, hp, tiles, m, work);
    const int blocks = (filters + FB - 1) / FB;
    const long block_size = (long)c_in * kd * kh * FB;
    const long outputs = (long)ho * tiles;
    for (int z = 0; z < nz; z++)
    for (long p0 = 0; p0 < outputs; p0 += RUN) {
        const int n = outputs - p0 < RUN ? (int)(outputs - p0) : RUN;
        long where[RUN];  /* each tile's first output in its plane: m t + h * y_h */
        int valid[RUN];   /* and how many of its m outputs lie inside the row */
        for (int k = 0, h = (int)(p0 / tiles), t = (int)(p0 % tiles); k < n; k++) {
            where[k] = h * y_h + m * t;
            valid[k] = wo - m * t < m ? wo - m * t : m;
            if (++t == tiles) { t = 0; h++; }
        }
        for (int fb = 0; fb < blocks; fb++) {  /* the run's components stay in cache */
            const int nf = filters - fb * FB < FB ? filters - fb * FB : FB;
            float q[FB][RUN][6];
            for (int i = 0; i < m + 2; i++) {
                VEC acc[FB][WV];  /* a local block: kept in registers over all taps */
                CAT(forward_block, SUFFIX)(acc, up + (i * blocks + fb) * block_size,
                                           work + i * component + z * plane + p0,
                                           channel, plane, tiles, c_in, kd, kh, 1);
                for (int f = 0; f < FB; f++) {
                    float lanes[RUN];
                    __builtin_memcpy(lanes, acc[f], sizeof lanes);
                    for (int k = 0; k < RUN; k++) q[f][k][i] = lanes[k];
                }
            }
            for (int f = 0; f < nf; f++) {
                const int o = fb * FB + f;
                const float b0 = bias ? bias[o] : 0.0f;
                float *yz = y + o * y_f + z * y_d;
                for (int k = 0; k < n; k++)
                    CAT(output_tile, SUFFIX)(yz + where[k], q[f][k], m, valid[k], b0);
            }
        }
    }
}

/* Filter gradient of the same form, g[f][c][a][b][e] += dL/dw for kernels of width 3:
 * the transpose of y_j = sum_i A^T[j][i] (G[i] . g) V_i gives
 *     dL/dg_e = sum_i G[i][e] M_i,  M_i[f][c][a][b] = sum_{z,p} D_i[f][z][p] V_i[c][z+a][p + b T]
 * with the dy components D_0 = dy0, D_1 = dy0 + dy1, D_2 = dy0 - dy1, D_3 = -dy1 of each
 * output pair (dy1 = 0 past an odd wo): 4 products per pair and tap instead of 6.  The
 * M_i are the plain filter gradient's register blocks over flat planes (taps b a shift by
 * T apart), in segments of about TILE outputs (part of a plane, or the whole planes of a
 * few z) whose D_i are packed per filter block.
 * work: 4 * c_in * depth * hp * T + RUN floats (components), then 4 * filters * nz *
 * roundup(ho * T, VL) (D) and 4 * filters * c_in * kd * kh (M). */
int CAT(cosmotrain_winograd_w_filter_grad, SUFFIX)(
        const float *s, long s_c, long s_d, long s_h,
        int c_in, int kd, int kh,
        const float *dy, long dy_f, long dy_d, long dy_h, int filters,
        float *g, int nz, int ho, int wo, float *work) {
    const int tiles = (wo + 1) / 2, depth = nz + kd - 1, hp = ho + kh - 1;
    const long plane = (long)hp * tiles, channel = depth * plane;
    const long component = c_in * channel;
    CAT(input_components, SUFFIX)(s, s_c, s_d, s_h, c_in, depth, hp, tiles, 2, work);
    const int vectors = (int)(((long)ho * tiles + VL - 1) / VL);
    const long dplane = (long)vectors * VL, dcomp = (long)filters * nz * dplane;
    float *dt = work + 4 * component + RUN;
    for (int f = 0; f < filters; f++)
    for (int z = 0; z < nz; z++) {
        float *out = dt + (f * nz + z) * dplane;
        for (int h = 0; h < ho; h++) {
            const float *row = dy + f * dy_f + z * dy_d + h * dy_h;
            for (int t = 0; t < tiles; t++) {
                const float d0 = row[2 * t], d1 = 2 * t + 1 < wo ? row[2 * t + 1] : 0.0f;
                const long p = (long)h * tiles + t;
                out[p] = d0;
                out[dcomp + p] = d0 + d1;
                out[2 * dcomp + p] = d0 - d1;
                out[3 * dcomp + p] = -d1;
            }
        }
        for (long p = (long)ho * tiles; p < dplane; p++)
            for (int i = 0; i < 4; i++) out[i * dcomp + p] = 0.0f;
    }
    const long taps = (long)c_in * kd * kh;
    float *m = dt + 4 * dcomp;
    for (long k = 0; k < 4 * filters * taps; k++) m[k] = 0.0f;
    /* Segments of about TILE outputs: part of a plane, or whole planes of a few z. */
    int seg = TILE / VL;
    if (seg < 1) seg = 1;
    const int vseg = vectors < seg ? vectors : seg;
    int zrows = vectors < seg ? seg / vectors : 1;
    if (zrows > nz) zrows = nz;
    float *pack = aligned_alloc(64, sizeof(float) * FB * VL * (size_t)(zrows * vseg));
    if (!pack) return -1;  /* the caller raises MemoryError: no partial gradient */
    for (int z = 0; z < nz; z += zrows)
    for (int v0 = 0; v0 < vectors; v0 += vseg) {
        const int nzr = nz - z < zrows ? nz - z : zrows;
        const int nv = vectors - v0 < vseg ? vectors - v0 : vseg;
        for (int i = 0; i < 4; i++)
        for (int f0 = 0; f0 < filters; f0 += FB) {
            const int nf = filters - f0 < FB ? filters - f0 : FB;
            for (int r = 0; r < nzr; r++)
                for (int v = 0; v < nv; v++)
                    for (int f = 0; f < FB; f++)
                        __builtin_memcpy(pack + ((r * nv + v) * FB + f) * VL,
                                         dt + i * dcomp
                                            + ((f0 + (f < nf ? f : 0)) * nz + z + r) * dplane
                                            + (long)(v0 + v) * VL, sizeof(VEC));
            for (int c = 0; c < c_in; c++)
            for (int a = 0; a < kd; a++)
            for (int b0 = 0; b0 < kh; b0 += 3) {
                const int nb = kh - b0 < 3 ? kh - b0 : 3;
                const float *row0 = work + i * component + c * channel + (z + a) * plane
                                    + (long)b0 * tiles + (long)v0 * VL;
                VEC acc[FB][3];
                CAT(tap_blocks, SUFFIX)(acc, pack, row0, plane, nzr, nv, nb, tiles);
                const long tap = ((long)c * kd + a) * kh + b0;
                for (int f = 0; f < nf; f++)
                    for (int b = 0; b < nb; b++)
                        m[(i * filters + f0 + f) * taps + tap + b] +=
                            CAT(lane_sum, SUFFIX)(acc[f][b]);
            }
        }
    }
    free(pack);
    for (int f = 0; f < filters; f++)
    for (long k = 0; k < taps; k++) {
        const float m0 = m[f * taps + k], m1 = m[(filters + f) * taps + k];
        const float m2 = m[(2 * filters + f) * taps + k], m3 = m[(3 * filters + f) * taps + k];
        float *out = g + (f * taps + k) * 3;
        out[0] += m0 + 0.5f * (m1 + m2);
        out[1] += 0.5f * (m1 - m2);
        out[2] += m3 + 0.5f * (m1 + m2);
    }
    return 0;
}
