// Shared by every kernel of this folder: the storage types and the grid-stride loop.
//
// Kernels read and write the storage dtype (float32, or bf16 as __nv_bfloat16) and do
// their arithmetic in float32.  Products that feed a sum go through __fmul_rn /
// __fadd_rn: NVRTC contracts a * b + c into a fused multiply-add by default, which
// rounds once where numpy and the C loops (compiled with fp-contract=off) round twice;
// the intrinsics are never contracted, so the bits do not depend on compiler flags.
//
// The same file compiles with NVRTC (cuda_bf16.h from the nvidia wheels) and with the
// host C++ compiler behind host_shim.h (COSMO_HOST_SHIM), which runs a kernel on the
// CPU over its whole grid (tests/cuda_host.py).  Every kernel is a grid-stride loop
// whose results do not depend on the grid; one that stages shared memory splits at its
// barrier into phases (COSMO_PHASE below).
#pragma once

#ifndef COSMO_HOST_SHIM
#include <cuda_bf16.h>
#endif

typedef __nv_bfloat16 bf16;
typedef long long i64;

__device__ __forceinline__ float load_f(const float* p, i64 i) { return p[i]; }
__device__ __forceinline__ float load_f(const bf16* p, i64 i) { return __bfloat162float(p[i]); }
__device__ __forceinline__ void store_f(float* p, i64 i, float v) { p[i] = v; }
__device__ __forceinline__ void store_f(bf16* p, i64 i, float v) { p[i] = __float2bfloat16_rn(v); }

#define GRID_STRIDE(i, n)                                                         \
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < (i64)(n);         \
         i += (i64)blockDim.x * gridDim.x)

// extern "C" entry points for float32 (_f32) and bf16 (_bf16) storage of a template
// body `NAME##_body<T>`: RawModule and ctypes both find them by these plain names.
// PARAMS and ARGS name the storage type T, which each namespace defines (the entry
// points' C linkage ignores the namespace).
#define COSMO_BOTH(NAME, PARAMS, ARGS)                                              \
    namespace cosmo_f32 {                                                           \
    using T = float;                                                                \
    extern "C" __global__ void NAME##_f32 PARAMS { NAME##_body ARGS; }              \
    }                                                                               \
    namespace cosmo_bf16 {                                                          \
    using T = bf16;                                                                 \
    extern "C" __global__ void NAME##_bf16 PARAMS { NAME##_body ARGS; }             \
    }

// Block-level phases: a kernel that stages data in __shared__ memory writes each part
// between two barriers as COSMO_PHASE(k) { ... } separated by COSMO_SYNC().  On the device
// every phase runs and COSMO_SYNC is __syncthreads; the host shim defines them so that
// tests/cuda_host.py runs phase k for every thread of a block before phase k + 1 (a
// value carried across a barrier must live in __shared__ memory, as on the device).
#ifndef COSMO_HOST_SHIM
#define COSMO_PHASE(k) if (true)
#define COSMO_SYNC() __syncthreads()
#endif
