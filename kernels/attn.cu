// attn: causal scaled dot-product attention, per batch row b and head h (head width hd = C / H):
//   forward:  S = Q K^T / sqrt(hd),  P = softmax(S) over keys j <= t (0 above the diagonal),  Y = P V
//   backward: dP = dY V^T,  dS = P * (dP - rowsum(dP * P)) / sqrt(hd),
//             dQ += dS K,  dK += dS^T Q,  dV += P^T dY
// cuBLAS computes the products (S arrives already scaled); these kernels do the softmax and its
// backward in place, one warp per row of the [B, H, T, T] matrix.
#include "common.cuh"

extern "C" __global__ void k_attn_fwd(float* att, long long n_rows, int T) {
    const long long row = blockIdx.x * (long long)(blockDim.x / WARP_SIZE) + threadIdx.x / WARP_SIZE;
    const int lane = threadIdx.x % WARP_SIZE;
    if (row >= n_rows) return;
    const int t = (int)(row % T);  // the query position: keys 0..t are visible
    float* s = att + row * T;
    // One pass for max and sum: each lane keeps a running max and a sum rescaled to it.
    float m = NEG_INF, sum = 0.0f;
    for (int j = lane; j <= t; j += WARP_SIZE) {
        const float x = s[j];
        if (x > m) {
            sum = sum * expf(m - x) + 1.0f;
            m = x;
        } else {
            sum += expf(x - m);
        }
    }
    const float row_max = warp_max(m);
    const float row_sum = warp_sum(sum * expf(m - row_max));
    for (int j = lane; j < T; j += WARP_SIZE) s[j] = j <= t ? expf(s[j] - row_max) / row_sum : 0.0f;
}

// datt holds dP on entry and dS on return.
extern "C" __global__ void k_attn_bwd(float* datt, const float* att, long long n_rows, int T, float scale) {
    const long long row = blockIdx.x * (long long)(blockDim.x / WARP_SIZE) + threadIdx.x / WARP_SIZE;
    const int lane = threadIdx.x % WARP_SIZE;
    if (row >= n_rows) return;
    const int t = (int)(row % T);
    float* d = datt + row * T;
    const float* p = att + row * T;
    float dot = 0.0f;
    for (int j = lane; j <= t; j += WARP_SIZE) dot += d[j] * p[j];
    dot = warp_sum(dot);
    for (int j = lane; j < T; j += WARP_SIZE) d[j] = j <= t ? p[j] * (d[j] - dot) * scale : 0.0f;
}
