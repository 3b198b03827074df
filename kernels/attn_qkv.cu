// attn_qkv: the Q, K, V projections are cuBLAS products (andrea/ops/attn_qkv.py); here is the copy of their weights
// that the backward's input gradient reads. W_QKV [3, C, C] (W_Q, W_K, W_V back to back, as the parameter layout
// stores them) -> rows [C, 3C], W_Q W_K W_V side by side: rows[c, i C + j] = W[i, c, j]. Over dqkv's rows [B T, 3C]
// the input gradient is then one product over 3C. A bit copy, so every precision's bits stay as they are.
#include "common.cuh"

// Every layer at once: layer l's W_QKV at W + l * layer (elements), its copy at rows + l * 3 C^2. One warp a source
// row (l, i, c), 16 bytes a lane where every row starts 16-byte aligned.
extern "C" __global__ void k_qkv_rows(act_t* __restrict__ rows, const act_t* __restrict__ W, long long layer, int L,
                                      int C) {
    const int lane = threadIdx.x % WARP_SIZE, warps = blockDim.x / WARP_SIZE;
    const bool vec = aligned16(rows, W) && C % ACT_VEC == 0 && layer % ACT_VEC == 0;
    const long long n = 3LL * L * C;
    const long long first = (long long)blockIdx.x * warps + threadIdx.x / WARP_SIZE, step = (long long)gridDim.x * warps;
    for (long long r = first; r < n; r += step) {
        const long long l = r / (3 * C), ic = r % (3 * C), i = ic / C, c = ic % C;
        const act_t* src = W + l * layer + ic * C;
        act_t* dst = rows + (l * C + c) * 3 * C + i * C;
        if (vec) {
            for (int j = ACT_VEC * lane; j < C; j += ACT_VEC * WARP_SIZE)
                *reinterpret_cast<uint4*>(dst + j) = *reinterpret_cast<const uint4*>(src + j);
        } else {
            for (int j = lane; j < C; j += WARP_SIZE) dst[j] = src[j];
        }
    }
}
