// mlp: out = GELU(inp @ W_1) @ W_2, GELU the tanh approximation (as GPT-2); saves pre and act.
//   forward:  pre = inp @ W_1,  act = GELU(pre),  out = act @ W_2
//   backward: dW_2 += act^T dout,  dpre = (dout @ W_2^T) * GELU'(pre),  dW_1 += inp^T dpre,
//             dinp += dpre @ W_1^T
// cuBLAS does the four products; these kernels are the GELU epilogues.
#include "common.cuh"

// gelu and gelu_grad (the tanh approximation) are in common.cuh: fp8.cu's cast of the gradient at pre applies
// gelu_grad too.

// Also the backward's recomputation of act when only pre is kept (recompute "gelu"). With `amax` (precision
// fp8; else null) also the amax of act as stored (block_amax).
extern "C" __global__ void k_mlp_fwd(act_t* act, const act_t* pre, long long n, unsigned* amax) {
    float m = 0.0f;
    elementwise(n, aligned16(act, pre),
        [&](long long i) {
            float v[ACT_VEC];
            load_vec(pre + i, v);
#pragma unroll
            for (int k = 0; k < ACT_VEC; k++) {
                v[k] = gelu(v[k]);
                m = fmaxf(m, fabsf(v[k]));
            }
            store_vec(act + i, v);
        },
        [&](long long i) {
            const float v = gelu(to_f32(pre[i]));
            m = fmaxf(m, fabsf(v));
            store(act + i, v);
        });
    if (amax != nullptr) block_amax(amax, m);
}

// dpre holds dout @ W_2^T on entry and the gradient at pre on return; with `amax`, its amax as stored.
extern "C" __global__ void k_mlp_bwd(act_t* dpre, const act_t* pre, long long n, unsigned* amax) {
    float m = 0.0f;
    elementwise(n, aligned16(dpre, pre),
        [&](long long i) {
            float x[ACT_VEC], d[ACT_VEC];
            load_vec(pre + i, x);
            load_vec(dpre + i, d);
#pragma unroll
            for (int k = 0; k < ACT_VEC; k++) {
                d[k] *= gelu_grad(x[k]);
                m = fmaxf(m, fabsf(d[k]));
            }
            store_vec(dpre + i, d);
        },
        [&](long long i) {
            const float d = to_f32(dpre[i]) * gelu_grad(to_f32(pre[i]));
            m = fmaxf(m, fabsf(d));
            store(dpre + i, d);
        });
    if (amax != nullptr) block_amax(amax, m);
}
