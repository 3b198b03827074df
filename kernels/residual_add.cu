// residual_add: out = a + b.
//   backward: da += dout,  db += dout
// a, b and out are activations; in the backward, da and dout are residual-stream gradients (float) and
// db is the branch's gradient (act_t), an input of the branch's matrix products.
#include "common.cuh"

extern "C" __global__ void k_residual_add(act_t* out, const act_t* a, const act_t* b, long long n) {
    elementwise(n, aligned16(out, a, b),
        [&](long long i) {
            float x[ACT_VEC], y[ACT_VEC];
            load_vec(a + i, x);
            load_vec(b + i, y);
#pragma unroll
            for (int k = 0; k < ACT_VEC; k++) x[k] += y[k];
            store_vec(out + i, x);
        },
        [&](long long i) { store(out + i, to_f32(a[i]) + to_f32(b[i])); });
}

extern "C" __global__ void k_residual_add_bwd(float* da, act_t* db, const float* dout, long long n) {
    elementwise(n, aligned16(da, db, dout),
        [&](long long i) {
            float d[ACT_VEC], x[ACT_VEC], y[ACT_VEC];
            load_f32(dout + i, d);
            load_f32(da + i, x);
            load_vec(db + i, y);
#pragma unroll
            for (int k = 0; k < ACT_VEC; k++) {
                x[k] += d[k];
                y[k] += d[k];
            }
            store_f32(da + i, x);
            store_vec(db + i, y);
        },
        [&](long long i) {
            const float d = dout[i];
            da[i] += d;
            store(db + i, to_f32(db[i]) + d);
        });
}
