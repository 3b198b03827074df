// residual_add: out = a + b.
//   backward: da += dout,  db += dout
// a, b and out are activations; in the backward, da and dout are residual-stream gradients (float) and
// db is the branch's gradient (act_t), an input of the branch's matrix products.
#include "common.cuh"

extern "C" __global__ void k_residual_add(act_t* out, const act_t* a, const act_t* b, long long n) {
    GRID_STRIDE_LOOP(i, n) store(out + i, to_f32(a[i]) + to_f32(b[i]));
}

extern "C" __global__ void k_residual_add_bwd(float* da, act_t* db, const float* dout, long long n) {
    GRID_STRIDE_LOOP(i, n) {
        const float d = dout[i];
        da[i] += d;
        store(db + i, to_f32(db[i]) + d);
    }
}
