// SGD with momentum and Adam as multi-tensor kernels over flat float32 buckets, and
// the gradients' finiteness check, all applying or skipping on device flags.
//
// One launch updates every tensor of a list: `ptrs` holds the tensors' addresses per
// role (data, grad, then the state arrays; role r of tensor t at ptrs[r * tensors + t])
// and `offsets` their prefix sums of sizes (tensors + 1 entries); each thread finds its
// tensor by binary search.  The hyperparameters are read from device memory (`hyper`),
// so the learning rate and the step count change without a new launch configuration,
// as a captured CUDA graph needs.  When *skip is non-zero nothing is written: a step
// with a non-finite gradient or loss is never applied, and the host need not wait for
// the verdict before launching the update.
//
// Arithmetic: kernels/compiled/native/optim.c's operations in its order, each product rounded
// (no fused multiply-add), so the results are its bits and engine/optim.py's.
#include "common.cuh"

__device__ __forceinline__ int tensor_of(const i64* offsets, int tensors, i64 i) {
    int lo = 0, hi = tensors - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (offsets[mid] <= i) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}

// Element i of the concatenated tensors: tensor t, index j; at(r) is role r there.
struct Slot {
    const unsigned long long* ptrs;
    int tensors, t;
    i64 j;
    __device__ float& operator()(int r) const { return ((float*)ptrs[(i64)r * tensors + t])[j]; }
};

__device__ __forceinline__ Slot slot(const unsigned long long* ptrs, const i64* offsets,
                                     int tensors, i64 i) {
    const int t = tensor_of(offsets, tensors, i);
    return Slot{ptrs, tensors, t, i - offsets[t]};
}

// The gradient with weight decay, as Optimizer.apply forms it: grad + data * decay
// (none when decay is 0, as there).
__device__ __forceinline__ float decayed(const Slot& at, float decay) {
    return decay != 0.0f ? __fadd_rn(at(1), __fmul_rn(at(0), decay)) : at(1);
}

// hyper: momentum, lr, first (1: the buffer starts as the gradient, torch's first
// step), weight decay.
extern "C" __global__ void sgd_momentum_multi(const unsigned long long* ptrs,
                                              const i64* offsets, int tensors,
                                              const float* hyper, const int* skip) {
    if (skip && *skip) return;
    const float momentum = hyper[0], lr = hyper[1];
    const int first = hyper[2] != 0.0f;
    const float decay = hyper[3];
    GRID_STRIDE(i, offsets[tensors]) {
        const Slot at = slot(ptrs, offsets, tensors, i);  // roles: data, grad, buffer
        const float g = decayed(at, decay);
        const float b = first ? g : __fadd_rn(__fmul_rn(at(2), momentum), g);
        at(2) = b;
        at(0) = __fsub_rn(at(0), __fmul_rn(b, lr));
    }
}

// hyper: beta1, 1 - beta1, beta2, 1 - beta2, sqrt(1 - beta2^t), eps,
// lr / (1 - beta1^t), each rounded to float32 as optim_update.adam rounds them, then
// the weight decay.
extern "C" __global__ void adam_multi(const unsigned long long* ptrs, const i64* offsets,
                                      int tensors, const float* hyper, const int* skip) {
    if (skip && *skip) return;
    const float beta1 = hyper[0], one_minus_beta1 = hyper[1], beta2 = hyper[2];
    const float one_minus_beta2 = hyper[3], bias2_sqrt = hyper[4], eps = hyper[5];
    const float step_size = hyper[6], decay = hyper[7];
    GRID_STRIDE(i, offsets[tensors]) {
        const Slot at = slot(ptrs, offsets, tensors, i);  // roles: data, grad, m, v
        const float g = decayed(at, decay);
        const float mi = __fadd_rn(__fmul_rn(at(2), beta1), __fmul_rn(g, one_minus_beta1));
        const float vi = __fadd_rn(__fmul_rn(at(3), beta2),
                                   __fmul_rn(__fmul_rn(g, g), one_minus_beta2));
        at(2) = mi;
        at(3) = vi;
        const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(vi), bias2_sqrt), eps);
        at(0) = __fsub_rn(at(0), __fmul_rn(__fdiv_rn(mi, denom), step_size));
    }
}

// *flag = 1 when any element of the float32 array x is NaN or infinite (the gradient
// buckets' verdict, on the device: the update above skips on it).
extern "C" __global__ void nonfinite_flag(const float* __restrict__ x, i64 n, int* flag) {
    int bad = 0;
    GRID_STRIDE(i, n) { bad |= !isfinite(x[i]); }
    if (bad) atomicOr(flag, 1);
}
