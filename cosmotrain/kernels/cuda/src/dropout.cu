// Inverted dropout, forward and backward (the same kernel: the mask is recomputed).
//
// The mask is kernels/dropout.py's bit for bit: a splitmix64 finaliser of
// (global row-major index * golden + key), the top 53 bits as a uniform in [0, 1), kept
// where uniform >= p; the key is dropout.stream_key(seed, step, salt), worked out here
// from the step count in device memory (engine/step_scalars.py: a float64 holding an
// integer), so a captured CUDA graph draws a new mask at every replay.  The index is the
// element's position in the *global* tensor (the local block's shape, its offset in the
// global tensor and the global shape, up to 5 dimensions, leading ones padded with 1),
// so every rank layout draws the same mask.  Kept values times scale (float32
// 1 / (1 - p), numpy's rounding), dropped ones 0; bf16 widens, multiplies and rounds once,
// as the CPU bf16 path does.  No mask is stored: the backward recomputes it.
#include "common.cuh"

typedef unsigned long long u64;

__device__ __forceinline__ u64 splitmix_mix(u64 z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

// dropout.stream_key: the seed mixed with the step, then with the layer's salt.
__device__ __forceinline__ u64 stream_key(u64 seed, u64 step, u64 salt) {
    const u64 golden = 0x9E3779B97F4A7C15ULL;
    const u64 key = splitmix_mix(seed + golden * (step + 1));
    return splitmix_mix(key + golden * (salt + 1));
}

// shape: local[5], offset[5], global[5] as 15 longs in device memory; *step: the step
// count (a float64 holding an integer below 2^53).
template <class T>
__device__ void dropout_body(const T* x, T* y, const i64* __restrict__ shape, u64 seed,
                             u64 salt, const double* step, double p, float scale) {
    const u64 key = stream_key(seed, (u64)(i64)*step, salt);
    const i64 total = shape[0] * shape[1] * shape[2] * shape[3] * shape[4];
    GRID_STRIDE(i, total) {
        i64 rest = i, coord[5];
        for (int axis = 4; axis >= 0; axis--) {
            coord[axis] = rest % shape[axis];
            rest /= shape[axis];
        }
        u64 index = 0;
        for (int axis = 0; axis < 5; axis++)
            index = index * (u64)shape[10 + axis] + (u64)(coord[axis] + shape[5 + axis]);
        const u64 bits = splitmix_mix(index * 0x9E3779B97F4A7C15ULL + key);
        const double uniform = (double)(bits >> 11) * (1.0 / 9007199254740992.0);
        store_f(y, i, uniform >= p ? __fmul_rn(load_f(x, i), scale) : 0.0f);
    }
}

COSMO_BOTH(dropout,
           (const T* x, T* y, const i64* shape, u64 seed, u64 salt, const double* step,
            double p, float scale),
           <T>(x, y, shape, seed, salt, step, p, scale))
