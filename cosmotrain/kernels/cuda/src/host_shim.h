// Host shim: the CUDA names the kernels of this folder use, for the host C++ compiler.
//
// blockDim / gridDim are exported globals and blockIdx / threadIdx thread-local ones
// (set by cosmo_thread) that the caller sets before calling a kernel once per (block,
// thread) (tests/cuda_host.py does, over the whole grid); __global__ / __device__ are
// defined away; __nv_bfloat16 is a 16-bit struct with bf16's conversions (round to
// nearest even, as cuda_bf16.h and ml_dtypes round); the atomics are read-modify-writes
// under one lock; the _rn intrinsics are the plain IEEE operations (compile with
// -ffp-contract=off).
//
// Block-level synchronisation, two ways: a kernel split into phases (COSMO_PHASE, below)
// runs phase by phase over a block's threads; one with real barriers (batchnorm.cu's
// reductions) runs the threads of one block at a time concurrently, each on its own OS
// thread, and __syncthreads is a barrier over blockDim.x of them (it aborts after a
// minute, so a kernel whose threads miss a barrier fails instead of hanging).  Either
// way __shared__ is static storage, which the block running owns.
#pragma once
#define COSMO_HOST_SHIM 1

#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>

struct dim3 { unsigned x, y, z; };
extern "C" {
dim3 blockDim = {1, 1, 1}, gridDim = {1, 1, 1};
}
thread_local dim3 blockIdx = {0, 0, 0}, threadIdx = {0, 0, 0};
extern "C" void cosmo_thread(unsigned block, unsigned thread) {
    blockIdx = {block, 0, 0};
    threadIdx = {thread, 0, 0};
}

#define __global__
#define __device__
#define __forceinline__ inline
#define __restrict__
#define __shared__ static

namespace cosmo_shim {
inline std::mutex lock;  // the atomics', and the barrier's
inline std::condition_variable turn;
inline unsigned arrived = 0, generation = 0;
}

inline void __syncthreads() {
    std::unique_lock<std::mutex> hold(cosmo_shim::lock);
    const unsigned mine = cosmo_shim::generation;
    if (++cosmo_shim::arrived == blockDim.x) {
        cosmo_shim::arrived = 0;
        ++cosmo_shim::generation;
        cosmo_shim::turn.notify_all();
        return;
    }
    if (!cosmo_shim::turn.wait_for(hold, std::chrono::seconds(60),
                                   [mine] { return cosmo_shim::generation != mine; })) {
        std::fprintf(stderr, "host shim: __syncthreads waited a minute for the block\n");
        std::abort();
    }
}

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
inline double __dmul_rn(double a, double b) { return a * b; }
inline double __dadd_rn(double a, double b) { return a + b; }
inline double __dsub_rn(double a, double b) { return a - b; }
inline double __ddiv_rn(double a, double b) { return a / b; }
inline double __dsqrt_rn(double a) { return std::sqrt(a); }
inline double atomicAdd(double* p, double v) {
    std::lock_guard<std::mutex> hold(cosmo_shim::lock);
    double old = *p;
    *p = old + v;
    return old;
}
inline int atomicOr(int* p, int v) {
    std::lock_guard<std::mutex> hold(cosmo_shim::lock);
    int old = *p;
    *p = old | v;
    return old;
}
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
using std::fmaf;
