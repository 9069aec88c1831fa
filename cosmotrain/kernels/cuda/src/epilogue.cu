// Convolution epilogue: bias + LeakyReLU in one pass, and LeakyReLU's backward alone.
//
// Forward: v = x + bias[c] (float32), y = v > 0 ? v : v * slope, the value of numpy's
// max(v, slope * v) for 0 <= slope <= 1 (kernels/activation.py), in place when y == x.
// Backward (a layer whose activation no pooling follows; an average pooling fuses it,
// avgpool.cu): dx = dy * (y > 0 ? up : down), the factors of
// leaky_factors.backward_factors, the product native/activation.c forms.  Bias is float32
// (the parameters' dtype) whatever the storage dtype.  bf16: one rounding, of the
// activation's output; the layers' unfused path (conv3d adds the bias rounded to bf16,
// rounds the sum, then the activation rounds again) agrees within bf16 rounding.
#include "common.cuh"

template <class T>
__device__ void bias_leaky_relu_body(const T* x, T* y, const float* __restrict__ bias,
                                     i64 samples, int channels, i64 spatial, float slope) {
    GRID_STRIDE(i, samples * channels * spatial) {
        const float v = bias ? __fadd_rn(load_f(x, i), bias[(i / spatial) % channels])
                             : load_f(x, i);
        store_f(y, i, v > 0.0f ? v : __fmul_rn(v, slope));
    }
}

COSMO_BOTH(bias_leaky_relu,
           (const T* x, T* y, const float* bias, i64 samples, int channels, i64 spatial,
            float slope),
           <T>(x, y, bias, samples, channels, spatial, slope))

template <class T>
__device__ void leaky_relu_backward_body(const T* dy, const T* __restrict__ y, T* dx, i64 n,
                                         float up, float down) {
    GRID_STRIDE(i, n) {
        store_f(dx, i, __fmul_rn(load_f(dy, i), load_f(y, i) > 0.0f ? up : down));
    }
}

COSMO_BOTH(leaky_relu_backward, (const T* dy, const T* y, T* dx, i64 n, float up, float down),
           <T>(dy, y, dx, n, up, down))
