// Batch norm's passes over the activations (kernels/batchnorm.py's device route), each
// reading the storage dtype (float32, or bf16) once, as stored: no widening pass.
//
// channel_sums: per channel, sum(a) and sum(a * b) in float64 (b null: sum(a * a)), the
// forward's [sum x, sum x^2] and the backward's [sum dy, sum dy * xhat].  Each block
// reduces one slice of one channel (the channel's samples x voxels dealt out over
// `slices` blocks, consecutive threads on consecutive voxels), tree-sums its threads'
// partials in shared memory and adds the block's two sums into out[c] and
// out[channels + c] with float64 atomics: out must start at zero.  The products are
// exact in float64 (two 24-bit significands), so the sums differ from numpy's pairwise
// float64 order only by float64 rounding, and between two device runs in their last
// bits (the atomics' order).  With a count row (out has three) out[2 * channels + c]
// is set to the elements per channel, bn_local_sums' third row.
//
// bn_forward: xhat = (x - mean[c]) * inv_std[c], y = xhat * gamma[c] + beta[c], the CPU's
// float32 operations in its order (mean float64, rounded to float32 as the CPU rounds
// it); xhat is written only when asked (training keeps it for the backward).
//
// bn_train_forward: the statistics, the running statistics and bn_forward in one launch,
// from the reduced sums (below).
//
// bn_backward_apply: dx = (dy - (xhat * mean_dy_xhat[c] + mean_dy[c])) * scale[c]
// (scale = gamma * inv_std), kernels/batchnorm.py's bn_backward_apply in its order, the
// per-channel factors worked out from the reduced sums in each block.
//
// bf16: float32 arithmetic on the widened values and one rounding of what is stored,
// the CPU bf16 path's bits.
#include "common.cuh"

// Threads a block may have: the shared-memory tree holds two sums per thread.
#define BN_MAX_THREADS 1024

// Sum of every thread's (s, q) into thread 0's, through shared memory, for any block
// size (the host shim runs blocks of 1 to 4 threads, the device 256): the threads past
// the largest power of two p <= n fold onto the first ones, then a tree halves p with
// consecutive threads on consecutive words (no bank conflicts, whole warps idle).
__device__ __forceinline__ void block_sums(double& s, double& q, double* shared) {
    const unsigned t = threadIdx.x, n = blockDim.x;
    unsigned p = 1;
    while (2 * p <= n) p *= 2;
    shared[t] = s;
    shared[n + t] = q;
    __syncthreads();
    if (t + p < n) {
        shared[t] += shared[t + p];
        shared[n + t] += shared[n + t + p];
    }
    __syncthreads();
    for (unsigned stride = p / 2; stride > 0; stride /= 2) {
        if (t < stride) {
            shared[t] += shared[t + stride];
            shared[n + t] += shared[n + t + stride];
        }
        __syncthreads();
    }
    s = shared[0];
    q = shared[n];
    __syncthreads();  // every thread has read them before the next slice writes
}

template <class T>
__device__ void channel_sums_body(const T* __restrict__ a, const T* __restrict__ b,
                                  double* out, i64 samples, int channels, i64 spatial,
                                  int slices, int with_count) {
    __shared__ double shared[2 * BN_MAX_THREADS];
    const i64 items = (i64)channels * slices;
    for (i64 item = blockIdx.x; item < items; item += gridDim.x) {  // uniform per block
        const int c = (int)(item / slices), g = (int)(item % slices);
        double s = 0.0, q = 0.0;
        for (i64 n = 0; n < samples; ++n) {
            const i64 base = (n * channels + c) * spatial;
            for (i64 v = (i64)g * blockDim.x + threadIdx.x; v < spatial;
                 v += (i64)slices * blockDim.x) {
                const double x = (double)load_f(a, base + v);
                s += x;
                q += x * (b ? (double)load_f(b, base + v) : x);
            }
        }
        block_sums(s, q, shared);
        if (threadIdx.x == 0) {
            atomicAdd(out + c, s);
            atomicAdd(out + channels + c, q);
            if (with_count && g == 0) out[2 * channels + c] = (double)(samples * spatial);
        }
    }
}

COSMO_BOTH(channel_sums,
           (const T* a, const T* b, double* out, i64 samples, int channels, i64 spatial,
            int slices, int with_count),
           <T>(a, b, out, samples, channels, spatial, slices, with_count))

// Element i: xhat = (x - mean) * inv_std (kept when xhat is not null), y = xhat * gamma
// + beta, each operation rounded as numpy's.
template <class T>
__device__ __forceinline__ void normalize_at(const T* __restrict__ x, T* __restrict__ y,
                                             T* __restrict__ xhat, i64 i, float mean,
                                             float inv_std, float gamma, float beta) {
    const float h = __fmul_rn(__fsub_rn(load_f(x, i), mean), inv_std);
    if (xhat) store_f(xhat, i, h);
    store_f(y, i, __fadd_rn(__fmul_rn(h, gamma), beta));
}

template <class T>
__device__ void bn_forward_body(const T* __restrict__ x, T* __restrict__ y,
                                T* __restrict__ xhat, const double* __restrict__ mean,
                                const float* __restrict__ inv_std,
                                const float* __restrict__ gamma,
                                const float* __restrict__ beta, i64 samples, int channels,
                                i64 spatial) {
    GRID_STRIDE(i, samples * channels * spatial) {
        const int c = (int)((i / spatial) % channels);
        normalize_at(x, y, xhat, i, (float)mean[c], inv_std[c], gamma[c], beta[c]);
    }
}

COSMO_BOTH(bn_forward,
           (const T* x, T* y, T* xhat, const double* mean, const float* inv_std,
            const float* gamma, const float* beta, i64 samples, int channels, i64 spatial),
           <T>(x, y, xhat, mean, inv_std, gamma, beta, samples, channels, spatial))

// Channels bn_train_forward keeps per-channel statistics for in shared memory.
#define BN_MAX_CHANNELS 1024

// Training forward from the reduced sums (out of channel_sums, then summed over the
// ranks): every block works the statistics of every channel out into shared memory
// (kernels/batchnorm.py's bn_statistics in float64, in its order: the count raised to 1,
// mean = sum / count, var = max(squares / count - mean^2, 0), inv_std = float32 of
// 1 / sqrt(var + eps)), then normalises as bn_forward.  Block 0 also writes inv_std
// (the backward's) and the running statistics in place, nn.layers.BatchNorm3d's rule:
// running = float32((float32(1 - m) * running) + m * mean), the variance unbiased by
// count / max(count - 1, 1) with channel 0's count; with `guard` only where that count is
// not 0 (layers.batchnorm.DistBatchNorm3d: an empty sample group keeps its statistics).
template <class T>
__device__ void bn_train_forward_body(const T* __restrict__ x, T* __restrict__ y,
                                      T* __restrict__ xhat, const double* __restrict__ sums,
                                      const float* __restrict__ gamma,
                                      const float* __restrict__ beta, float* running_mean,
                                      float* running_var, float* inv_std_out, double eps,
                                      double momentum, float keep, int guard, i64 samples,
                                      int channels, i64 spatial) {
    __shared__ double mean_of[BN_MAX_CHANNELS];
    __shared__ float inv_std_of[BN_MAX_CHANNELS];
    const double seen = sums[2 * channels];
    for (int c = threadIdx.x; c < channels; c += blockDim.x) {
        const double raw_count = sums[2 * channels + c];
        const double count = raw_count < 1.0 ? 1.0 : raw_count;
        const double mean = __ddiv_rn(sums[c], count);
        double var = __dsub_rn(__ddiv_rn(sums[channels + c], count), __dmul_rn(mean, mean));
        var = var < 0.0 ? 0.0 : var;  // clip(min=0): NaN stays NaN, as numpy's
        const float inv_std = (float)__ddiv_rn(1.0, __dsqrt_rn(__dadd_rn(var, eps)));
        mean_of[c] = mean;
        inv_std_of[c] = inv_std;
        if (blockIdx.x == 0) {
            inv_std_out[c] = inv_std;
            if (!guard || seen > 0.0) {
                const double less = __dsub_rn(seen, 1.0);
                const double unbiased = __dmul_rn(var, __ddiv_rn(seen, less < 1.0 ? 1.0 : less));
                running_mean[c] = (float)__dadd_rn((double)__fmul_rn(keep, running_mean[c]),
                                                   __dmul_rn(momentum, mean));
                running_var[c] = (float)__dadd_rn((double)__fmul_rn(keep, running_var[c]),
                                                  __dmul_rn(momentum, unbiased));
            }
        }
    }
    __syncthreads();
    GRID_STRIDE(i, samples * channels * spatial) {
        const int c = (int)((i / spatial) % channels);
        normalize_at(x, y, xhat, i, (float)mean_of[c], inv_std_of[c], gamma[c], beta[c]);
    }
}

COSMO_BOTH(bn_train_forward,
           (const T* x, T* y, T* xhat, const double* sums, const float* gamma,
            const float* beta, float* running_mean, float* running_var, float* inv_std_out,
            double eps, double momentum, float keep, int guard, i64 samples, int channels,
            i64 spatial),
           <T>(x, y, xhat, sums, gamma, beta, running_mean, running_var, inv_std_out, eps,
               momentum, keep, guard, samples, channels, spatial))

// The input gradient: every block first works the per-channel factors out into shared
// memory, kernels/batchnorm.py's: mean_dy = float32(sum_dy / n), mean_dy_xhat =
// float32(sum_dy_xhat / n) with n = max(*count, 1), scale = gamma * inv_std (float32).
template <class T>
__device__ void bn_backward_apply_body(const T* __restrict__ dy, const T* __restrict__ xhat,
                                       T* __restrict__ dx, const double* __restrict__ sums,
                                       const double* __restrict__ count,
                                       const float* __restrict__ gamma,
                                       const float* __restrict__ inv_std, i64 samples,
                                       int channels, i64 spatial) {
    __shared__ float factors[3 * BN_MAX_CHANNELS];  // mean_dy, mean_dy_xhat, scale
    const double n = *count < 1.0 ? 1.0 : *count;   // numpy's maximum: NaN stays NaN
    for (int c = threadIdx.x; c < channels; c += blockDim.x) {
        factors[c] = (float)__ddiv_rn(sums[c], n);
        factors[channels + c] = (float)__ddiv_rn(sums[channels + c], n);
        factors[2 * channels + c] = __fmul_rn(gamma[c], inv_std[c]);
    }
    __syncthreads();
    GRID_STRIDE(i, samples * channels * spatial) {
        const int c = (int)((i / spatial) % channels);
        const float shift = __fadd_rn(__fmul_rn(load_f(xhat, i), factors[channels + c]),
                                      factors[c]);
        store_f(dx, i, __fmul_rn(__fsub_rn(load_f(dy, i), shift), factors[2 * channels + c]));
    }
}

COSMO_BOTH(bn_backward_apply,
           (const T* dy, const T* xhat, T* dx, const double* sums, const double* count,
            const float* gamma, const float* inv_std, i64 samples, int channels,
            i64 spatial),
           <T>(dy, xhat, dx, sums, count, gamma, inv_std, samples, channels, spatial))
