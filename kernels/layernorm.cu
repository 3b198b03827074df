// layernorm: over the last axis (C) of each row, eps 1e-5; the forward saves mean and rstd.
//   forward:  out = (x - mean) * rstd * gamma + beta,   rstd = 1 / sqrt(var + eps)
//   backward: xhat = (x - mean) * rstd,  dxhat = dout * gamma
//             dinp   += rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat))   (add 0: written)
//             dgamma += sum over rows of dout * xhat,   dbeta += sum over rows of dout   (or, add 0, written:
//             a step's first micro-batch)
// Input and output are activations (act_t), and so is dout, the output's gradient as the products after the
// LayerNorm write it; dinp is the residual stream's gradient (float).
// The forward also takes the residual connection in front of it (residual_add then layernorm_fwd, one
// pass): inp = a + residual, written and normalised.
// The backward also takes the residual connection in front of the LayerNorm (layernorm_residual_bwd): its
// input's gradient dinp is the residual stream's, which flows on unchanged, and the branch that joined the
// stream there gets a copy of it, dbranch = dinp (act_t, overwritten).
// One warp per row. dgamma and dbeta are column sums: instead of atomics, each block sums them over one
// chunk of rows, and a second launch adds the chunks' partial sums in chunk order (same bits every run).
#include "common.cuh"

#define LN_EPS 1e-5f
#define LN_THREADS 1024
// Row chunks of the dgamma/dbeta partial sums (the engine's ln_partials holds 2 * LN_CHUNKS * C floats).
#define LN_CHUNKS 128
#define LN_LANES (LN_THREADS / WARP_SIZE)  // row lanes of a partial-sum block: 32 columns x 32 lanes
#define LN_SUM_THREADS 1024  // 32 columns x 32 lanes: a lane's chunks are few, its loads in flight together
#define LN_SUM_LANES (LN_SUM_THREADS / WARP_SIZE)
#define LN_BWD_WARPS 8  // warps of a block of the cached backward; a block takes one chunk of rows
#define LN_BWD_THREADS (LN_BWD_WARPS * WARP_SIZE)

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
// and normalised as written; the lanes read back only what they wrote themselves. Returns the lane's max |out|.
__device__ __forceinline__ float layernorm_fwd_row(act_t* out, float* mean, float* rstd, act_t* inp, const float* gamma,
                                                   const float* beta, long long row, int C, const act_t* a,
                                                   const act_t* residual, int fused) {
    const int lane = threadIdx.x % WARP_SIZE;
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
    float top = 0.0f;
    row_loop(vec, C, lane, [&](int c) {
        float v[ACT_VEC], g[ACT_VEC], b[ACT_VEC];
        load_vec(x + c, v);
        load_f32(gamma + c, g);
        load_f32(beta + c, b);
#pragma unroll
        for (int k = 0; k < ACT_VEC; k++) {
            v[k] = (v[k] - m) * r * g[k] + b[k];
            top = fmaxf(top, fabsf(v[k]));
        }
        store_vec(y + c, v);
    }, [&](int c) {
        const float v = (to_f32(x[c]) - m) * r * gamma[c] + beta[c];
        top = fmaxf(top, fabsf(v));
        store(y + c, v);
    });
    if (lane == 0) {
        mean[row] = m;
        rstd[row] = r;
    }
    return top;
}

// One warp per row. With `amax` (precision fp8; else null) also out's amax as stored (block_amax).
extern "C" __global__ void __launch_bounds__(LN_THREADS)
k_layernorm_fwd(act_t* out, float* mean, float* rstd, act_t* inp, const float* gamma, const float* beta,
                long long n_rows, int C, const act_t* a, const act_t* residual, int fused, unsigned* amax) {
    const long long row = blockIdx.x * (long long)(blockDim.x / WARP_SIZE) + threadIdx.x / WARP_SIZE;
    const float top = row < n_rows ? layernorm_fwd_row(out, mean, rstd, inp, gamma, beta, row, C, a, residual, fused) : 0.0f;
    if (amax != nullptr) block_amax(amax, top);
}

// The rows that do not fit the cached kernels below (wider than 4 groups a lane, or not 16-byte aligned):
// elementwise reads, two passes over the row.
__device__ void layernorm_bwd_row(float* dinp, act_t* dbranch, const act_t* dout, const act_t* inp, const float* gamma,
                                  const float* mean, const float* rstd, long long n_rows, int C, int fused, int add,
                                  unsigned* amax) {
    const long long row = blockIdx.x * (long long)(blockDim.x / WARP_SIZE) + threadIdx.x / WARP_SIZE;
    const int lane = threadIdx.x % WARP_SIZE;
    if (row >= n_rows) return;
    const act_t* x = inp + row * C;
    const act_t* dy = dout + row * C;
    float* dx = dinp + row * C;
    const float m = mean[row], r = rstd[row];
    float sum_dxhat = 0.0f, sum_dxhat_xhat = 0.0f;
    for (int c = lane; c < C; c += WARP_SIZE) {
        const float dxhat = to_f32(dy[c]) * gamma[c];
        sum_dxhat += dxhat;
        sum_dxhat_xhat += dxhat * ((to_f32(x[c]) - m) * r);
    }
    const float mean_dxhat = warp_sum(sum_dxhat) / C;
    const float mean_dxhat_xhat = warp_sum(sum_dxhat_xhat) / C;
    float top = 0.0f;
    for (int c = lane; c < C; c += WARP_SIZE) {
        const float xhat = (to_f32(x[c]) - m) * r;
        const float d = (add ? dx[c] : 0.0f) + r * (to_f32(dy[c]) * gamma[c] - mean_dxhat - xhat * mean_dxhat_xhat);
        dx[c] = d;
        if (fused) store(dbranch + row * C + c, d);
        top = fmaxf(top, fabsf(d));
    }
    // this path's rows end early, so a warp's max goes to *amax on its own (the rows wider than the cached kernels')
    if (fused && amax != nullptr) warp_amax(amax, top);
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
__device__ void layernorm_bwd_params(float* partials, const act_t* dout, const act_t* inp, const float* mean,
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
            const float dy = to_f32(dout[row * C + c]);
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
k_layernorm_bwd(float* dinp, act_t* dbranch, float* partials, const act_t* dout, const act_t* inp, const float* gamma,
                const float* mean, const float* rstd, long long n_rows, int C, int row_blocks, int fused, int add,
                unsigned* amax) {
    if (blockIdx.x < row_blocks)
        layernorm_bwd_row(dinp, dbranch, dout, inp, gamma, mean, rstd, n_rows, C, fused, add, amax);
    else
        layernorm_bwd_params(partials, dout, inp, mean, rstd, n_rows, C, blockIdx.x - row_blocks);
}

// A lane's ACT_VEC floats of dinp, the sum the backward adds to (add 0: written, no read: zeros).
__device__ __forceinline__ void load_dinp(const float* p, float (&d)[ACT_VEC], int add) {
    if (add) {
        load_f32(p, d);
    } else {
#pragma unroll
        for (int k = 0; k < ACT_VEC; k++) d[k] = 0.0f;
    }
}

// The cached backward: a lane's part of a row is J groups of ACT_VEC columns, (lane + 32 j) * ACT_VEC onwards,
// read once (16 bytes a load) and kept in registers until dinp is written; the lane's columns' dgamma and
// dbeta sums run over the chunk's rows (warp w takes rows w, w + LN_BWD_WARPS, ...), then the block's warps
// are added in a fixed tree and partials[chunk] written. One pass over dout and inp in all, where the generic
// kernel reads them twice and spends a block of 1024 threads on every 32 columns of a chunk.
// Up to 16 columns a lane, every input of a row, dinp among them, is loaded at once (a row waits for memory once)
// with the sums in registers. Wider rows would spill there: where a block's warps' sums fit its static shared
// memory (SHARED: 24 columns a lane of a 16-bit build) each warp keeps them in a slice of its own there and
// still loads a row at once (a row waits for memory once); else the sums stay in registers and dinp is loaded
// after the row's sums. The sums are the same every way: the same additions in the same order.
// Needs C <= 32 * J * ACT_VEC, C a multiple of ACT_VEC and every row 16-byte aligned (the engine checks).
template <int J>
__device__ __forceinline__ void layernorm_bwd_cached(float* dinp, act_t* dbranch, float* partials, const act_t* dout,
                                                     const act_t* inp, const float* gamma, const float* mean,
                                                     const float* rstd, long long n_rows, int C, int rows_per_chunk,
                                                     int n_chunks, int fused, int add, unsigned* amax) {
    constexpr int Q = ACT_VEC / 4;  // float4s of a group
    constexpr int W = J * Q * WARP_SIZE;  // float4s of a warp's sums (dgamma or dbeta)
    constexpr bool SHARED = J * ACT_VEC > 16 && LN_BWD_WARPS * 2 * W * sizeof(float4) <= 48 * 1024;
    constexpr bool EARLY = SHARED || J * ACT_VEC <= 16;  // dinp loaded with the row's other inputs
    // SHARED: acc[w] is warp w's sums; else the tree's upper halves pass their sums through acc
    __shared__ float4 acc[SHARED ? LN_BWD_WARPS : LN_BWD_WARPS / 2][2][W];
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    const long long first = (long long)blockIdx.x * rows_per_chunk;
    const long long end = min(n_rows, first + rows_per_chunk);
    // element (j, k) of a lane's sums: float4 (j Q + k / 4) Q... laid out lane-fastest, conflict-free
    auto at = [&](int j, int q) { return (j * Q + q) * WARP_SIZE + lane; };
    float dg[SHARED ? 1 : J][ACT_VEC], db[SHARED ? 1 : J][ACT_VEC], top = 0.0f;
    if constexpr (SHARED) {
#pragma unroll
        for (int j = 0; j < J; j++)
#pragma unroll
            for (int q = 0; q < Q; q++) acc[warp][0][at(j, q)] = acc[warp][1][at(j, q)] = make_float4(0.f, 0.f, 0.f, 0.f);
    } else {
#pragma unroll
        for (int j = 0; j < J; j++)
#pragma unroll
            for (int k = 0; k < ACT_VEC; k++) dg[j][k] = db[j][k] = 0.0f;
    }
    for (long long row = first + warp; row < end; row += LN_BWD_WARPS) {
        const float m = mean[row], r = rstd[row];
        float dy[J][ACT_VEC], d[J][ACT_VEC];
        uint4 x[J];  // the row's inputs as stored: xhat is found from them in both loops, the same bits
        float sum_dxhat = 0.0f, sum_dxhat_xhat = 0.0f;
#pragma unroll
        for (int j = 0; j < J; j++) {
            const int c = (lane + WARP_SIZE * j) * ACT_VEC;
            if (c >= C) continue;
            float g[ACT_VEC], xhat[ACT_VEC];
            load_vec(dout + row * C + c, dy[j]);
            x[j] = *reinterpret_cast<const uint4*>(inp + row * C + c);
            if (EARLY) load_dinp(dinp + row * C + c, d[j], add);
            load_f32(gamma + c, g);
            unpack_vec(x[j], xhat);
#pragma unroll
            for (int k = 0; k < ACT_VEC; k++) {
                xhat[k] = (xhat[k] - m) * r;
                const float dxhat = dy[j][k] * g[k];
                sum_dxhat += dxhat;
                sum_dxhat_xhat += dxhat * xhat[k];
            }
            if constexpr (SHARED) {
#pragma unroll
                for (int q = 0; q < Q; q++) {
                    float4& a = acc[warp][0][at(j, q)];
                    float4& b = acc[warp][1][at(j, q)];
                    const float* y = dy[j] + 4 * q;
                    const float* h = xhat + 4 * q;
                    a.x += y[0] * h[0], a.y += y[1] * h[1], a.z += y[2] * h[2], a.w += y[3] * h[3];
                    b.x += y[0], b.y += y[1], b.z += y[2], b.w += y[3];
                }
            } else {
#pragma unroll
                for (int k = 0; k < ACT_VEC; k++) {
                    dg[j][k] += dy[j][k] * xhat[k];
                    db[j][k] += dy[j][k];
                }
            }
        }
        const float mean_dxhat = warp_sum(sum_dxhat) / C;
        const float mean_dxhat_xhat = warp_sum(sum_dxhat_xhat) / C;
#pragma unroll
        for (int j = 0; j < J; j++) {
            const int c = (lane + WARP_SIZE * j) * ACT_VEC;
            if (c >= C) continue;
            float g[ACT_VEC], xhat[ACT_VEC];
            load_f32(gamma + c, g);
            if (EARLY) {
                unpack_vec(x[j], xhat);
            } else {  // read again (from L1): the registers go to the sums
                load_vec(inp + row * C + c, xhat);
                load_dinp(dinp + row * C + c, d[j], add);
            }
#pragma unroll
            for (int k = 0; k < ACT_VEC; k++) {
                xhat[k] = (xhat[k] - m) * r;
                d[j][k] += r * (dy[j][k] * g[k] - mean_dxhat - xhat[k] * mean_dxhat_xhat);
                top = fmaxf(top, fabsf(d[j][k]));
            }
            store_f32(dinp + row * C + c, d[j]);
            if (fused) store_vec(dbranch + row * C + c, d[j]);
        }
    }
    // warps [half, 2 half) hand their sums to warps [0, half), halving until warp 0 holds the block's
    auto add4 = [](float4& a, const float4 b) { a.x += b.x, a.y += b.y, a.z += b.z, a.w += b.w; };
    for (int half = LN_BWD_WARPS / 2; half > 0; half >>= 1) {
        if constexpr (SHARED) {
            __syncthreads();
            if (warp < half) {
#pragma unroll
                for (int j = 0; j < J; j++)
#pragma unroll
                    for (int q = 0; q < Q; q++) {
                        add4(acc[warp][0][at(j, q)], acc[warp + half][0][at(j, q)]);
                        add4(acc[warp][1][at(j, q)], acc[warp + half][1][at(j, q)]);
                    }
            }
        } else {
            if (warp >= half && warp < 2 * half) {
#pragma unroll
                for (int j = 0; j < J; j++)
#pragma unroll
                    for (int q = 0; q < Q; q++) {
                        const float* g = dg[j] + 4 * q;
                        const float* b = db[j] + 4 * q;
                        acc[warp - half][0][at(j, q)] = make_float4(g[0], g[1], g[2], g[3]);
                        acc[warp - half][1][at(j, q)] = make_float4(b[0], b[1], b[2], b[3]);
                    }
            }
            __syncthreads();
            if (warp < half) {
#pragma unroll
                for (int j = 0; j < J; j++)
#pragma unroll
                    for (int q = 0; q < Q; q++) {
                        const float4 g = acc[warp][0][at(j, q)], b = acc[warp][1][at(j, q)];
                        float* a = dg[j] + 4 * q;
                        float* e = db[j] + 4 * q;
                        a[0] += g.x, a[1] += g.y, a[2] += g.z, a[3] += g.w;
                        e[0] += b.x, e[1] += b.y, e[2] += b.z, e[3] += b.w;
                    }
            }
            __syncthreads();
        }
    }
    if (warp == 0) {
#pragma unroll
        for (int j = 0; j < J; j++) {
            const int c = (lane + WARP_SIZE * j) * ACT_VEC;
            if (c >= C) continue;
#pragma unroll
            for (int q = 0; q < Q; q++) {
                float4 g, b;
                if constexpr (SHARED) {
                    g = acc[0][0][at(j, q)], b = acc[0][1][at(j, q)];
                } else {
                    g = make_float4(dg[j][4 * q], dg[j][4 * q + 1], dg[j][4 * q + 2], dg[j][4 * q + 3]);
                    b = make_float4(db[j][4 * q], db[j][4 * q + 1], db[j][4 * q + 2], db[j][4 * q + 3]);
                }
                *reinterpret_cast<float4*>(partials + (long long)blockIdx.x * C + c + 4 * q) = g;
                *reinterpret_cast<float4*>(partials + (long long)(n_chunks + blockIdx.x) * C + c + 4 * q) = b;
            }
        }
    }
    if (fused && amax != nullptr) warp_amax(amax, top);  // a warp's atomic: block_amax's scratch would not fit beside acc
}

#define LN_BWD_CACHED(J)                                                                                            \
    extern "C" __global__ void __launch_bounds__(LN_BWD_THREADS, 2)                                              \
    k_layernorm_bwd_cached##J(float* dinp, act_t* dbranch, float* partials, const act_t* dout, const act_t* inp,    \
                              const float* gamma, const float* mean, const float* rstd, long long n_rows, int C,    \
                              int rows_per_chunk, int n_chunks, int fused, int add, unsigned* amax) {                \
        layernorm_bwd_cached<J>(dinp, dbranch, partials, dout, inp, gamma, mean, rstd, n_rows, C, rows_per_chunk,    \
                                n_chunks, fused, add, amax);                                                         \
    }
LN_BWD_CACHED(1)
LN_BWD_CACHED(2)
LN_BWD_CACHED(3)
LN_BWD_CACHED(4)

// dgamma += the n_chunks chunks' partial sums (likewise dbeta; add 0: dgamma = them): 32 columns a block of
// LN_SUM_THREADS; lane ly of a column adds chunks ly, ly + LN_SUM_LANES, ..., then the lanes are added in a fixed tree.
extern "C" __global__ void __launch_bounds__(LN_SUM_THREADS)
k_layernorm_bwd_sum(float* dgamma, float* dbeta, const float* partials, int C, int n_chunks, int add) {
    __shared__ float part[2][LN_SUM_LANES][WARP_SIZE + 1];
    const int cx = threadIdx.x % WARP_SIZE, ly = threadIdx.x / WARP_SIZE;
    const int c = blockIdx.x * WARP_SIZE + cx;
    float dg = 0.0f, db = 0.0f;
    if (c < C) {
#pragma unroll 4
        for (int k = ly; k < n_chunks; k += LN_SUM_LANES) {
            dg += partials[(long long)k * C + c];
            db += partials[(long long)(n_chunks + k) * C + c];
        }
    }
    fold_lanes(part, ly, cx, dg, db);
    if (ly == 0 && c < C) {
        dgamma[c] = add ? dgamma[c] + part[0][0][cx] : part[0][0][cx];
        dbeta[c] = add ? dbeta[c] + part[1][0][cx] : part[1][0][cx];
    }
}

// The forward writing its output as E4M3 bytes only, in both layouts precision fp8's products read: X [rows, C]
// (the forward product's operand) and X^T [C, rows] (the weight gradient's), at the scale of a bound known before
// the pass, max over columns of sqrt(C - 1) |gamma| + |beta| (a row's deviations sum to 0, so its |xhat| is at most
// sqrt(C - 1)): no amax and no cast pass follow it (andrea/ops/layernorm.py). Each value is k_layernorm_fwd's, as
// that kernel stores it in act_t, then scaled and converted as k_fp8_cast does. A warp a row, its groups held in
// registers as stored; the block's LN_E4M3_ROWS x C bytes gather in shared memory for X^T. C a multiple of ACT_VEC
// and at most LN_E4M3_MAX_C; every row 16-byte aligned. A warp takes LN_E4M3_ROWS / LN_E4M3_WARPS rows in turn: two
// blocks an SM (a block's registers are half an SM's), one's X^T writes beside the other's rows (a block of a warp a
// row holds one block an SM, with nothing beside its writes). Block 0 writes the descale 1 / s. qt null: X
// alone (a forward with no backward after it).
#define LN_E4M3_ROWS 32   // rows a block
#define LN_E4M3_WARPS 16  // warps a block (its launcher reads this), two rows each
#define LN_E4M3_THREADS (LN_E4M3_WARPS * WARP_SIZE)
#define LN_E4M3_MAX_C 1024  // widest row: the block's bytes in 33 KB of static shared memory
#define LN_E4M3_GROUPS (LN_E4M3_MAX_C / (WARP_SIZE * ACT_VEC))  // ACT_VEC-wide groups a lane at most

extern "C" __global__ void __launch_bounds__(LN_E4M3_THREADS, 2)
k_layernorm_fwd_e4m3(unsigned char* q, unsigned char* qt, float* descale, float* mean, float* rstd, act_t* inp,
                     const float* gamma, const float* beta, long long n_rows, int C, const act_t* a,
                     const act_t* residual, int fused) {
    __shared__ __align__(16) unsigned char tile[LN_E4M3_ROWS][LN_E4M3_MAX_C + 16];  // [row][col]; 16 bytes of pad
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    const long long r0 = static_cast<long long>(blockIdx.x) * LN_E4M3_ROWS;
    // the bound, from gamma and beta alone: every warp finds the same (a max, in any order)
    const float k = sqrtf(static_cast<float>(C - 1));
    float bound = 0.0f;
    for (int c = lane; c < C; c += WARP_SIZE)
        bound = fmaxf(bound, __fadd_rn(__fmul_rn(fabsf(gamma[c]), k), fabsf(beta[c])));  // no FMA: NumPy's rounding
    bound = warp_max(bound);
    const int e = fp8_scale_exponent(__float_as_uint(bound), 8);
    const float s = __int_as_float((e + 127) << 23);
    if (blockIdx.x == 0 && threadIdx.x == 0) *descale = __int_as_float((127 - e) << 23);
    for (int wr = warp; wr < LN_E4M3_ROWS; wr += LN_E4M3_WARPS) {
        const long long row = r0 + wr;
        if (row >= n_rows) break;
        act_t* x = inp + row * C;
        float v[LN_E4M3_GROUPS][ACT_VEC];
        float sum = 0.0f;
#pragma unroll
        for (int j = 0; j < LN_E4M3_GROUPS; j++) {
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
        for (int j = 0; j < LN_E4M3_GROUPS; j++) {
            if ((lane + WARP_SIZE * j) * ACT_VEC >= C) continue;
#pragma unroll
            for (int i = 0; i < ACT_VEC; i++) sq += (v[j][i] - m) * (v[j][i] - m);
        }
        const float r = 1.0f / sqrtf(warp_sum(sq) / C + LN_EPS);
#pragma unroll
        for (int j = 0; j < LN_E4M3_GROUPS; j++) {
            const int c = (lane + WARP_SIZE * j) * ACT_VEC;
            if (c >= C) continue;
            float g[ACT_VEC], b[ACT_VEC], y[ACT_VEC];
            load_f32(gamma + c, g);
            load_f32(beta + c, b);
            // as k_layernorm_fwd computes and stores it, then scaled
#pragma unroll
            for (int i = 0; i < ACT_VEC; i++) y[i] = as_stored((v[j][i] - m) * r * g[i] + b[i]) * s;
            unsigned w[ACT_VEC / 4];  // the group's bytes, the lower column first
#pragma unroll
            for (int i = 0; i < ACT_VEC / 4; i++)
                w[i] = fp8x2(y[4 * i], y[4 * i + 1], 0) | static_cast<unsigned>(fp8x2(y[4 * i + 2], y[4 * i + 3], 0)) << 16;
#pragma unroll
            for (int i = 0; i < ACT_VEC / 4; i++) {
                reinterpret_cast<unsigned*>(q + row * C + c)[i] = w[i];
                reinterpret_cast<unsigned*>(&tile[wr][c])[i] = w[i];
            }
        }
        if (lane == 0) {
            mean[row] = m;
            rstd[row] = r;
        }
    }
    if (qt == nullptr) return;  // the same in every thread of the block
    __syncthreads();
    // X^T: the block's rows are LN_E4M3_ROWS consecutive bytes of each of its C rows; a thread takes 16 a turn
    const int valid = static_cast<int>(min(static_cast<long long>(LN_E4M3_ROWS), n_rows - r0));
    for (int t = threadIdx.x; t < (LN_E4M3_ROWS / 16) * C; t += LN_E4M3_THREADS) {
        const int c = t / (LN_E4M3_ROWS / 16), h = (t % (LN_E4M3_ROWS / 16)) * 16;
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
