// Average pooling, zero padding counted (divisor kd*kh*kw), forward in one pass and
// backward as a gather fused with the LeakyReLU backward before the pooling.
//
// Bits: each output (forward) or input gradient (backward) adds its terms in exactly
// the order of the CPU kernels (kernels/native/avgpool.c, itself numpy's order in
// kernels/pool3d.py): along D, then H, then W, each dimension's taps in `_window`'s
// order (the taps whose part covers every output first, then the others) or, on the
// CPU's plane-by-plane path (`whole` == 0), D in ascending order.  That order is what
// makes every spatial split give one process's results, so the GPU keeps it too; the
// float32 results are the CPU's bit for bit, and bf16 storage gives the CPU bf16 path's
// bits (it pools the widened values in float32 and rounds once).
//
// One thread per output (forward) or per input element (backward).  At most 8 taps a
// dimension.  NCDHW, C-contiguous; `planes` = N * C.
#include "common.cuh"

#define MAX_TAPS 8

__device__ __forceinline__ int floor_div(int a, int b) { return (a - (((a % b) + b) % b)) / b; }

// Input indices of output j's window along one dimension in `_window`'s order.
__device__ int window_order(int k, int s, int lo, int n_in, int n_out, int j, int* out) {
    int n = 0;
#pragma unroll 1
    for (int pass = 0; pass < 2; pass++)
#pragma unroll 1
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

// Outputs whose windows hold input i along one dimension, in `_spread`'s order.
__device__ int spread_order(int k, int s, int lo, int n_in, int n_out, int i, int* out) {
    const int r = i % s, m = i / s, count = (n_in - r + s - 1) / s;
    int n = 0;
#pragma unroll 1
    for (int pass = 0; pass < 2; pass++)
#pragma unroll 1
        for (int e = 0; e < k; e++) {
            const int num = r + lo - e;
            const int rem = ((num % s) + s) % s;
            if (rem) continue;
            const int q = (num - rem) / s;
            const int m0 = q < 0 ? -q : 0, m1 = count < n_out - q ? count : n_out - q;
            const int full = m0 == 0 && m1 == count;
            if (m1 <= m0 || full != (pass == 0) || m < m0 || m >= m1) continue;
            out[n++] = m + q;
        }
    return n;
}

// The geometry, 15 ints in device memory (static across steps, so a captured graph
// replays it): input D, H, W; output D, H, W; kernel; stride; padding before.
struct Pool {
    int d_in, h_in, w_in, d_out, h_out, w_out, kd, kh, kw, sd, sh, sw, dl, hl, wl;
};

__device__ __forceinline__ Pool load_pool(const int* v) {
    return Pool{v[0], v[1], v[2], v[3], v[4], v[5], v[6], v[7], v[8], v[9], v[10], v[11],
                v[12], v[13], v[14]};
}

template <class T>
__device__ void avgpool_forward_body(const T* __restrict__ x, T* __restrict__ y, i64 planes,
                                     const int* geo, float scale, int whole) {
    const Pool g = load_pool(geo);
    const i64 out_volume = (i64)g.d_out * g.h_out * g.w_out;
    const i64 in_volume = (i64)g.d_in * g.h_in * g.w_in;
    GRID_STRIDE(i, planes * out_volume) {
        const int w = (int)(i % g.w_out), h = (int)((i / g.w_out) % g.h_out);
        const int z = (int)((i / ((i64)g.w_out * g.h_out)) % g.d_out);
        const T* xc = x + (i / out_volume) * in_volume;
        int ds[MAX_TAPS], hs[MAX_TAPS], ws[MAX_TAPS], nd = 0;
        if (whole) {
            nd = window_order(g.kd, g.sd, g.dl, g.d_in, g.d_out, z, ds);
        } else {
            for (int a = 0; a < g.kd; a++) {
                const int p = z * g.sd + a - g.dl;
                if (p >= 0 && p < g.d_in) ds[nd++] = p;
            }
        }
        const int nh = window_order(g.kh, g.sh, g.hl, g.h_in, g.h_out, h, hs);
        const int nw = window_order(g.kw, g.sw, g.wl, g.w_in, g.w_out, w, ws);
        float total = 0.0f;
        for (int qw = 0; qw < nw; qw++) {
            float rows = 0.0f;
            for (int qh = 0; qh < nh; qh++) {
                float column = 0.0f;
                for (int qd = 0; qd < nd; qd++) {
                    const float v = load_f(xc, ((i64)ds[qd] * g.h_in + hs[qh]) * g.w_in + ws[qw]);
                    column = qd ? __fadd_rn(column, v) : v;
                }
                rows = qh ? __fadd_rn(rows, column) : column;
            }
            total = qw ? __fadd_rn(total, rows) : rows;
        }
        store_f(y, i, __fmul_rn(total, scale));
    }
}

COSMO_BOTH(avgpool_forward,
           (const T* x, T* y, i64 planes, const int* geo, float scale, int whole),
           <T>(x, y, planes, geo, scale, whole))

// dx = the spread of dy * scale; with `ya` (the output of a LeakyReLU before the
// pooling, dx's shape), times (ya > 0 ? up : down): that activation's backward in the
// same pass, as native/avgpool.c fuses it.
template <class T>
__device__ void avgpool_backward_body(const T* __restrict__ dy, T* __restrict__ dx,
                                      const T* __restrict__ ya, i64 planes,
                                      const int* geo, float scale, int whole, float up,
                                      float down) {
    const Pool g = load_pool(geo);
    const i64 out_volume = (i64)g.d_out * g.h_out * g.w_out;
    const i64 in_volume = (i64)g.d_in * g.h_in * g.w_in;
    GRID_STRIDE(i, planes * in_volume) {
        const int w = (int)(i % g.w_in), r = (int)((i / g.w_in) % g.h_in);
        const int p = (int)((i / ((i64)g.w_in * g.h_in)) % g.d_in);
        const T* gc = dy + (i / in_volume) * out_volume;
        int zs[MAX_TAPS], hs[MAX_TAPS], ws[MAX_TAPS], nz = 0;
        if (whole) {
            nz = spread_order(g.kd, g.sd, g.dl, g.d_in, g.d_out, p, zs);
        } else {
            for (int z = 0; z < g.d_out; z++) {
                const int a = p + g.dl - z * g.sd;
                if (a >= 0 && a < g.kd) zs[nz++] = z;
            }
        }
        const int nh = spread_order(g.kh, g.sh, g.hl, g.h_in, g.h_out, r, hs);
        const int nw = spread_order(g.kw, g.sw, g.wl, g.w_in, g.w_out, w, ws);
        float total = 0.0f;
        for (int qw = 0; qw < nw; qw++) {
            float rows = 0.0f;
            for (int qh = 0; qh < nh; qh++) {
                float planes_sum = 0.0f;
                for (int qz = 0; qz < nz; qz++) {
                    float v = load_f(gc, ((i64)zs[qz] * g.h_out + hs[qh]) * g.w_out + ws[qw]);
                    if (whole) v = __fmul_rn(v, scale);  // the CPU scales first on this path
                    planes_sum = qz ? __fadd_rn(planes_sum, v) : v;
                }
                if (!whole) planes_sum = __fmul_rn(planes_sum, scale);
                rows = qh ? __fadd_rn(rows, planes_sum) : planes_sum;
            }
            total = qw ? __fadd_rn(total, rows) : rows;
        }
        if (ya) total = __fmul_rn(total, load_f(ya, i) > 0.0f ? up : down);
        store_f(dx, i, total);
    }
}

COSMO_BOTH(avgpool_backward,
           (const T* dy, T* dx, const T* ya, i64 planes, const int* geo, float scale,
            int whole, float up, float down),
           <T>(dy, dx, ya, planes, geo, scale, whole, up, down))
