// adamw: one AdamW step over the flat parameter vector, with decoupled weight decay.
//   m = beta1 m + (1 - beta1) g,   v = beta2 v + (1 - beta2) g^2
//   update = (m / bc1) / (sqrt(v / bc2) + eps),  plus weight_decay * p where p decays,
//   p -= lr * update;   bc1 = 1 - beta1^step, bc2 = 1 - beta2^step (host-computed, step 1-based)
// Decay applies inside the sorted, disjoint ranges [ranges[2k], ranges[2k + 1]) (the matrices; never
// LayerNorm gamma/beta), found by binary search, so the whole update is one launch.
// The gradient is read as (g scale0) scale1 (the step's mean over micro-batches or a loss scale's undoing, then the
// clipping), each product rounded to float32 on its own: the values scaling passes over g would have stored.
// With a gate (k_grad_gate's: the clipping scale, whether the step updates) scale1 is read from it, and a gate that
// says no leaves everything as it is.
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

__device__ __forceinline__ float adamw_update(float p, float g, float& m, float& v, bool decay, float lr, float beta1,
                                              float one_minus_beta1, float beta2, float one_minus_beta2, float eps,
                                              float weight_decay, float bc1, float bc2) {
    m = beta1 * m + one_minus_beta1 * g;
    v = beta2 * v + one_minus_beta2 * g * g;
    float update = (m / bc1) / (sqrtf(v / bc2) + eps);
    if (decay) update += weight_decay * p;
    return p - lr * update;
}

__device__ __forceinline__ float scaled(float g, float scale0, float scale1) {
    return __fmul_rn(__fmul_rn(g, scale0), scale1);  // never contracted into the moments' sums
}

// Four elements a thread (16-byte loads) where every buffer is aligned, one otherwise; the same arithmetic.
extern "C" __global__ void k_adamw(float* params, const float* grads, float* m, float* v, long long n,
                                   const long long* decay_ranges, int n_ranges, float lr, float beta1,
                                   float one_minus_beta1, float beta2, float one_minus_beta2, float eps,
                                   float weight_decay, float bc1, float bc2, act_t* params_lp, int write_lp,
                                   float scale0, float scale1, const float* gate) {
    if (gate != nullptr) {
        if (gate[1] == 0.0f) return;
        scale1 = gate[0];
    }
    const bool vec = aligned16(params, grads, m) && aligned16(v) && (!write_lp || sizeof(act_t) == 4 ||
                                                                     (reinterpret_cast<unsigned long long>(params_lp) & 7) == 0);
    const long long start = blockIdx.x * (long long)blockDim.x + threadIdx.x, stride = (long long)gridDim.x * blockDim.x;
    long long done = 0;
    if (vec) {
        const long long groups = n / 4;
        for (long long q = start; q < groups; q += stride) {
            const long long i = 4 * q;
            float4 p = *reinterpret_cast<const float4*>(params + i), g = *reinterpret_cast<const float4*>(grads + i);
            float4 mi = *reinterpret_cast<const float4*>(m + i), vi = *reinterpret_cast<const float4*>(v + i);
            float* pp = &p.x;
            const float* gg = &g.x;
            float* mm = &mi.x;
            float* vv = &vi.x;
#pragma unroll
            for (int k = 0; k < 4; k++)
                pp[k] = adamw_update(pp[k], scaled(gg[k], scale0, scale1), mm[k], vv[k],
                                     decays(i + k, decay_ranges, n_ranges), lr, beta1, one_minus_beta1, beta2,
                                     one_minus_beta2, eps, weight_decay, bc1, bc2);
            *reinterpret_cast<float4*>(params + i) = p;
            *reinterpret_cast<float4*>(m + i) = mi;
            *reinterpret_cast<float4*>(v + i) = vi;
            if (write_lp)
#pragma unroll
                for (int k = 0; k < 4; k++) store(params_lp + i + k, pp[k]);
        }
        done = groups * 4;
    }
    for (long long i = done + start; i < n; i += stride) {
        float mi = m[i], vi = v[i];
        const float p = adamw_update(params[i], scaled(grads[i], scale0, scale1), mi, vi,
                                     decays(i, decay_ranges, n_ranges), lr, beta1, one_minus_beta1, beta2,
                                     one_minus_beta2, eps, weight_decay, bc1, bc2);
        m[i] = mi;
        v[i] = vi;
        params[i] = p;
        if (write_lp) store(params_lp + i, p);
    }
}

extern "C" __global__ void k_cast_params(act_t* params_lp, const float* params, long long n) {
    GRID_STRIDE_LOOP(i, n) store(params_lp + i, params[i]);
}
