// The dense head (kernels/linear.py) without cuBLAS: a CUDA graph cannot capture cupy's
// matmul (cupy refuses cublas.setStream under capture), so ConvSettings.dense="kernels"
// runs these three instead.
//
// y = a @ B + bias, where B is indexed B[j * b_out + k * b_in]:
//   forward        y = x @ W^T + b:  a = x (N, K), W (O, K): b_out = K, b_in = 1;
//   backward data  dx = dy @ W:      a = dy (N, O), W (O, I): b_out = 1, b_in = I.
// dW = dy^T x and db = sum_n dy (float32 whatever the storage: the weight gradient is
// accumulated into float32 parameters, as the CPU path's).
//
// Arithmetic: float32 products and sums, each rounded (__fmul_rn / __fadd_rn: no fused
// multiply-add), one rounding to the storage dtype at the end (bf16 operands are read as
// stored).  Order: each output adds its inner dimension in ascending order within
// chunks of `chunk` terms, then the chunks' partial sums in ascending order, then the
// bias.  cuBLAS and numpy add in orders of their own, so the results are theirs within
// float32 summation error (at most (chunk + splits + 1) roundings of the sum of the
// absolute products); the weight gradient of one sample (N = 1) is one product per
// element, the CPU's outer product bit for bit, and db adds the samples in order, as
// numpy's sum over axis 0 does, bit for bit.
//
// Launches: forward and backward data one (linear_partial writes y) or, when the inner
// dimension is split into chunks so that enough threads run (kernels/cuda/raw_linear.py
// picks `chunk`), two: linear_partial writes float32 partial sums, linear_reduce adds
// them and the bias.  Weight and bias gradients together: one linear_wgrad.  No block
// synchronisation: the split's second phase is a second launch, so the host shim runs
// both (tests/cuda_host.py).
//
// Cost: memory-bound on the weight, read once per tile of LINEAR_TILE samples (once for
// N <= 8); the partial sums add 2 * splits * N * O * 4 bytes.  The paper network's fc1
// (2048 x 2048, 16 MiB in float32) takes at least 3.5 us at 4.8 TB/s in each pass.
#include "common.cuh"

// Samples per thread: the thread's stretch of B is read once for them all.
#define LINEAR_TILE 8

template <class T>
__device__ void linear_partial_body(const T* __restrict__ a, const T* __restrict__ b,
                                    const T* __restrict__ bias, T* __restrict__ y,
                                    float* __restrict__ part, i64 samples, i64 outputs,
                                    i64 inner, i64 b_out, i64 b_in, i64 chunk, i64 splits) {
    const i64 tiles = (samples + LINEAR_TILE - 1) / LINEAR_TILE;
    // j fastest: a warp shares its samples and chunk (a's loads are broadcasts) and, in
    // the data gradient (b_out = 1), reads B coalesced.
    GRID_STRIDE(i, splits * tiles * outputs) {
        const i64 j = i % outputs, tile = (i / outputs) % tiles, s = i / (outputs * tiles);
        const i64 n0 = tile * LINEAR_TILE;
        const i64 k0 = s * chunk, k1 = k0 + chunk < inner ? k0 + chunk : inner;
        float acc[LINEAR_TILE];
#pragma unroll
        for (int q = 0; q < LINEAR_TILE; q++) acc[q] = 0.0f;
        // unrolled for loads in flight; the adds stay in order (the bits do not change)
#pragma unroll 4
        for (i64 k = k0; k < k1; k++) {
            const float w = load_f(b, j * b_out + k * b_in);
#pragma unroll
            for (int q = 0; q < LINEAR_TILE; q++) {
                if (n0 + q < samples)
                    acc[q] = __fadd_rn(acc[q], __fmul_rn(load_f(a, (n0 + q) * inner + k), w));
            }
        }
#pragma unroll
        for (int q = 0; q < LINEAR_TILE; q++) {
            if (n0 + q >= samples) continue;
            const i64 at = (n0 + q) * outputs + j;
            if (part) {
                part[s * samples * outputs + at] = acc[q];
            } else {
                store_f(y, at, bias ? __fadd_rn(acc[q], load_f(bias, j)) : acc[q]);
            }
        }
    }
}

COSMO_BOTH(linear_partial,
           (const T* a, const T* b, const T* bias, T* y, float* part, i64 samples,
            i64 outputs, i64 inner, i64 b_out, i64 b_in, i64 chunk, i64 splits),
           <T>(a, b, bias, y, part, samples, outputs, inner, b_out, b_in, chunk, splits))

// y = (part[0] + part[1] + ... + part[splits - 1]) + bias, rounded once to T.
template <class T>
__device__ void linear_reduce_body(const float* __restrict__ part, const T* __restrict__ bias,
                                   T* __restrict__ y, i64 splits, i64 samples, i64 outputs) {
    const i64 size = samples * outputs;
    GRID_STRIDE(i, size) {
        float total = part[i];
        for (i64 s = 1; s < splits; s++) total = __fadd_rn(total, part[s * size + i]);
        store_f(y, i, bias ? __fadd_rn(total, load_f(bias, i % outputs)) : total);
    }
}

COSMO_BOTH(linear_reduce,
           (const float* part, const T* bias, T* y, i64 splits, i64 samples, i64 outputs),
           <T>(part, bias, y, splits, samples, outputs))

// dw[o, c] = sum_n dy[n, o] * x[n, c] and (db not null) db[o] = sum_n dy[n, o], the
// samples in ascending order, float32.  One thread per weight, then one per bias: a warp
// reads x coalesced and dy as a broadcast, and writes dw coalesced.
template <class T>
__device__ void linear_wgrad_body(const T* __restrict__ x, const T* __restrict__ dy,
                                  float* __restrict__ dw, float* __restrict__ db, i64 samples,
                                  i64 outputs, i64 inputs) {
    const i64 weights = outputs * inputs;
    GRID_STRIDE(i, weights + (db ? outputs : 0)) {
        float total = 0.0f;
        if (i < weights) {
            const i64 o = i / inputs, c = i % inputs;
#pragma unroll 4
            for (i64 n = 0; n < samples; n++) {
                const float p = __fmul_rn(load_f(dy, n * outputs + o), load_f(x, n * inputs + c));
                total = n ? __fadd_rn(total, p) : p;
            }
            dw[i] = total;
        } else {
            const i64 o = i - weights;
            for (i64 n = 0; n < samples; n++) {
                const float g = load_f(dy, n * outputs + o);
                total = n ? __fadd_rn(total, g) : g;
            }
            db[o] = total;
        }
    }
}

COSMO_BOTH(linear_wgrad,
           (const T* x, const T* dy, float* dw, float* db, i64 samples, i64 outputs,
            i64 inputs),
           <T>(x, dy, dw, db, samples, outputs, inputs))
