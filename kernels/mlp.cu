// mlp: out = GELU(inp @ W_1) @ W_2, GELU the tanh approximation (as GPT-2); saves pre and act.
//   forward:  pre = inp @ W_1,  act = GELU(pre),  out = act @ W_2
//   backward: dW_2 += act^T dout,  dpre = (dout @ W_2^T) * GELU'(pre),  dW_1 += inp^T dpre,
//             dinp += dpre @ W_1^T
// cuBLAS does the four products; these kernels are the GELU epilogues.
#include "common.cuh"

#define GELU_K 0.7978845608028654f  // sqrt(2 / pi)
#define GELU_C 0.044715f

// Also the backward's recomputation of act when only pre is kept (recompute_gelu).
extern "C" __global__ void k_mlp_fwd(act_t* act, const act_t* pre, long long n) {
    GRID_STRIDE_LOOP(i, n) {
        const float x = to_f32(pre[i]);
        store(act + i, 0.5f * x * (1.0f + tanhf(GELU_K * (x + GELU_C * x * x * x))));
    }
}

// dpre holds dout @ W_2^T on entry and the gradient at pre on return.
extern "C" __global__ void k_mlp_bwd(act_t* dpre, const act_t* pre, long long n) {
    GRID_STRIDE_LOOP(i, n) {
        const float x = to_f32(pre[i]);
        const float th = tanhf(GELU_K * (x + GELU_C * x * x * x));
        const float grad = 0.5f * (1.0f + th) + 0.5f * x * (1.0f - th * th) * GELU_K * (1.0f + 3.0f * GELU_C * x * x);
        store(dpre + i, to_f32(dpre[i]) * grad);
    }
}
