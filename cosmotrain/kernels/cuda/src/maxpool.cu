// Max pooling over 2x2x2 windows that tile the input (kernel = stride = 2, no padding:
// the MLPerf network's pooling), forward with the argmax, backward from it.
//
// Forward: the CPU's exact rule (kernels/compiled/native/maxpool.c, window_exact): taps in offset
// order (a*2 + b)*2 + e, a later tap wins only when strictly greater, and a window
// holding a NaN gives its first NaN and that offset.  The argmax is int8, as on the CPU.
// No host check for NaN (the xp kernel's `bool(isnan(y).any())` was a host wait per
// layer): the rule is applied per window on the device.
// Backward: every input element written once, dy at its window's argmax and 0 elsewhere
// (no products: an infinite dy stays in its tap); elements in no window (odd sizes) 0.
// bf16 compares the widened values: the CPU bf16 path's maxima and offsets.
#include "common.cuh"

template <class T>
__device__ void maxpool2_forward_body(const T* __restrict__ x, T* __restrict__ y,
                                      signed char* __restrict__ arg, i64 planes, int d_in,
                                      int h_in, int w_in) {
    const int d_out = d_in / 2, h_out = h_in / 2, w_out = w_in / 2;
    const i64 out_volume = (i64)d_out * h_out * w_out, in_volume = (i64)d_in * h_in * w_in;
    GRID_STRIDE(i, planes * out_volume) {
        const int w = (int)(i % w_out), h = (int)((i / w_out) % h_out);
        const int z = (int)((i / ((i64)w_out * h_out)) % d_out);
        const T* xc = x + (i / out_volume) * in_volume;
        float best = 0.0f;
        int k = 0, nan_k = -1;
        for (int j = 0; j < 8; j++) {
            const int a = j >> 2, b = (j >> 1) & 1, e = j & 1;
            const float v = load_f(xc, ((i64)(2 * z + a) * h_in + 2 * h + b) * w_in + 2 * w + e);
            if (j == 0 || v > best) { best = v; k = j; }
            if (nan_k < 0 && isnan(v)) nan_k = j;
        }
        if (nan_k >= 0) {
            k = nan_k;
            const int a = k >> 2, b = (k >> 1) & 1, e = k & 1;
            best = load_f(xc, ((i64)(2 * z + a) * h_in + 2 * h + b) * w_in + 2 * w + e);
        }
        store_f(y, i, best);
        arg[i] = (signed char)k;
    }
}

COSMO_BOTH(maxpool2_forward,
           (const T* x, T* y, signed char* arg, i64 planes, int d_in, int h_in, int w_in),
           <T>(x, y, arg, planes, d_in, h_in, w_in))

template <class T>
__device__ void maxpool2_backward_body(const T* __restrict__ dy,
                                       const signed char* __restrict__ arg,
                                       T* __restrict__ dx, i64 planes, int d_in, int h_in,
                                       int w_in) {
    const int d_out = d_in / 2, h_out = h_in / 2, w_out = w_in / 2;
    const i64 out_volume = (i64)d_out * h_out * w_out, in_volume = (i64)d_in * h_in * w_in;
    GRID_STRIDE(i, planes * in_volume) {
        const int c = (int)(i % w_in), r = (int)((i / w_in) % h_in);
        const int p = (int)((i / ((i64)w_in * h_in)) % d_in);
        const int z = p / 2, h = r / 2, w = c / 2;
        if (z >= d_out || h >= h_out || w >= w_out) {
            store_f(dx, i, 0.0f);
            continue;
        }
        const i64 o = (i / in_volume) * out_volume + ((i64)z * h_out + h) * w_out + w;
        const int tap = ((p & 1) * 2 + (r & 1)) * 2 + (c & 1);
        if (arg[o] == tap) dx[i] = dy[o];
        else store_f(dx, i, 0.0f);
    }
}

COSMO_BOTH(maxpool2_backward,
           (const T* dy, const signed char* arg, T* dx, i64 planes, int d_in, int h_in,
            int w_in),
           <T>(dy, arg, dx, planes, d_in, h_in, w_in))
