// Host shim: the CUDA names the kernels of this folder use, for the host C++ compiler.
//
// blockIdx / threadIdx / blockDim / gridDim are exported globals that the caller sets
// before calling a kernel once per (block, thread) (tests/cuda_host.py does, over the
// whole grid); __global__ / __device__ are defined away; __nv_bfloat16 is a 16-bit
// struct with bf16's conversions (round to nearest even, as cuda_bf16.h and ml_dtypes
// round); the atomics are plain read-modify-writes (the threads run one at a time);
// the _rn intrinsics are the plain IEEE operations (compile with -ffp-contract=off).
#pragma once
#define COSMO_HOST_SHIM 1

#include <cmath>
#include <cstdint>
#include <cstring>

struct dim3 { unsigned x, y, z; };
extern "C" {
dim3 blockIdx = {0, 0, 0}, threadIdx = {0, 0, 0}, blockDim = {1, 1, 1}, gridDim = {1, 1, 1};
}

#define __global__
#define __device__
#define __forceinline__ inline
#define __restrict__

struct __nv_bfloat16 { uint16_t bits; };

inline float __bfloat162float(__nv_bfloat16 h) {
    uint32_t u = (uint32_t)h.bits << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

inline __nv_bfloat16 __float2bfloat16_rn(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if (std::isnan(f)) return {(uint16_t)((u >> 16) | 0x40)};  // quiet NaN, sign kept
    u += 0x7FFFu + ((u >> 16) & 1u);
    return {(uint16_t)(u >> 16)};
}

inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fsqrt_rn(float a) { return std::sqrt(a); }
inline double atomicAdd(double* p, double v) { double old = *p; *p = old + v; return old; }
inline int atomicOr(int* p, int v) { int old = *p; *p = old | v; return old; }
using std::isfinite;
using std::isnan;

// Phases (common.cuh): the launcher sets cosmo_phase and calls every thread of a block
// once per phase; __shared__ memory is one static array per kernel, which the block's
// threads share because the host runs one block at a time.
extern "C" {
int cosmo_phase = 0;
}
#define COSMO_PHASE(k) if (cosmo_phase == (k))
#define COSMO_SYNC()
#define __shared__ static
using std::fmaf;
