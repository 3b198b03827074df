// adamw: one AdamW step over the flat parameter vector, with decoupled weight decay.
//   m = beta1 m + (1 - beta1) g,   v = beta2 v + (1 - beta2) g^2
//   update = (m / bc1) / (sqrt(v / bc2) + eps),  plus weight_decay * p where p decays,
//   p -= lr * update;   bc1 = 1 - beta1^step, bc2 = 1 - beta2^step (host-computed, step 1-based)
// Decay applies inside the sorted, disjoint ranges [ranges[2k], ranges[2k + 1]) (the matrices; never
// LayerNorm gamma/beta), found by binary search, so the whole update is one launch.
// Under mixed precision the same pass writes params_lp, the act_t copy the matrix products read (a pure
// function of the fp32 weights, so a resumed run rebuilds it exactly); k_cast_params builds it at load.
#include "common.cuh"

__device__ __forceinline__ bool decays(long long i, const long long* ranges, int n_ranges) {
    int lo = 0, hi = n_ranges;  // lo ends as the number of ranges that start at or before i
    while (lo < hi) {
        const int mid = (lo + hi) / 2;
        if (ranges[2 * mid] <= i) lo = mid + 1;
        else hi = mid;
    }
    return lo > 0 && i < ranges[2 * (lo - 1) + 1];
}

extern "C" __global__ void k_adamw(float* params, const float* grads, float* m, float* v, long long n,
                                   const long long* decay_ranges, int n_ranges, float lr, float beta1,
                                   float one_minus_beta1, float beta2, float one_minus_beta2, float eps,
                                   float weight_decay, float bc1, float bc2, act_t* params_lp, int write_lp) {
    GRID_STRIDE_LOOP(i, n) {
        const float g = grads[i];
        const float mi = beta1 * m[i] + one_minus_beta1 * g;
        const float vi = beta2 * v[i] + one_minus_beta2 * g * g;
        m[i] = mi;
        v[i] = vi;
        float update = (mi / bc1) / (sqrtf(vi / bc2) + eps);
        if (decays(i, decay_ranges, n_ranges)) update += weight_decay * params[i];
        const float p = params[i] - lr * update;
        params[i] = p;
        if (write_lp) store(params_lp + i, p);
    }
}

extern "C" __global__ void k_cast_params(act_t* params_lp, const float* params, long long n) {
    GRID_STRIDE_LOOP(i, n) store(params_lp + i, params[i]);
}
