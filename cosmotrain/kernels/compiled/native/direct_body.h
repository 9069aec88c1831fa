/* Direct 3D convolution loops, included once per instruction set by direct.c with
 * VL (floats per vector), FB (filters per register block), WV (vectors per output run)
 * and SUFFIX defined, inside a "#pragma GCC target" region.  Plain C with GCC vector
 * extensions: the compiler keeps the FB x WV accumulators in registers and turns
 * "scalar * vector" into broadcast FMAs.  See direct.c for the conventions. */

#include <immintrin.h>
#include <stdlib.h>

#define CAT_(a, b) a##_##b
#define CAT(a, b) CAT_(a, b)
#define VEC CAT(vec, SUFFIX)
typedef float VEC __attribute__((vector_size(VL * 4)));
typedef int CAT(mask, SUFFIX) __attribute__((vector_size(VL * 4)));

static inline VEC CAT(load, SUFFIX)(const float *p) {
    VEC v;
    __builtin_memcpy(&v, p, sizeof v);
    return v;
}

/* Output runs of RUN = VL * WV positions along W; the slab's rows are readable up to
 * roundup(Wo, RUN) + kw - 1. */
#define RUN (VL * WV)

static void CAT(store_run, SUFFIX)(float *out, const VEC *acc, int valid) {
    if (valid >= RUN) {
        __builtin_memcpy(out, acc, sizeof(VEC) * WV);
    } else {
        float tmp[RUN];
        __builtin_memcpy(tmp, acc, sizeof tmp);
        for (int i = 0; i < valid; i++) out[i] = tmp[i];
    }
}

/* One register block: acc[f][v] = sum_{c,a,b,e} wq[...][f] * row(c,a,b)[e + v*VL], for
 * one output row and RUN positions.  KW is a constant at each call, so the taps along W
 * unroll fully. */
static inline __attribute__((always_inline)) void CAT(forward_accumulate, SUFFIX)(
        VEC acc[FB][WV], const float *wq, const float *s, long s_c, long s_d, long s_h,
        int c_in, int kd, int kh, const int kw);

static inline __attribute__((always_inline)) void CAT(forward_block, SUFFIX)(
        VEC acc[FB][WV], const float *wq, const float *s, long s_c, long s_d, long s_h,
        int c_in, int kd, int kh, const int kw) {
    for (int f = 0; f < FB; f++)
        for (int v = 0; v < WV; v++) acc[f][v] = (VEC){0};
    CAT(forward_accumulate, SUFFIX)(acc, wq, s, s_c, s_d, s_h, c_in, kd, kh, kw);
}

/* forward_block's sums added to acc as it stands: a block split over channels into
 * consecutive calls adds the same products in the same order, so the same bits. */
static inline __attribute__((always_inline)) void CAT(forward_accumulate, SUFFIX)(
        VEC acc[FB][WV], const float *wq, const float *s, long s_c, long s_d, long s_h,
        int c_in, int kd, int kh, const int kw) {
    for (int c = 0; c < c_in; c++)
    for (int a = 0; a < kd; a++)
    for (int b = 0; b < kh; b++, wq += kw * FB) {
        const float *row = s + c * s_c + a * s_d + b * s_h;
#pragma GCC unroll 8
        for (int e = 0; e < kw; e++) {
            VEC xv[WV];
#pragma GCC unroll 4
            for (int v = 0; v < WV; v++) xv[v] = CAT(load, SUFFIX)(row + e + v * VL);
#pragma GCC unroll 16
            for (int f = 0; f < FB; f++) {
                const float wf = wq[e * FB + f];
#pragma GCC unroll 4
                for (int v = 0; v < WV; v++) acc[f][v] += wf * xv[v];
            }
        }
    }
}

/* LeakyReLU of `count` outputs just stored (in L1): max(v, slope v) as
 * native/activation.c computes it, so the same bits as the separate pass it replaces. */
static inline void CAT(leaky_run, SUFFIX)(float *out, int count, float slope) {
    for (int i = 0; i < count; i++) {
        const float v = out[i], sv = v * slope;
        out[i] = v > sv ? v : sv;
    }
}

/* A whole run stored past the caches (out aligned to a vector), LeakyReLU(slope) first
 * when `leaky`, in registers with leaky_run's arithmetic (the same bits).  Why: an output
 * far larger than the caches (the paper network's conv1, 134 MB a sample) is read again
 * only by the next layer's pass, from memory either way, and a plain store first reads
 * each line it writes (1.4 ms of that layer's 28.6 ms forward, 2026-11-27).  AVX2 keeps
 * plain stores. */
static inline void CAT(stream_run, SUFFIX)(float *out, const VEC *acc, int leaky,
                                           float slope) {
    for (int v = 0; v < WV; v++) {
        VEC r = acc[v];
        if (leaky) {
            const VEC sv = r * slope;
            const CAT(mask, SUFFIX) keep = r > sv;
            r = (VEC)(((CAT(mask, SUFFIX))r & keep) | ((CAT(mask, SUFFIX))sv & ~keep));
        }
#if VL == 16
        _mm512_stream_ps(out + v * VL, (__m512)r);
#else
        __builtin_memcpy(out + v * VL, &r, sizeof r);
#endif
    }
}

/* y[f][z][h][w] = sum_{c,a,b,e} wp[f/FB][c][a][b][e][f%FB] * s[c][z+a][h+b][w+e] + bias[f]
 * for z < nz, h < ho, w < wo (unit stride), then LeakyReLU(slope) when `leaky` (the next
 * layer's pass over the output, done while each run is in cache).  Summation order: c,
 * a, b, e ascending, the same for every output, whatever the chunking.  `stream`: whole,
 * aligned runs bypass the caches (stream_run). */
void CAT(cosmotrain_direct_forward, SUFFIX)(
        const float *s, long s_c, long s_d, long s_h,
        int c_in, int kd, int kh, int kw,
        const float *wp, int filters, const float *bias,
        float *y, long y_f, long y_d, long y_h,
        int nz, int ho, int wo, int leaky, float slope, int stream) {
    const int blocks = (filters + FB - 1) / FB;
    const long block_size = (long)c_in * kd * kh * kw * FB;
    for (int z = 0; z < nz; z++)
    for (int h = 0; h < ho; h++)
    for (int fb = 0; fb < blocks; fb++) {
        const float *wb = wp + fb * block_size;
        const int nf = filters - fb * FB < FB ? filters - fb * FB : FB;
        for (int w0 = 0; w0 < wo; w0 += RUN) {
            VEC acc[FB][WV];
            const float *origin = s + z * s_d + h * s_h + w0;
            if (kw == 3)
                CAT(forward_block, SUFFIX)(acc, wb, origin, s_c, s_d, s_h, c_in, kd, kh, 3);
            else
                CAT(forward_block, SUFFIX)(acc, wb, origin, s_c, s_d, s_h, c_in, kd, kh, kw);
            for (int f = 0; f < nf; f++) {
                const int o = fb * FB + f;
                if (bias)
                    for (int v = 0; v < WV; v++) acc[f][v] += bias[o];
                float *out = y + o * y_f + z * y_d + h * y_h + w0;
                if (stream && wo - w0 >= RUN && (unsigned long)out % sizeof(VEC) == 0) {
                    CAT(stream_run, SUFFIX)(out, acc[f], leaky, slope);
                    continue;
                }
                CAT(store_run, SUFFIX)(out, acc[f], wo - w0);
                if (leaky)
                    CAT(leaky_run, SUFFIX)(out, wo - w0 < RUN ? wo - w0 : RUN, slope);
            }
        }
    }
    if (stream)  /* streamed stores are weakly ordered: visible before the call returns */
        __builtin_ia32_sfence();
}

/* Filter gradient: g[f][c][a][b][e] += sum dy[f][z][h][w] * s[c][z+a][h+b][w+e] over
 * z < nz, h < ho, w < wo.  dy rows are read as whole vectors, up to roundup(wo, VL): the
 * caller pads them with zeros from wo on.  Rows are taken in tiles of about TILE output
 * positions; per tile and tap, a block of FB filters x 3 taps along W is accumulated in
 * registers and summed over its lanes into g (accumulated into: partials add up). */
#ifndef TILE
#define TILE 1024
#endif
static inline float CAT(lane_sum, SUFFIX)(VEC v) {
#if VL == 16
    v += __builtin_shuffle(v, (CAT(mask, SUFFIX)){8, 9, 10, 11, 12, 13, 14, 15,
                                                   0, 1, 2, 3, 4, 5, 6, 7});
    v += __builtin_shuffle(v, (CAT(mask, SUFFIX)){4, 5, 6, 7, 0, 1, 2, 3,
                                                   12, 13, 14, 15, 8, 9, 10, 11});
    v += __builtin_shuffle(v, (CAT(mask, SUFFIX)){2, 3, 0, 1, 6, 7, 4, 5,
                                                   10, 11, 8, 9, 14, 15, 12, 13});
    v += __builtin_shuffle(v, (CAT(mask, SUFFIX)){1, 0, 3, 2, 5, 4, 7, 6,
                                                   9, 8, 11, 10, 13, 12, 15, 14});
#else
    v += __builtin_shuffle(v, (CAT(mask, SUFFIX)){4, 5, 6, 7, 0, 1, 2, 3});
    v += __builtin_shuffle(v, (CAT(mask, SUFFIX)){2, 3, 0, 1, 6, 7, 4, 5});
    v += __builtin_shuffle(v, (CAT(mask, SUFFIX)){1, 0, 3, 2, 5, 4, 7, 6});
#endif
    return v[0];
}

/* One tap block: FB filters x NE taps (input offsets e * estride apart: 1 for taps
 * along W, the tile count for Winograd's flat planes) accumulated over a tile of rows
 * whose dy is packed as pack[row][vector][f][lane]; NE is a constant at each call (no
 * branches in the loop).  The empty asm keeps each dy vector in a register for its NE
 * FMAs. */
static inline __attribute__((always_inline)) void CAT(tap_block, SUFFIX)(
        VEC acc[FB][3], const float *pack, const float *row0, long s_h,
        int nrows, int vectors, const int ne, long estride) {
    for (int f = 0; f < FB; f++)
        for (int e = 0; e < 3; e++) acc[f][e] = (VEC){0};
    const float *pp = pack;
    for (int r = 0; r < nrows; r++) {
        const float *row = row0 + r * s_h;
        for (int v = 0; v < vectors; v++, pp += FB * VL) {
            VEC xv[3];
            for (int e = 0; e < ne; e++)
                xv[e] = CAT(load, SUFFIX)(row + v * VL + e * estride);
#pragma GCC unroll 16
            for (int f = 0; f < FB; f++) {
                VEC d = CAT(load, SUFFIX)(pp + f * VL);
                __asm__("" : "+v"(d));
                for (int e = 0; e < ne; e++) acc[f][e] += d * xv[e];
            }
        }
    }
}

/* tap_block with its tap count (1 to 3) made a constant: one loop body per count. */
static inline __attribute__((always_inline)) void CAT(tap_blocks, SUFFIX)(
        VEC acc[FB][3], const float *pack, const float *row0, long s_h,
        int nrows, int vectors, int ne, long estride) {
    if (ne == 3)
        CAT(tap_block, SUFFIX)(acc, pack, row0, s_h, nrows, vectors, 3, estride);
    else if (ne == 2)
        CAT(tap_block, SUFFIX)(acc, pack, row0, s_h, nrows, vectors, 2, estride);
    else
        CAT(tap_block, SUFFIX)(acc, pack, row0, s_h, nrows, vectors, 1, estride);
}

/* A filter block's dy for one tile, packed as pack[row][vector][f][lane]: row r's vector
 * v of filter f read from src + f f_stride + r r_stride + v VL; filters past nf repeat
 * the block's first (their sums are never stored). */
static inline void CAT(pack_filters, SUFFIX)(float *pack, const float *src, long f_stride,
                                             long r_stride, int rows, int vectors, int nf) {
    for (int r = 0; r < rows; r++)
        for (int v = 0; v < vectors; v++)
            for (int f = 0; f < FB; f++)
                __builtin_memcpy(pack + ((r * vectors + v) * FB + f) * VL,
                                 src + (f < nf ? f : 0) * f_stride + r * r_stride + v * VL,
                                 sizeof(VEC));
}

/* pack_filters of dy times the LeakyReLU factor of the activation output y beside it
 * (up where y > 0, down elsewhere: native/activation.c's backward, the same products),
 * y read with the same layout as dy (y_f, y_r): the activation's backward done in the
 * pack, for a layer whose output gradient serves only its filter gradient. */
static inline void CAT(pack_filters_masked, SUFFIX)(float *pack, const float *src,
                                                    long f_stride, long r_stride,
                                                    const float *y, long y_f, long y_r,
                                                    int rows, int vectors, int nf,
                                                    float up, float down) {
    const VEC zero = {0}, upv = zero + up, downv = zero + down;
    for (int r = 0; r < rows; r++)
        for (int v = 0; v < vectors; v++)
            for (int f = 0; f < FB; f++) {
                const int g = f < nf ? f : 0;
                const VEC d = CAT(load, SUFFIX)(src + g * f_stride + r * r_stride + v * VL);
                const VEC yv = CAT(load, SUFFIX)(y + g * y_f + r * y_r + v * VL);
                const CAT(mask, SUFFIX) positive = yv > zero;
                const VEC factor = (VEC)(((CAT(mask, SUFFIX))upv & positive)
                                         | ((CAT(mask, SUFFIX))downv & ~positive));
                const VEC out = d * factor;
                __builtin_memcpy(pack + ((r * vectors + v) * FB + f) * VL, &out, sizeof(VEC));
            }
}

/* gb[f0 + f] += the sum of a packed tile's dy for each of its nf filters (the bias
 * gradient, read from the pack while it is in L1 instead of in a pass over dy of its
 * own: 20 ms of the MLPerf network's conv1 backward on one core).  Lanes past wo hold
 * the caller's zeros. */
static void CAT(pack_sums, SUFFIX)(float *gb, const float *pack, int count, int nf) {
    for (int f = 0; f < nf; f++) {
        VEC acc[4] = {{0}, {0}, {0}, {0}};
        int k = 0;
        for (; k + 4 <= count; k += 4)
            for (int u = 0; u < 4; u++)
                acc[u] += CAT(load, SUFFIX)(pack + ((long)(k + u) * FB + f) * VL);
        for (; k < count; k++) acc[0] += CAT(load, SUFFIX)(pack + ((long)k * FB + f) * VL);
        gb[f] += CAT(lane_sum, SUFFIX)((acc[0] + acc[1]) + (acc[2] + acc[3]));
    }
}

/* The filter gradient, and when gb is not NULL the bias gradient gb[f] += sum dy[f].
 * With ya not NULL, dy is first multiplied by the LeakyReLU factor of ya (the activation
 * output after this layer, laid out as dy: ya_f, ya_d, ya_h), in the pack. */
int CAT(cosmotrain_direct_filter_grad, SUFFIX)(
        const float *s, long s_c, long s_d, long s_h,
        int c_in, int kd, int kh, int kw,
        const float *dy, long dy_f, long dy_d, long dy_h, int filters,
        float *g, int nz, int ho, int wo, float *gb,
        const float *ya, long ya_f, long ya_d, long ya_h, float up, float down) {
    const long taps = (long)c_in * kd * kh * kw;
    const int vectors = (wo + VL - 1) / VL;
    int rows = TILE / (vectors * VL);
    if (rows < 1) rows = 1;
    if (rows > ho) rows = ho;
    float *pack = aligned_alloc(64, sizeof(float) * FB * VL * (size_t)(rows * vectors));
    if (!pack) return -1;  /* the caller raises MemoryError: no partial gradient */
    for (int z = 0; z < nz; z++)
    for (int h0 = 0; h0 < ho; h0 += rows) {
        const int nrows = h0 + rows < ho ? rows : ho - h0;
        for (int f0 = 0; f0 < filters; f0 += FB) {
            const int nf = filters - f0 < FB ? filters - f0 : FB;
            if (ya)
                CAT(pack_filters_masked, SUFFIX)(pack, dy + f0 * dy_f + z * dy_d + h0 * dy_h,
                                                 dy_f, dy_h,
                                                 ya + f0 * ya_f + z * ya_d + h0 * ya_h, ya_f,
                                                 ya_h, nrows, vectors, nf, up, down);
            else
                CAT(pack_filters, SUFFIX)(pack, dy + f0 * dy_f + z * dy_d + h0 * dy_h, dy_f,
                                          dy_h, nrows, vectors, nf);
            if (gb) CAT(pack_sums, SUFFIX)(gb + f0, pack, nrows * vectors, nf);
            for (int c = 0; c < c_in; c++)
            for (int a = 0; a < kd; a++)
            for (int b = 0; b < kh; b++)
            for (int e0 = 0; e0 < kw; e0 += 3) {
                const int ne = kw - e0 < 3 ? kw - e0 : 3;
                const float *row0 = s + c * s_c + (z + a) * s_d + (h0 + b) * s_h + e0;
                VEC acc[FB][3];
                CAT(tap_blocks, SUFFIX)(acc, pack, row0, s_h, nrows, vectors, ne, 1);
                const long tap = ((long)(c * kd + a) * kh + b) * kw + e0;
                for (int f = 0; f < nf; f++)
                    for (int e = 0; e < ne; e++)
                        g[(f0 + f) * taps + tap + e] += CAT(lane_sum, SUFFIX)(acc[f][e]);
            }
        }
    }
    free(pack);
    return 0;
}

/* RUN and VEC stay defined for winograd_body.h; isa_loops.h undefines them. */
