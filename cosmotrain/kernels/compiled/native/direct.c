/* Direct 3D convolution for the CPU: forward (and, with the flipped kernel, the data
 * gradient of unit-stride layers) and the filter gradient, float32, unit stride.
 *
 * Why this exists: the numpy kernels lower a convolution to GEMMs, and OpenBLAS runs
 * the GEMMs of the thin layers (16-32 filters, K = 108-432) at 50-66 GFLOP/s on one
 * AVX-512 core against 152 for large sgemm (2026-11-27), besides the copies of the
 * lowering; PyTorch's oneDNN runs the same layers as direct convolutions near the
 * core's peak.  These loops read a zero-padded slab of the input (C, depth, Hp, Wp),
 * row by row, and keep a register block of FB filters x WV vectors of outputs.
 *
 * Built by setup.py as an optional extension (a plain shared library loaded with
 * ctypes, which releases the GIL during the call, so the kernel workers of
 * cosmotrain.kernels.cpu.workers run chunks in parallel).  Each loop is compiled twice,
 * for AVX-512 and for AVX2 + FMA, in one translation unit; cosmotrain_direct_level()
 * says which the running CPU supports (0: neither, the numpy kernels are used).
 * No -march flag: the library runs on any x86-64 and picks its loops at run time. */

#pragma GCC optimize("O3", "fp-contract=fast", "no-math-errno", "no-trapping-math")

#pragma GCC push_options
#pragma GCC target("avx512f,avx512vl,avx2,fma")
#define VL 16
#define FB 8
#define WV 2
#define SUFFIX avx512
#include "isa_loops.h"
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma")
#define VL 8
#define FB 4
#define WV 3
#define SUFFIX avx2
#include "isa_loops.h"
#pragma GCC pop_options

/* 2: AVX-512 loops (vectors of 16, blocks of 8 filters), 1: AVX2 (8 and 4), 0: none. */
int cosmotrain_direct_level(void) {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f")) return 2;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return 1;
    return 0;
}
