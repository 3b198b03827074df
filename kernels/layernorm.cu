// layernorm: over the last axis (C) of each row, eps 1e-5; the forward saves mean and rstd.
//   forward:  out = (x - mean) * rstd * gamma + beta,   rstd = 1 / sqrt(var + eps)
//   backward: xhat = (x - mean) * rstd,  dxhat = dout * gamma
//             dinp   += rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat))
//             dgamma += sum over rows of dout * xhat,   dbeta += sum over rows of dout
// Input and output are activations (act_t); dout and dinp are residual-stream gradients (float).
// One warp per row. dgamma and dbeta are column sums: instead of atomics, the backward launch has
// extra blocks that each own a few columns and sum every row in a fixed order (same bits every run).
#include "common.cuh"

#define LN_EPS 1e-5f
#define LN_THREADS 1024
// Backward column blocks: LN_COLS columns each, LN_THREADS / LN_COLS row groups.
#define LN_COLS 8
#define LN_GROUPS (LN_THREADS / LN_COLS)

extern "C" __global__ void __launch_bounds__(LN_THREADS)
k_layernorm_fwd(act_t* out, float* mean, float* rstd, const act_t* inp, const float* gamma, const float* beta,
                long long n_rows, int C) {
    const long long row = blockIdx.x * (long long)(blockDim.x / WARP_SIZE) + threadIdx.x / WARP_SIZE;
    const int lane = threadIdx.x % WARP_SIZE;
    if (row >= n_rows) return;
    const act_t* x = inp + row * C;
    act_t* y = out + row * C;
    float sum = 0.0f;
    for (int c = lane; c < C; c += WARP_SIZE) sum += to_f32(x[c]);
    const float m = warp_sum(sum) / C;
    float sq = 0.0f;
    for (int c = lane; c < C; c += WARP_SIZE) {
        const float d = to_f32(x[c]) - m;
        sq += d * d;
    }
    const float r = 1.0f / sqrtf(warp_sum(sq) / C + LN_EPS);
    for (int c = lane; c < C; c += WARP_SIZE) store(y + c, (to_f32(x[c]) - m) * r * gamma[c] + beta[c]);
    if (lane == 0) {
        mean[row] = m;
        rstd[row] = r;
    }
}

__device__ void layernorm_bwd_row(float* dinp, const float* dout, const act_t* inp, const float* gamma,
                                  const float* mean, const float* rstd, long long n_rows, int C) {
    const long long row = blockIdx.x * (long long)(blockDim.x / WARP_SIZE) + threadIdx.x / WARP_SIZE;
    const int lane = threadIdx.x % WARP_SIZE;
    if (row >= n_rows) return;
    const act_t* x = inp + row * C;
    const float* dy = dout + row * C;
    float* dx = dinp + row * C;
    const float m = mean[row], r = rstd[row];
    float sum_dxhat = 0.0f, sum_dxhat_xhat = 0.0f;
    for (int c = lane; c < C; c += WARP_SIZE) {
        const float dxhat = dy[c] * gamma[c];
        sum_dxhat += dxhat;
        sum_dxhat_xhat += dxhat * ((to_f32(x[c]) - m) * r);
    }
    const float mean_dxhat = warp_sum(sum_dxhat) / C;
    const float mean_dxhat_xhat = warp_sum(sum_dxhat_xhat) / C;
    for (int c = lane; c < C; c += WARP_SIZE) {
        const float xhat = (to_f32(x[c]) - m) * r;
        dx[c] += r * (dy[c] * gamma[c] - mean_dxhat - xhat * mean_dxhat_xhat);
    }
}

__device__ void layernorm_bwd_params(float* dgamma, float* dbeta, const float* dout, const act_t* inp,
                                     const float* mean, const float* rstd, long long n_rows, int C, int col_block) {
    __shared__ float part_gamma[LN_GROUPS][LN_COLS];
    __shared__ float part_beta[LN_GROUPS][LN_COLS];
    const int col = threadIdx.x % LN_COLS, group = threadIdx.x / LN_COLS;
    const int c = col_block * LN_COLS + col;
    float dg = 0.0f, db = 0.0f;
    if (c < C) {
        for (long long row = group; row < n_rows; row += LN_GROUPS) {
            const float dy = dout[row * C + c];
            dg += dy * ((to_f32(inp[row * C + c]) - mean[row]) * rstd[row]);
            db += dy;
        }
    }
    part_gamma[group][col] = dg;
    part_beta[group][col] = db;
    __syncthreads();
    for (int stride = LN_GROUPS / 2; stride > 0; stride >>= 1) {
        if (group < stride) {
            part_gamma[group][col] += part_gamma[group + stride][col];
            part_beta[group][col] += part_beta[group + stride][col];
        }
        __syncthreads();
    }
    if (group == 0 && c < C) {
        dgamma[c] += part_gamma[0][col];
        dbeta[c] += part_beta[0][col];
    }
}

// Blocks [0, row_blocks) do dinp, one warp per row; the rest do dgamma/dbeta, LN_COLS columns each.
extern "C" __global__ void __launch_bounds__(LN_THREADS)
k_layernorm_bwd(float* dinp, float* dgamma, float* dbeta, const float* dout, const act_t* inp, const float* gamma,
                const float* mean, const float* rstd, long long n_rows, int C, int row_blocks) {
    if (blockIdx.x < row_blocks)
        layernorm_bwd_row(dinp, dout, inp, gamma, mean, rstd, n_rows, C);
    else
        layernorm_bwd_params(dgamma, dbeta, dout, inp, mean, rstd, n_rows, C, blockIdx.x - row_blocks);
}
