// residual_add: out = a + b.
//   backward: da += dout,  db += dout
#include "common.cuh"

extern "C" __global__ void k_residual_add(float* out, const float* a, const float* b, long long n) {
    GRID_STRIDE_LOOP(i, n) out[i] = a[i] + b[i];
}

extern "C" __global__ void k_residual_add_bwd(float* da, float* db, const float* dout, long long n) {
    GRID_STRIDE_LOOP(i, n) {
        const float d = dout[i];
        da[i] += d;
        db[i] += d;
    }
}
