// MSE loss and its gradient in one pass, with the finiteness verdict, on the device.
//
// grad = (pred - target) * factor, factor = float32(2 / total_count) (kernels/loss.py's
// mse_backward: the same float32 operations, so the same bits; bf16 storage rounds the
// gradient once, as the CPU bf16 path does); target is float32.  The loss sum adds
// (double)(pred - target)^2 into *sum in float64: each thread sums its grid-stride
// elements, then one atomicAdd.  That order is not numpy's pairwise one, so the sum is
// the CPU's to float64 rounding (about 1e-16 relative per term), not bit for bit, and
// it may differ between two device runs in its last bits.  *nonfinite is set to 1 when
// any difference is NaN or infinite: the step's verdict stays on the device, and the
// host reads it (with the sum) one step later, without a wait inside the step.
#include "common.cuh"

template <class T>
__device__ void mse_body(const T* __restrict__ pred, const float* __restrict__ target,
                         T* __restrict__ grad, i64 n, float factor, double* sum,
                         int* nonfinite) {
    double local = 0.0;
    int bad = 0;
    GRID_STRIDE(i, n) {
        const float diff = __fsub_rn(load_f(pred, i), target[i]);
        if (grad) store_f(grad, i, __fmul_rn(diff, factor));
        local += (double)diff * (double)diff;
        bad |= !isfinite(diff);
    }
    if (local != 0.0 || bad) atomicAdd(sum, local);
    if (bad) atomicOr(nonfinite, 1);
}

COSMO_BOTH(mse,
           (const T* pred, const float* target, T* grad, i64 n, float factor, double* sum,
            int* nonfinite),
           <T>(pred, target, grad, n, factor, sum, nonfinite))
