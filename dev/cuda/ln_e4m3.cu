// The LayerNorm forward (the residual add fused in front, as k_layernorm_fwd) writing its output as E4M3 bytes in
// both layouts precision fp8's products read: X [rows, C] for the forward product and X^T [C, rows] for the weight
// gradient's, at the scale of a bound known before the pass, max over columns of sqrt(C - 1) |gamma| + |beta| (a
// row's |xhat| is at most sqrt(C - 1)), so no amax pass and no cast pass follow it. dev/cuda/ln_e4m3.py builds it
// after kernels/fp8.cu and kernels/layernorm.cu (their helpers and LN_EPS), checks its bytes against the engine's
// LayerNorm and cast at the same scale, and times it against them. A 16-bit build, C a multiple of ACT_VEC and at
// most LNQ_MAX_C, rows 16-byte aligned.
#include "common.cuh"

#define LNQ_ROWS 32  // rows a block: a warp a row
#define LNQ_THREADS (LNQ_ROWS * WARP_SIZE)
#define LNQ_MAX_C 1024  // widest row: the block's E4M3 tile in 48 KB of static shared memory
#define LNQ_GROUPS (LNQ_MAX_C / (WARP_SIZE * ACT_VEC))  // ACT_VEC-wide groups a lane at most

extern "C" __global__ void __launch_bounds__(LNQ_THREADS)
k_ln_e4m3(unsigned char* q, unsigned char* qt, float* descale, float* mean, float* rstd, act_t* inp,
          const float* gamma, const float* beta, long long n_rows, int C, const act_t* a, const act_t* residual,
          int fused) {
    __shared__ __align__(16) unsigned char tile[LNQ_ROWS][LNQ_MAX_C + 16];  // [row][col]; 16 bytes of pad a row
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    const long long r0 = static_cast<long long>(blockIdx.x) * LNQ_ROWS, row = r0 + warp;
    // the bound, from gamma and beta alone: every warp finds the same (a max, in any order)
    const float k = sqrtf(static_cast<float>(C - 1));
    float bound = 0.0f;
    for (int c = lane; c < C; c += WARP_SIZE)
        bound = fmaxf(bound, __fadd_rn(__fmul_rn(fabsf(gamma[c]), k), fabsf(beta[c])));  // no FMA: NumPy's rounding
    bound = warp_max(bound);
    const int e = fp8_scale_exponent(__float_as_uint(bound), 8);
    const float s = __int_as_float((e + 127) << 23);
    if (blockIdx.x == 0 && threadIdx.x == 0) *descale = __int_as_float((127 - e) << 23);
    if (row < n_rows) {
        act_t* x = inp + row * C;
        float v[LNQ_GROUPS][ACT_VEC];
        float sum = 0.0f;
#pragma unroll
        for (int j = 0; j < LNQ_GROUPS; j++) {
            const int c = (lane + WARP_SIZE * j) * ACT_VEC;
            if (c >= C) continue;
            if (fused) {
                float w[ACT_VEC];
                load_vec(a + row * C + c, v[j]);
                load_vec(residual + row * C + c, w);
#pragma unroll
                for (int i = 0; i < ACT_VEC; i++) v[j][i] = as_stored(v[j][i] + w[i]);
                store_vec(x + c, v[j]);
            } else {
                load_vec(x + c, v[j]);
            }
#pragma unroll
            for (int i = 0; i < ACT_VEC; i++) sum += v[j][i];
        }
        const float m = warp_sum(sum) / C;
        float sq = 0.0f;
#pragma unroll
        for (int j = 0; j < LNQ_GROUPS; j++) {
            if ((lane + WARP_SIZE * j) * ACT_VEC >= C) continue;
#pragma unroll
            for (int i = 0; i < ACT_VEC; i++) sq += (v[j][i] - m) * (v[j][i] - m);
        }
        const float r = 1.0f / sqrtf(warp_sum(sq) / C + LN_EPS);
#pragma unroll
        for (int j = 0; j < LNQ_GROUPS; j++) {
            const int c = (lane + WARP_SIZE * j) * ACT_VEC;
            if (c >= C) continue;
            float g[ACT_VEC], b[ACT_VEC], y[ACT_VEC];
            load_f32(gamma + c, g);
            load_f32(beta + c, b);
#pragma unroll
            // as k_layernorm_fwd computes and stores it in bf16, then scaled
            for (int i = 0; i < ACT_VEC; i++) y[i] = as_stored((v[j][i] - m) * r * g[i] + b[i]) * s;
            unsigned lo4 = 0, hi4 = 0;  // the 8 bytes, the lower column first
            for (int i = 0; i < 2; ++i) {
                lo4 |= static_cast<unsigned>(fp8x2(y[2 * i], y[2 * i + 1], 0)) << (16 * i);
                hi4 |= static_cast<unsigned>(fp8x2(y[4 + 2 * i], y[5 + 2 * i], 0)) << (16 * i);
            }
            *reinterpret_cast<uint2*>(q + row * C + c) = make_uint2(lo4, hi4);
            *reinterpret_cast<uint2*>(&tile[warp][c]) = make_uint2(lo4, hi4);
        }
        if (lane == 0) {
            mean[row] = m;
            rstd[row] = r;
        }
    }
    __syncthreads();
    // X^T: the block's rows are 32 consecutive bytes of each of its C rows; a thread takes 16 of them a turn
    const int valid = static_cast<int>(min(static_cast<long long>(LNQ_ROWS), n_rows - r0));
    for (int t = threadIdx.x; t < 2 * C; t += LNQ_THREADS) {
        const int c = t / 2, h = (t % 2) * 16;
        unsigned char* out = qt + static_cast<long long>(c) * n_rows + r0 + h;
        if (h + 16 <= valid && n_rows % 16 == 0) {
            unsigned w[4] = {0u, 0u, 0u, 0u};
#pragma unroll
            for (int i = 0; i < 16; i++) w[i / 4] |= static_cast<unsigned>(tile[h + i][c]) << (8 * (i % 4));
            *reinterpret_cast<uint4*>(out) = make_uint4(w[0], w[1], w[2], w[3]);
        } else {
            for (int i = 0; h + i < valid; i++) out[i] = tile[h + i][c];
        }
    }
}
