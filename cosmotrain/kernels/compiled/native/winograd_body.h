/* Winograd F(m,3) along W, m = 2 or 4, included by direct.c after direct_body.h (whose
 * register blocks it reuses) once per instruction set.
 *
 * Input tiles of m + 2 along W with stride m give m + 2 component planes (B^T; F(2,3):
 * d0-d2, d1+d2, d2-d1, d1-d3), stored flat: rows of T = ceil(wo/m) tiles with no padding
 * along W, so a kernel row shift is a shift by T and register runs sweep whole planes
 * (narrow layers waste nothing).  Layout of a chunk's components in `work`:
 * [m + 2][c_in][depth][hp * T], then RUN zeros (the last run reads past the end). */

#include "winograd_tiles.h"

/* Register runs per chunk of the forward (see there): at most CHUNK_RUNS, and as many as
 * keep one component's inputs of the chunk (c_in kd (rows + kh - 1) T floats) within
 * CHUNK_BYTES.  One core, AVX-512, ms with 8 / 4 / 2 runs a chunk and before chunking
 * (one run): MLPerf conv2 forward 156 / 163 / 181 / 216 (c_in 32), conv2 data gradient
 * 198 / 181 / 184 / 214 (64), conv3 forward 73 / 69 / 72 / 80 (64), its data gradient
 * 96 / 88 / 81 / 83 (128); the budget: 200 KiB (conv3 forward 66 ms with 4 runs, data
 * gradient 83 with 2) against 232 (69 with 8, 86 with 4; conv4's data gradient, c_in 256,
 * 46 with 2 runs against 53 with 1). */
#define CHUNK_RUNS 8
#define CHUNK_BYTES (200L << 10)

/* Channels per pass of a register block over a run's component rows: 32 x 3 x 3 rows of
 * a run (128 B each with AVX-512) stay in L1 across the filter blocks' passes, while 64
 * channels' 72 KB did not: one core, 64^3 F(4,3), 64 -> 32 channels ran 27% slower per
 * product than 32 -> 64 (44.7 against 35.2 ms per 8 filters).  Blocks go in channel
 * order, each continuing the last's sums from q: the same products in the same order. */
#ifndef CHANNEL_BLOCK
#define CHANNEL_BLOCK 32
#endif

/* Runs per chunk of the forward: the most (up to CHUNK_RUNS) whose inputs of one
 * component fit in CHUNK_BYTES: c_in kd (rows + kh - 1) T floats within a plane, c_in
 * (planes + kd - 1) planes across planes.  A whole volume of at most CHUNK_RUNS runs is
 * one chunk whatever its inputs (8^3 planes: one run each, and every run read all of a
 * component's weights, 19 MB for MLPerf conv5). */
static int CAT(chunk_runs, SUFFIX)(int c_in, int kd, int kh, int tiles, long outputs,
                                   long plane, long total_runs) {
    if (total_runs <= CHUNK_RUNS) return (int)total_runs;
    int runs = 1;
    while (runs < CHUNK_RUNS) {
        const long positions = (runs + 1L) * RUN;
        const long floats = positions <= outputs
            ? (long)c_in * kd * ((positions + tiles - 1) / tiles + kh - 1) * tiles
            : (long)c_in * ((positions + outputs - 1) / outputs + kd - 1) * plane;
        if (floats * (long)sizeof(float) > CHUNK_BYTES) break;
        runs++;
    }
    return runs;
}

/* y = conv(x, w) for kernels of width 3, unit stride, with (m + 2) * 9 multiplications
 * per m outputs instead of 27 m (F(2,3): 1.5x fewer, F(4,3): 2x): each component plane
 * is convolved over (C, D, H) with its transformed kernel up[i] (G g: F(2,3) g0,
 * (g0+g1+g2)/2, (g0-g1+g2)/2, g2) packed as (blocks, C, kd, kh, FB), and the outputs are
 * A^T of the sums, plus bias, then LeakyReLU(slope) when `leaky` (as the direct forward;
 * y must then be C-contiguous per filter, as conv3d's output buffers are).
 * x: the sample's input at `base`, the chunk's window of it described by win[]
 * (input_components).  work: (m + 2) * c_in * depth * hp * T + RUN floats. */
void CAT(cosmotrain_winograd_w_forward, SUFFIX)(
        const float *base, const long *win,
        int c_in, int kd, int kh,
        const float *up, int filters, const float *bias,
        float *y, long y_f, long y_d, long y_h,
        int nz, int ho, int wo, float *work, int m, int leaky, float slope) {
    const int tiles = (wo + m - 1) / m, depth = nz + kd - 1, hp = ho + kh - 1;
    const long plane = (long)hp * tiles, channel = depth * plane;
    const long component = c_in * channel;
    CAT(input_components, SUFFIX)(base, win, c_in, depth, hp, tiles, m, work);
    const int blocks = (filters + FB - 1) / FB;
    const long block_size = (long)c_in * kd * kh * FB;
    const long outputs = (long)ho * tiles;
    /* Chunks of register runs (CHUNK_RUNS above), taken in (z, position) order across
     * planes: per filter block and component, one block of transformed weights
     * (c_in kd kh FB floats) serves every run of the chunk while it is in L1/L2, instead
     * of every component's weights being read again for each run (MLPerf conv4: 7 MB of
     * weights per run).  q holds the chunk's component sums until the output transform. */
    float q[FB][6][CHUNK_RUNS * RUN];
    long source[CHUNK_RUNS];       /* each run's first position in the flat components */
    long where[CHUNK_RUNS * RUN];  /* each tile's first output: z y_d + h y_h + m t */
    int valid[CHUNK_RUNS * RUN];   /* and how many of its m outputs lie inside the row */
    const long plane_runs = (outputs + RUN - 1) / RUN, total_runs = nz * plane_runs;
    const int runs_per_chunk = CAT(chunk_runs, SUFFIX)(c_in, kd, kh, tiles, outputs, plane,
                                                       total_runs);
    for (long r0 = 0; r0 < total_runs; r0 += runs_per_chunk) {
        const int runs = total_runs - r0 < runs_per_chunk ? (int)(total_runs - r0)
                                                          : runs_per_chunk;
        for (int r = 0; r < runs; r++) {
            const int z = (int)((r0 + r) / plane_runs);
            const long p0 = (r0 + r) % plane_runs * RUN;
            source[r] = z * plane + p0;
            for (int k = 0; k < RUN; k++) {
                const long p = p0 + k;
                const int h = (int)(p / tiles), t = (int)(p % tiles);
                where[r * RUN + k] = z * y_d + h * y_h + m * t;
                valid[r * RUN + k] = p >= outputs ? 0 : wo - m * t < m ? wo - m * t : m;
            }
        }
        for (int fb = 0; fb < blocks; fb++) {
            const int nf = filters - fb * FB < FB ? filters - fb * FB : FB;
            for (int i = 0; i < m + 2; i++)
            for (int c0 = 0; c0 < c_in; c0 += CHANNEL_BLOCK) {
                const int nc = c_in - c0 < CHANNEL_BLOCK ? c_in - c0 : CHANNEL_BLOCK;
                const float *wq = up + (i * blocks + fb) * block_size + (long)c0 * kd * kh * FB;
                for (int r = 0; r < runs; r++) {
                    VEC acc[FB][WV];  /* a local block: kept in registers over its taps */
                    if (c0 == 0) {
                        for (int f = 0; f < FB; f++)
                            for (int v = 0; v < WV; v++) acc[f][v] = (VEC){0};
                    } else {
                        for (int f = 0; f < FB; f++)
                            __builtin_memcpy(acc[f], &q[f][i][r * RUN], sizeof(float) * RUN);
                    }
                    CAT(forward_accumulate, SUFFIX)(acc, wq,
                                                    work + i * component + c0 * channel
                                                    + source[r], channel, plane, tiles, nc,
                                                    kd, kh, 1);
                    for (int f = 0; f < FB; f++)
                        __builtin_memcpy(&q[f][i][r * RUN], acc[f], sizeof(float) * RUN);
                }
            }
            for (int f = 0; f < nf; f++) {
                const int o = fb * FB + f;
                const float b0 = bias ? bias[o] : 0.0f;
                float *yo = y + o * y_f;
                long first = -1, end = 0;
                for (int k = 0; k < runs * RUN; k += VL) {
                    VEC out[4];
                    CAT(output_tiles, SUFFIX)(out, &q[f][0][k], CHUNK_RUNS * RUN, m, b0);
                    int whole = 1;  /* VL full tiles that follow each other in y */
                    for (int l = 0; l < VL; l++)
                        whole &= valid[k + l] == m && where[k + l] == where[k] + m * l;
                    if (whole) {
                        CAT(store_tiles, SUFFIX)(yo + where[k], out, m);
                    } else {
                        float lanes[4][VL];
                        __builtin_memcpy(lanes, out, sizeof(float) * VL * m);
                        for (int l = 0; l < VL; l++)  /* none past the plane's last tile */
                            for (int j = 0; j < valid[k + l]; j++)
                                yo[where[k + l] + j] = lanes[j][l];
                    }
                    for (int l = 0; l < VL; l++) {
                        if (!valid[k + l]) continue;
                        if (first < 0) first = where[k + l];
                        end = where[k + l] + valid[k + l];
                    }
                }
                /* The chunk's outputs of this filter: consecutive tiles of whole rows, one
                 * span of a C-contiguous y (y_h == wo, y_d == ho wo), still in cache.  Per
                 * tile instead (inside the loop above) the forward ran 30% slower. */
                if (leaky && first >= 0)
                    CAT(leaky_run, SUFFIX)(yo + first, (int)(end - first), slope);
            }
        }
    }
}

/* Filter gradient of the same form, g[f][c][a][b][e] += dL/dw for kernels of width 3:
 * the transpose of y_j = sum_i A^T[j][i] (G[i] . g) V_i gives
 *     dL/dg_e = sum_i G[i][e] M_i,  M_i[f][c][a][b] = sum_{z,p} D_i[f][z][p] V_i[c][z+a][p + b T]
 * with the dy components D_i = sum_j A^T[j][i] dy_j of each output tile (dy_j = 0 past
 * wo).  F(2,3): D_0 = dy0, D_1 = dy0 + dy1, D_2 = dy0 - dy1, D_3 = -dy1: 4 products per
 * pair and tap instead of 6.  F(4,3): D_0 = dy0, D_1,2 = dy0 +- dy1 + dy2 +- dy3,
 * D_3,4 = dy0 +- 2 dy1 + 4 dy2 +- 8 dy3, D_5 = dy3: 6 per 4 outputs instead of 12.  The
 * M_i are the plain filter gradient's register blocks over flat planes (taps b a shift
 * by T apart), in segments of about TILE outputs (part of a plane, or the whole planes
 * of a few z) whose D_i are packed per filter block.
 * With gb not NULL, also the bias gradient gb[f] += sum dy[f], as the sums of D_1
 * (F(2,3): dy0 + dy1, F(4,3): dy0 + dy1 + dy2 + dy3) while each plane of it is in cache.
 * work: (m + 2) * c_in * depth * hp * T + RUN floats (components), then
 * (m + 2) * filters * nz * roundup(ho * T, VL) (D) and (m + 2) * filters * c_in * kd * kh
 * (M). */
int CAT(cosmotrain_winograd_w_filter_grad, SUFFIX)(
        const float *base, const long *win,
        int c_in, int kd, int kh,
        const float *dy, long dy_f, long dy_d, long dy_h, int filters,
        float *g, int nz, int ho, int wo, float *work, int m, float *gb) {
    const int tiles = (wo + m - 1) / m, depth = nz + kd - 1, hp = ho + kh - 1;
    const int parts = m + 2;
    const long plane = (long)hp * tiles, channel = depth * plane;
    const long component = c_in * channel;
    CAT(input_components, SUFFIX)(base, win, c_in, depth, hp, tiles, m, work);
    const int vectors = (int)(((long)ho * tiles + VL - 1) / VL);
    const long dplane = (long)vectors * VL, dcomp = (long)filters * nz * dplane;
    float *dt = work + parts * component + RUN;
    for (int f = 0; f < filters; f++)
    for (int z = 0; z < nz; z++) {
        float *out = dt + (f * nz + z) * dplane;
        if (tiles < VL) {  /* VL / T rows a vector */
            const int group = VL / tiles;
            for (int h0 = 0; h0 < ho; h0 += group) {
                const int n = ho - h0 < group ? ho - h0 : group;
                const float *rows[VL];
                for (int k = 0; k < n; k++) rows[k] = dy + f * dy_f + z * dy_d + (h0 + k) * dy_h;
                CAT(dy_short_rows, SUFFIX)(out + (long)h0 * tiles, dcomp, rows, n, tiles, wo, m);
            }
        } else {
            for (int h = 0; h < ho; h++)
                CAT(dy_row_vectors, SUFFIX)(out + (long)h * tiles, dcomp,
                                            dy + f * dy_f + z * dy_d + h * dy_h, tiles, wo, m);
        }
        for (long p = (long)ho * tiles; p < dplane; p++)
            for (int i = 0; i < parts; i++) out[i * dcomp + p] = 0.0f;
        if (gb) {  /* the bias gradient: D_1 is each tile's dy sum, the plane just written */
            VEC acc[4] = {{0}, {0}, {0}, {0}};
            const float *d1 = out + dcomp;
            int v = 0;
            for (; v + 4 <= vectors; v += 4)
                for (int u = 0; u < 4; u++) acc[u] += CAT(load, SUFFIX)(d1 + (long)(v + u) * VL);
            for (; v < vectors; v++) acc[0] += CAT(load, SUFFIX)(d1 + (long)v * VL);
            gb[f] += CAT(lane_sum, SUFFIX)((acc[0] + acc[1]) + (acc[2] + acc[3]));
        }
    }
    const long taps = (long)c_in * kd * kh;
    float *msum = dt + parts * dcomp;
    for (long k = 0; k < parts * filters * taps; k++) msum[k] = 0.0f;
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
        for (int i = 0; i < parts; i++)
        for (int f0 = 0; f0 < filters; f0 += FB) {
            const int nf = filters - f0 < FB ? filters - f0 : FB;
            CAT(pack_filters, SUFFIX)(pack, dt + i * dcomp + ((long)f0 * nz + z) * dplane
                                                + (long)v0 * VL,
                                      nz * dplane, dplane, nzr, nv, nf);
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
                        msum[(i * filters + f0 + f) * taps + tap + b] +=
                            CAT(lane_sum, SUFFIX)(acc[f][b]);
            }
        }
    }
    free(pack);
    /* dL/dg_e = sum_i G[i][e] M_i: F(2,3) G = (1 0 0; .5 .5 .5; .5 -.5 .5; 0 0 1),
     * F(4,3) G = (1/4 0 0; -1/6 -1/6 -1/6; -1/6 1/6 -1/6; 1/24 1/12 1/6;
     * 1/24 -1/12 1/6; 0 0 1) */
    for (int f = 0; f < filters; f++)
    for (long k = 0; k < taps; k++) {
        float q[6];
        for (int i = 0; i < parts; i++) q[i] = msum[(i * filters + f) * taps + k];
        float *out = g + (f * taps + k) * 3;
        if (m == 2) {
            out[0] += q[0] + 0.5f * (q[1] + q[2]);
            out[1] += 0.5f * (q[1] - q[2]);
            out[2] += q[3] + 0.5f * (q[1] + q[2]);
            continue;
        }
        const float sum12 = q[1] + q[2], diff12 = q[2] - q[1];
        const float sum34 = q[3] + q[4], diff34 = q[3] - q[4];
        out[0] += 0.25f * q[0] - sum12 / 6.0f + sum34 / 24.0f;
        out[1] += diff12 / 6.0f + diff34 / 12.0f;
        out[2] += -sum12 / 6.0f + sum34 / 6.0f + q[5];
    }
    return 0;
}
