// A step's few host values written into device memory by one launch, from its arguments.
//
// Why not a copy: a copy from pageable host memory makes the host wait, and one from a
// pinned buffer needs that buffer kept until the device has run the copy (a ring of
// buffers and events).  A kernel's arguments are copied when it is launched, so the host
// may change the values for the next step at once.  Outside a captured CUDA graph these
// launches refresh what the graph reads from device memory at each replay: the step
// count (dropout's streams), the guards' votes and the optimizer's hyperparameters
// (engine/step_scalars.py).  Up to eight values a launch; n says how many are written.
#include "common.cuh"

extern "C" __global__ void put_f64x8(double* dst, int n, double v0, double v1, double v2,
                                     double v3, double v4, double v5, double v6, double v7) {
    const double values[8] = {v0, v1, v2, v3, v4, v5, v6, v7};
    GRID_STRIDE(i, n) { dst[i] = values[i]; }
}

extern "C" __global__ void put_f32x8(float* dst, int n, float v0, float v1, float v2, float v3,
                                     float v4, float v5, float v6, float v7) {
    const float values[8] = {v0, v1, v2, v3, v4, v5, v6, v7};
    GRID_STRIDE(i, n) { dst[i] = values[i]; }
}
