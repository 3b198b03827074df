// layernorm: over the last axis (C) of each row, eps 1e-5; the forward saves mean and rstd.
//   forward:  out = (x - mean) * rstd * gamma + beta,   rstd = 1 / sqrt(var + eps)
//   backward: xhat = (x - mean) * rstd,  dxhat = dout * gamma
//             dinp   += rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat))
//             dgamma += sum over rows of dout * xhat,   dbeta += sum over rows of dout
// Input and output are activations (act_t); dout and dinp are residual-stream gradients (float).
// The forward also takes the residual connection in front of it (residual_add then layernorm_fwd, one
// pass): inp = a + residual, written and normalised.
// One warp per row. dgamma and dbeta are column sums: instead of atomics, the backward launch has extra
// blocks that each sum one chunk of rows for a run of columns (coalesced), and a second launch adds the
// chunks' partial sums in chunk order (same bits every run).
#include "common.cuh"

#define LN_EPS 1e-5f
#define LN_THREADS 1024
// Row chunks of the dgamma/dbeta partial sums (the engine's ln_partials holds 2 * LN_CHUNKS * C floats).
#define LN_CHUNKS 128
#define LN_LANES (LN_THREADS / WARP_SIZE)  // row lanes of a partial-sum block: 32 columns x 32 lanes
#define LN_SUM_THREADS 256
#define LN_SUM_LANES (LN_SUM_THREADS / WARP_SIZE)

// A row's ACT_VEC-wide groups go to lanes in turn when C is a whole number of groups and the row and
// gamma / beta are 16-byte aligned; else its elements do. Either way a row's sums run in a fixed order.
template <typename Group, typename One>
__device__ __forceinline__ void row_loop(bool vec, int C, int lane, Group group, One one) {
    if (vec) {
        for (int c = lane * ACT_VEC; c < C; c += WARP_SIZE * ACT_VEC) group(c);
    } else {
        for (int c = lane; c < C; c += WARP_SIZE) one(c);
    }
}

// With `residual` (the residual connection fused in front): inp = a + residual is written first, in act_t,
// and normalised as written; the lanes read back only what they wrote themselves.
extern "C" __global__ void __launch_bounds__(LN_THREADS)
k_layernorm_fwd(act_t* out, float* mean, float* rstd, act_t* inp, const float* gamma, const float* beta,
                long long n_rows, int C, const act_t* a, const act_t* residual, int fused) {
    const long long row = blockIdx.x * (long long)(blockDim.x / WARP_SIZE) + threadIdx.x / WARP_SIZE;
    const int lane = threadIdx.x % WARP_SIZE;
    if (row >= n_rows) return;
    act_t* x = inp + row * C;
    act_t* y = out + row * C;
    const act_t* xa = a + row * C;
    const act_t* xb = residual + row * C;
    const bool vec = C % ACT_VEC == 0 && aligned16(x, y) && aligned16(gamma, beta) && (!fused || aligned16(xa, xb));
    float sum = 0.0f;
    row_loop(vec, C, lane, [&](int c) {
        float v[ACT_VEC];
        if (fused) {
            float w[ACT_VEC];
            load_vec(xa + c, v);
            load_vec(xb + c, w);
#pragma unroll
            for (int k = 0; k < ACT_VEC; k++) v[k] += w[k];
            store_vec(x + c, v);
            load_vec(x + c, v);  // as stored (rounded to act_t)
        } else {
            load_vec(x + c, v);
        }
#pragma unroll
        for (int k = 0; k < ACT_VEC; k++) sum += v[k];
    }, [&](int c) {
        if (fused) store(x + c, to_f32(xa[c]) + to_f32(xb[c]));
        sum += to_f32(x[c]);
    });
    const float m = warp_sum(sum) / C;
    float sq = 0.0f;
    row_loop(vec, C, lane, [&](int c) {
        float v[ACT_VEC];
        load_vec(x + c, v);
#pragma unroll
        for (int k = 0; k < ACT_VEC; k++) sq += (v[k] - m) * (v[k] - m);
    }, [&](int c) {
        const float d = to_f32(x[c]) - m;
        sq += d * d;
    });
    const float r = 1.0f / sqrtf(warp_sum(sq) / C + LN_EPS);
    row_loop(vec, C, lane, [&](int c) {
        float v[ACT_VEC], g[ACT_VEC], b[ACT_VEC];
        load_vec(x + c, v);
        load_f32(gamma + c, g);
        load_f32(beta + c, b);
#pragma unroll
        for (int k = 0; k < ACT_VEC; k++) v[k] = (v[k] - m) * r * g[k] + b[k];
        store_vec(y + c, v);
    }, [&](int c) { store(y + c, (to_f32(x[c]) - m) * r * gamma[c] + beta[c]); });
    if (lane == 0) {
        mean[row] = m;
        rstd[row] = r;
    }
}

// Elementwise reads here: a vectorised version of this loop (ACT_VEC-wide groups, as the forward) measured
// slower on the H200 (0.072 against 0.053 ms a call at 120M, bf16).
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

// Column cx's (dgamma, dbeta) sums over a block's LANES row lanes into part[.][0][cx], in a fixed tree; every
// thread of the block calls it with its own lane's pair.
template <int LANES>
__device__ __forceinline__ void fold_lanes(float (&part)[2][LANES][WARP_SIZE + 1], int lane, int cx, float dg, float db) {
    part[0][lane][cx] = dg;
    part[1][lane][cx] = db;
    __syncthreads();
    for (int half = LANES / 2; half > 0; half >>= 1) {
        if (lane < half) {
            part[0][lane][cx] += part[0][lane + half][cx];
            part[1][lane][cx] += part[1][lane + half][cx];
        }
        __syncthreads();
    }
}

// dgamma and dbeta partial sums over one chunk of rows for 32 columns: thread (cx, ry) of the 32 x 32 block
// takes column cx and rows ry, ry + 32, ... of the chunk (a warp reads 32 consecutive columns of a row); the 32
// row lanes are then added in a fixed tree. partials[chunk] holds the chunk's dgamma, partials[LN_CHUNKS + chunk]
// its dbeta.
__device__ void layernorm_bwd_params(float* partials, const float* dout, const act_t* inp, const float* mean,
                                     const float* rstd, long long n_rows, int C, int block) {
    __shared__ float part[2][LN_LANES][WARP_SIZE + 1];
    const int col_blocks = (C + WARP_SIZE - 1) / WARP_SIZE;
    const int chunk = block / col_blocks, cx = threadIdx.x % WARP_SIZE, ry = threadIdx.x / WARP_SIZE;
    const int c = (block % col_blocks) * WARP_SIZE + cx;
    const long long rows_per_chunk = (n_rows + LN_CHUNKS - 1) / LN_CHUNKS;
    const long long end = min(n_rows, (chunk + 1) * rows_per_chunk);
    float dg = 0.0f, db = 0.0f;
    if (c < C) {
#pragma unroll 4
        for (long long row = chunk * rows_per_chunk + ry; row < end; row += LN_LANES) {
            const float dy = dout[row * C + c];
            dg += dy * ((to_f32(inp[row * C + c]) - mean[row]) * rstd[row]);
            db += dy;
        }
    }
    fold_lanes(part, ry, cx, dg, db);
    if (ry == 0 && c < C) {
        partials[(long long)chunk * C + c] = part[0][0][cx];
        partials[(long long)(LN_CHUNKS + chunk) * C + c] = part[1][0][cx];
    }
}

// Blocks [0, row_blocks) do dinp, one warp per row; the rest do the dgamma/dbeta partials of LN_CHUNKS row
// chunks, 32 columns a block. k_layernorm_bwd_sum then adds the chunks in a fixed order.
extern "C" __global__ void __launch_bounds__(LN_THREADS)
k_layernorm_bwd(float* dinp, float* partials, const float* dout, const act_t* inp, const float* gamma,
                const float* mean, const float* rstd, long long n_rows, int C, int row_blocks) {
    if (blockIdx.x < row_blocks)
        layernorm_bwd_row(dinp, dout, inp, gamma, mean, rstd, n_rows, C);
    else
        layernorm_bwd_params(partials, dout, inp, mean, rstd, n_rows, C, blockIdx.x - row_blocks);
}

// dgamma += the chunks' partial sums (likewise dbeta): 32 columns a block of LN_SUM_THREADS; lane ly of a column
// adds chunks ly, ly + LN_SUM_LANES, ..., then the lanes are added in a fixed tree.
extern "C" __global__ void __launch_bounds__(LN_SUM_THREADS)
k_layernorm_bwd_sum(float* dgamma, float* dbeta, const float* partials, int C) {
    __shared__ float part[2][LN_SUM_LANES][WARP_SIZE + 1];
    const int cx = threadIdx.x % WARP_SIZE, ly = threadIdx.x / WARP_SIZE;
    const int c = blockIdx.x * WARP_SIZE + cx;
    float dg = 0.0f, db = 0.0f;
    if (c < C) {
        for (int k = ly; k < LN_CHUNKS; k += LN_SUM_LANES) {
            dg += partials[(long long)k * C + c];
            db += partials[(long long)(LN_CHUNKS + k) * C + c];
        }
    }
    fold_lanes(part, ly, cx, dg, db);
    if (ly == 0 && c < C) {
        dgamma[c] += part[0][0][cx];
        dbeta[c] += part[1][0][cx];
    }
}
