// Average pooling, zero padding counted (divisor kd*kh*kw), forward in one pass and
// backward as a gather fused with the LeakyReLU backward before the pooling.
//
// Bits: each output (forward) or input gradient (backward) adds its terms in exactly
// the order of the CPU kernels (kernels/compiled/native/avgpool.c, itself numpy's order in
// kernels/pool3d.py): along D, then H, then W, each dimension's taps in `_window`'s
// order (the taps whose part covers every output first, then the others) or, on the
// CPU's plane-by-plane path, D in ascending order.  That order is what makes every
// spatial split give one process's results, so the GPU keeps it too; the float32
// results are the CPU's bit for bit, and bf16 storage gives the CPU bf16 path's bits (it
// pools the widened values in float32 and rounds once).  The order comes in tables
// built once per geometry on the host (working it out per thread took about 70 integer
// divisions an output).  `whole` (backward): the CPU's whole-volume path, which scales
// each term before the sum over D; the plane-by-plane path scales the sum.
//
// One thread per output (forward) or per input element (backward).  NCDHW,
// C-contiguous; `planes` = N * C.
#include "common.cuh"

// geo (int32, kernels/cuda/pool_tables.py): the 15 geometry ints (input D, H, W;
// output D, H, W; kernel; stride; padding before), the offsets of the D, H and W order
// tables, then the tables: per output (forward) or input index (backward) along a
// dimension, a row of k + 1 ints, the count and then the indices in adding order.
// Static across steps, so a captured graph replays it.
struct Pool {
    int d_in, h_in, w_in, d_out, h_out, w_out, kd, kh, kw, sd, sh, sw, dl, hl, wl;
};

__device__ __forceinline__ Pool load_pool(const int* v) {
    return Pool{v[0], v[1], v[2], v[3], v[4], v[5], v[6], v[7], v[8], v[9], v[10], v[11],
                v[12], v[13], v[14]};
}

// The order row of index `index` along dimension `dim` (kernel size k): count, indices.
__device__ __forceinline__ const int* order(const int* geo, int dim, int index, int k) {
    return geo + geo[15 + dim] + (i64)index * (k + 1);
}

template <class T>
__device__ void avgpool_forward_body(const T* __restrict__ x, T* __restrict__ y, i64 planes,
                                     const int* geo, float scale) {
    const Pool g = load_pool(geo);
    const i64 out_volume = (i64)g.d_out * g.h_out * g.w_out;
    const i64 in_volume = (i64)g.d_in * g.h_in * g.w_in;
    GRID_STRIDE(i, planes * out_volume) {
        const int w = (int)(i % g.w_out), h = (int)((i / g.w_out) % g.h_out);
        const int z = (int)((i / ((i64)g.w_out * g.h_out)) % g.d_out);
        const T* xc = x + (i / out_volume) * in_volume;
        const int* ds = order(geo, 0, z, g.kd);
        const int* hs = order(geo, 1, h, g.kh);
        const int* ws = order(geo, 2, w, g.kw);
        const int nd = *ds++, nh = *hs++, nw = *ws++;
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
           (const T* x, T* y, i64 planes, const int* geo, float scale),
           <T>(x, y, planes, geo, scale))

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
        const int* zs = order(geo, 0, p, g.kd);
        const int* hs = order(geo, 1, r, g.kh);
        const int* ws = order(geo, 2, w, g.kw);
        const int nz = *zs++, nh = *hs++, nw = *ws++;
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
