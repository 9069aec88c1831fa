// Direct 3D convolution forward for few input channels (conv1: 4, or 8 when padded), stride
// 1, any kernel size and (lo) padding, NCDHW, with the epilogue fused: bias (float32, or
// none) and LeakyReLU (slope; 1 = none, as epilogue.cu), one rounding to the storage type.
//
// Why a kernel of our own (issue 35 item 5, docs/PERFORMANCE.md "GPU"): conv1 (4 -> 16 or
// 32 channels at the full 128^3 volume) holds about 62% of the convolution time under
// cuDNN and runs at about 1% of an H200's peak.  With 4 input channels there is almost no
// reduction to feed tensor cores (K = 4 x 27 = 108 per output), and the volume is large
// (per sample 32 MiB in, 128-256 MiB out in fp32): 1,728 multiply-adds per voxel for 16
// filters against 40 bytes moved in bf16, so on CUDA cores the FMA rate bounds it, not
// HBM (paper conv1, batch 8: at least 0.87 ms a pass against 0.14 ms of traffic).  The
// design for the H200 (132 SMs, 228 KB of shared memory and L1 per SM, about 67 TFLOP/s
// of fp32 FMA, 4.8 TB/s):
//
// * Each thread computes two neighbouring output voxels along W for a group of 16 filters
//   (FILTER_GROUP), 32 accumulators in registers: every weight it reads from shared
//   memory feeds two fused multiply-adds, and along a row of kw taps the two outputs share
//   kw - 1 inputs (kw + 1 loads, neighbours along W in neighbouring threads, so a warp's
//   loads are coalesced and the taps' overlap hits L1).  Per tap row of 3: 4 input loads
//   and 12 vector loads of weights for 96 FMAs, so the FMA pipe, not the load/store
//   units, sets the pace.  F = 32 makes two groups, the second re-reading the input from
//   L1 or L2, not from HBM.
// * The weights (C x taps x F <= 6912 floats, 27 KiB) are staged once per block in shared
//   memory, transposed to [channel][tap][filter] and padded to whole groups of 16, so the
//   16 weights of one tap are contiguous and 64-byte aligned (vector loads; every thread
//   of a warp reads the same address: a broadcast, no bank conflict).
// * Outputs are written once, coalesced along W, after the bias and the LeakyReLU in
//   registers: no pass of epilogue.cu over 128-256 MiB per sample.
// * The grid is a grid-stride loop over (sample, filter group, output row, voxel pair),
//   pairs fastest; a block stages the weights before its first item (the one barrier:
//   two phases, which the host shim runs one after the other, common.cuh).  Taps in the
//   zero padding along W read 0 (a product of zero), along D and H they are skipped.
//
// Arithmetic: float32 accumulation with fmaf (one rounding per product and sum, the same
// on the host, whose fmaf is the correctly rounded one: the host build's bits are the
// device's), in the order channel, kd, kh, kw; the CPU's convolutions sum in other orders,
// so results agree within float32 summation error, not bit for bit.
#include "common.cuh"

#define FILTER_GROUP 16
#define DIRECT_MAX_WEIGHTS 6912  // 8 channels x 27 taps x 32 filters (two groups)

struct ConvShape {
    int n, c, f;           // samples, input channels, filters
    int d, h, w;           // input
    int od, oh, ow;        // output
    int kd, kh, kw;        // kernel
    int pd, ph, pw;        // padding before each spatial dimension
};

template <class T>
__device__ void stage_weights(float* ws, const T* w, const ConvShape& s, int groups) {
    const int taps = s.kd * s.kh * s.kw;
    const int rows = s.c * taps;  // [channel][tap], each row `groups` x 16 filters
    for (int i = threadIdx.x; i < rows * groups * FILTER_GROUP; i += blockDim.x) {
        const int row = i / (groups * FILTER_GROUP), f = i - row * groups * FILTER_GROUP;
        ws[i] = f < s.f ? load_f(w, (i64)f * rows + row) : 0.0f;
    }
}

template <class T>
__device__ void conv_direct_forward_body(const T* __restrict__ x, const T* __restrict__ w,
                                         const float* __restrict__ bias, T* __restrict__ y,
                                         ConvShape s, float slope) {
    alignas(16) __shared__ float ws[DIRECT_MAX_WEIGHTS];
    const int groups = (s.f + FILTER_GROUP - 1) / FILTER_GROUP;
    COSMO_PHASE(0) { stage_weights(ws, w, s, groups); }
    COSMO_SYNC();
    COSMO_PHASE(1) {
        const i64 plane = (i64)s.h * s.w, volume = plane * s.d;
        const i64 voxels = (i64)s.od * s.oh * s.ow;
        const int pairs = (s.ow + 1) / 2;  // VOXELS = 2 neighbours along W per thread
        const i64 rows = (i64)s.od * s.oh;
        GRID_STRIDE(i, (i64)s.n * groups * rows * pairs) {
            const int ox = (int)(i % pairs) * 2;
            const i64 row_item = i / pairs, r = row_item % rows, item = row_item / rows;
            const int g = (int)(item % groups), sample = (int)(item / groups);
            const int oy = (int)(r % s.oh), oz = (int)(r / s.oh);
            float acc[2][FILTER_GROUP];
#pragma unroll
            for (int j = 0; j < FILTER_GROUP; ++j) acc[0][j] = acc[1][j] = 0.0f;
            for (int c = 0; c < s.c; ++c) {
                const T* xc = x + ((i64)sample * s.c + c) * volume;
                for (int a = 0; a < s.kd; ++a) {
                    const int iz = oz - s.pd + a;
                    if (iz < 0 || iz >= s.d) continue;
                    for (int b = 0; b < s.kh; ++b) {
                        const int iy = oy - s.ph + b;
                        if (iy < 0 || iy >= s.h) continue;
                        const T* xrow = xc + iz * plane + (i64)iy * s.w;
                        const int tap_row = ((c * s.kd + a) * s.kh + b) * s.kw;
                        // the two outputs' taps share kw - 1 inputs: kw + 1 loads, not 2 kw
                        int ix = ox - s.pw;
                        float left = ix >= 0 && ix < s.w ? load_f(xrow, ix) : 0.0f;
                        for (int e = 0; e < s.kw; ++e) {
                            ++ix;
                            const float right = ix >= 0 && ix < s.w ? load_f(xrow, ix) : 0.0f;
                            const float* wt = ws + ((i64)(tap_row + e) * groups + g) * FILTER_GROUP;
#pragma unroll
                            for (int j = 0; j < FILTER_GROUP; ++j) {
                                acc[0][j] = fmaf(left, wt[j], acc[0][j]);
                                acc[1][j] = fmaf(right, wt[j], acc[1][j]);
                            }
                            left = right;
                        }
                    }
                }
            }
            const i64 at = r * s.ow + ox;
#pragma unroll
            for (int q = 0; q < 2; ++q) {
                if (ox + q >= s.ow) break;
#pragma unroll
                for (int j = 0; j < FILTER_GROUP; ++j) {
                    const int f = g * FILTER_GROUP + j;
                    if (f >= s.f) break;
                    const float u = bias ? __fadd_rn(acc[q][j], bias[f]) : acc[q][j];
                    store_f(y, ((i64)sample * s.f + f) * voxels + at + q,
                            u > 0.0f ? u : __fmul_rn(u, slope));
                }
            }
        }
    }
}

COSMO_BOTH(conv_direct_forward,
           (const T* x, const T* w, const float* bias, T* y, int n, int c, int f, int d,
            int h, int wd, int od, int oh, int ow, int kd, int kh, int kw, int pd, int ph,
            int pw, float slope),
           <T>(x, w, bias, y, ConvShape{n, c, f, d, h, wd, od, oh, ow, kd, kh, kw, pd, ph, pw},
               slope))

// Weight gradient of the same convolution: dw[f, c, a, b, e] = sum over samples and
// output voxels of x[c, voxel + tap] * dy[f, voxel], in two kernels, deterministic (no
// atomics):
//
// * conv_direct_wgrad: each thread owns one (channel, kd tap, kh tap) row of taps for a
//   group of 16 filters and a chunk of output rows (sample, z, y), and walks each row
//   along W: per voxel 16 dy values (the same addresses for the warp's threads of one
//   chunk: broadcast) and one new x value feed kw x 16 fused multiply-adds in registers
//   (kw <= WGRAD_MAX_KW).  It writes its chunk's partial sums, float32, to
//   partial[chunk][f][c][kd][kh][kw].  The chunk size is chosen by the face so that the
//   launch has about 2^18 threads: enough to fill an H200 at batch 1.
// * conv_direct_wgrad_reduce: the chunks' partial sums added in chunk order, `fan` at a
//   time per thread, launched again on its float32 result until one sum per weight is
//   left, rounded once to the storage type (bf16 dw, as cuDNN returns for bf16 io).
//
// The bias gradient and a fused activation's backward stay with the front door
// (kernels/conv3d.py: channel_sums, and epilogue.cu's backward pass on dy).
#define WGRAD_MAX_KW 3

template <class T>
__device__ void conv_direct_wgrad_body(const T* __restrict__ x, const T* __restrict__ dy,
                                       float* __restrict__ partial, ConvShape s,
                                       int rows_per_chunk, i64 chunks) {
    const int groups = (s.f + FILTER_GROUP - 1) / FILTER_GROUP;
    const int rows_of_taps = s.c * s.kd * s.kh;
    const i64 rows = (i64)s.n * s.od * s.oh, plane = (i64)s.h * s.w;
    const i64 voxels = (i64)s.od * s.oh * s.ow;
    GRID_STRIDE(i, chunks * groups * rows_of_taps) {
        const int k = (int)(i % rows_of_taps);
        const int g = (int)((i / rows_of_taps) % groups);
        const i64 chunk = i / rows_of_taps / groups;
        const int c = k / (s.kd * s.kh), a = (k / s.kh) % s.kd, b = k % s.kh;
        float acc[WGRAD_MAX_KW][FILTER_GROUP];
#pragma unroll
        for (int e = 0; e < WGRAD_MAX_KW; ++e)
#pragma unroll
            for (int j = 0; j < FILTER_GROUP; ++j) acc[e][j] = 0.0f;
        const i64 last = (chunk + 1) * rows_per_chunk < rows ? (chunk + 1) * rows_per_chunk : rows;
        for (i64 r = chunk * rows_per_chunk; r < last; ++r) {
            const int oy = (int)(r % s.oh), oz = (int)((r / s.oh) % s.od);
            const i64 sample = r / s.oh / s.od;
            const int iz = oz - s.pd + a, iy = oy - s.ph + b;
            if (iz < 0 || iz >= s.d || iy < 0 || iy >= s.h) continue;
            const T* xrow = x + (sample * s.c + c) * s.d * plane + iz * plane + (i64)iy * s.w;
            const T* dyrow = dy + (sample * s.f + g * FILTER_GROUP) * voxels +
                             ((i64)oz * s.oh + oy) * s.ow;
            for (int ox = 0; ox < s.ow; ++ox) {
                float grad[FILTER_GROUP];
#pragma unroll
                for (int j = 0; j < FILTER_GROUP; ++j)
                    grad[j] = g * FILTER_GROUP + j < s.f ? load_f(dyrow, j * voxels + ox) : 0.0f;
#pragma unroll
                for (int e = 0; e < WGRAD_MAX_KW; ++e) {
                    const int ix = ox - s.pw + e;
                    if (e >= s.kw || ix < 0 || ix >= s.w) continue;
                    const float value = load_f(xrow, ix);
#pragma unroll
                    for (int j = 0; j < FILTER_GROUP; ++j) acc[e][j] = fmaf(value, grad[j], acc[e][j]);
                }
            }
        }
        const i64 weights = (i64)s.f * rows_of_taps * s.kw;
#pragma unroll
        for (int j = 0; j < FILTER_GROUP; ++j) {
            const int f = g * FILTER_GROUP + j;
            if (f >= s.f) break;
#pragma unroll
            for (int e = 0; e < WGRAD_MAX_KW; ++e)
                if (e < s.kw)
                    partial[chunk * weights + ((i64)f * rows_of_taps + k) * s.kw + e] = acc[e][j];
        }
    }
}

COSMO_BOTH(conv_direct_wgrad,
           (const T* x, const T* dy, float* partial, int n, int c, int f, int d, int h,
            int wd, int od, int oh, int ow, int kd, int kh, int kw, int pd, int ph, int pw,
            int rows_per_chunk, i64 chunks),
           <T>(x, dy, partial, ConvShape{n, c, f, d, h, wd, od, oh, ow, kd, kh, kw, pd, ph, pw},
               rows_per_chunk, chunks))

// out[group][weight] = the sum of partial[chunk][weight] over the group's `fan` chunks,
// in chunk order: the face repeats it (float32 out) until one group is left, which it
// writes in the storage type, so that thousands of chunks are added by many threads.
template <class T>
__device__ void conv_direct_wgrad_reduce_body(const float* __restrict__ partial, T* out,
                                              i64 chunks, i64 fan, i64 weights) {
    const i64 groups = (chunks + fan - 1) / fan;
    GRID_STRIDE(i, groups * weights) {
        const i64 group = i / weights, weight = i % weights;
        const i64 last = (group + 1) * fan < chunks ? (group + 1) * fan : chunks;
        float sum = 0.0f;
        for (i64 k = group * fan; k < last; ++k)
            sum = __fadd_rn(sum, partial[k * weights + weight]);
        store_f(out, i, sum);
    }
}

COSMO_BOTH(conv_direct_wgrad_reduce,
           (const float* partial, T* out, i64 chunks, i64 fan, i64 weights),
           <T>(partial, out, chunks, fan, weights))
