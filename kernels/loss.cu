// loss: tied output projection + softmax cross-entropy, one row of V logits per position.
//   forward:  logits = inp @ wte^T (cuBLAS, written into probs),  probs = softmax(logits),
//             losses[n] = logsumexp(logits[n]) - logits[n, targets[n]]
//   backward: dlogits = probs - onehot(targets) (the gradient of sum(losses); the products take the
//             scale),  dwte += scale dlogits^T inp,  dinp += scale dlogits wte
//   weighted backward (a loss mask, or any per-position weights w >= 0): row n of dlogits is
//             w[n] (probs[n] - onehot(targets[n])), the gradient of sum(w losses)
// The classifier keeps one [N, V] buffer: the forward turns the logits into probabilities in place, and
// the backward turns those into dlogits in place (only the target entries change, and, weighted, the rows
// whose weight is not 1), so there is no separate probabilities or gradient buffer. One block per row; the
// row's max and sum are block reductions in a fixed order.
// Precision fp8: the forward also writes dlogits (unweighted) as E5M2 bytes for the input gradient's FP8
// product, at the scale of amax 1 (2^15: |p - onehot| <= 1 whatever the row), from the probabilities before
// their 16-bit rounding (andrea/ops/fp8.py, the classifier).
#include "common.cuh"

// The most threads of a row's block: andrea/ops/loss.py (softmax_threads) launches fewer for short rows.
#define LOSS_THREADS 1024
// Threads of a weighted backward's block (one row): most rows of a loss mask weigh 1, where the block has only
// the target to fix, or 0, where it writes the row; small blocks let many rows share an SM.
#define LOSS_WEIGHTED_THREADS 256
// E5M2's scale for values of magnitude up to 1: 2^15 (1.75 * 2^15 is its largest value)
#define DLOGITS_SCALE 32768.0f

// e^x: in the 16-bit builds the hardware's ex2.approx on x log2(e) (relative error about 2^-21, far below the
// rounding of a 16-bit probability): expf's dozen instructions an element made the softmax pass as much
// compute as memory at bf16's byte count. The fp32 build keeps expf.
__device__ __forceinline__ float exp_row(float x) {
#ifdef ACT_LOWP
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x * 1.4426950408889634f));
    return y;
#else
    return expf(x);
#endif
}

// Folds values into a running (max, sum of exp(v - max)) pair.
__device__ __forceinline__ void online_add(float& m, float& sum, const float* v, int n) {
    float top = m;
    for (int i = 0; i < n; i++) top = fmaxf(top, v[i]);
    sum *= exp_row(m - top);  // exp(-inf) = 0 while the sum is still empty
    m = top;
    for (int i = 0; i < n; i++) sum += exp_row(v[i] - m);
}

// 16-byte groups of a row a thread keeps in registers between the row's sums and its rewrite (LOSS_THREADS of them
// hold a 50304-logit bf16 row in 7): such a row is read from memory once instead of twice.
#define LOSS_CACHED_GROUPS 8

// Thread threadIdx.x's group k of a row: the groups it takes in turn (one 16-byte load each), in the order the
// sums fold them.
__device__ __forceinline__ int row_group(int k) { return (threadIdx.x + k * blockDim.x) * ACT_VEC; }

// ACT_VEC logits of a row from j as probabilities (and into dq's E5M2 bytes, scaled, less one at the target).
__device__ __forceinline__ void write_probs(act_t* x, unsigned char* d, int j, float (&v)[ACT_VEC], float row_max,
                                            float inv, int target) {
#pragma unroll
    for (int i = 0; i < ACT_VEC; i++) v[i] = exp_row(v[i] - row_max) * inv;
    store_vec(x + j, v);
    if (d != nullptr) {  // ACT_VEC bytes, as words of 4 (V % ACT_VEC == 0: the row's bytes start aligned)
        unsigned words[ACT_VEC / 4];
#pragma unroll
        for (int w = 0; w < ACT_VEC / 4; w++) {
            float e[4];
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const int at = 4 * w + i;
                e[i] = (j + at == target ? v[at] - 1.0f : v[at]) * DLOGITS_SCALE;
            }
            words[w] = fp8x2(e[0], e[1], 1) | static_cast<unsigned>(fp8x2(e[2], e[3], 1)) << 16;
        }
        if (ACT_VEC == 8) *reinterpret_cast<uint2*>(d + j) = make_uint2(words[0], words[ACT_VEC / 4 - 1]);
        else *reinterpret_cast<unsigned*>(d + j) = words[0];
    }
}

// dq (null: not written): [n_rows, V] E5M2 bytes of (probs - onehot) * 2^15; *dq_descale = 2^-15.
// A row of at most LOSS_CACHED_GROUPS groups a thread stays in registers from its one read; a longer one is read
// again for the rewrite. Both fold each thread's groups in the same order: the same bits either way.
extern "C" __global__ void __launch_bounds__(LOSS_THREADS)
k_loss_fwd(float* losses, act_t* probs, const int* targets, unsigned char* dq, float* dq_descale, long long n_rows,
           int V) {
    __shared__ float scratch[WARP_SIZE];
    const long long row = blockIdx.x;
    act_t* x = probs + row * V;
    const bool vec = V % ACT_VEC == 0;  // rows start 16-byte aligned too (16-byte passes, common.cuh)
    const bool cached = vec && V <= LOSS_CACHED_GROUPS * static_cast<int>(blockDim.x) * ACT_VEC;
    uint4 held[LOSS_CACHED_GROUPS];  // the row's groups, as loaded (registers: every index is a constant)
    // One pass for max and sum: each thread keeps a running max and a sum rescaled to it.
    float m = NEG_INF, sum = 0.0f;
    if (cached) {
#pragma unroll
        for (int k = 0; k < LOSS_CACHED_GROUPS; k++)
            if (row_group(k) < V) held[k] = *reinterpret_cast<const uint4*>(x + row_group(k));
#pragma unroll
        for (int k = 0; k < LOSS_CACHED_GROUPS; k++) {
            if (row_group(k) >= V) break;
            float v[ACT_VEC];
            unpack_vec(held[k], v);
            online_add(m, sum, v, ACT_VEC);
        }
    } else if (vec) {
        for (int j = threadIdx.x * ACT_VEC; j < V; j += blockDim.x * ACT_VEC) {
            float v[ACT_VEC];
            load_vec(x + j, v);
            online_add(m, sum, v, ACT_VEC);
        }
    } else {
        for (int j = threadIdx.x; j < V; j += blockDim.x) {
            const float v = to_f32(x[j]);
            online_add(m, sum, &v, 1);
        }
    }
    const int target = targets[row];
    const float picked = to_f32(x[target]);  // read before the reductions' barriers: the row is rewritten after
    const float row_max = block_max(m, scratch);
    const float row_sum = block_sum(m == NEG_INF ? 0.0f : sum * exp_row(m - row_max), scratch);
    if (threadIdx.x == 0) losses[row] = row_max + logf(row_sum) - picked;
    if (dq != nullptr && row == 0 && threadIdx.x == 0) *dq_descale = 1.0f / DLOGITS_SCALE;
    unsigned char* d = dq == nullptr ? nullptr : dq + row * V;
    const float inv = 1.0f / row_sum;
    if (cached) {
#pragma unroll
        for (int k = 0; k < LOSS_CACHED_GROUPS; k++) {
            if (row_group(k) >= V) break;
            float v[ACT_VEC];
            unpack_vec(held[k], v);
            write_probs(x, d, row_group(k), v, row_max, inv, target);
        }
    } else if (vec) {
        for (int j = threadIdx.x * ACT_VEC; j < V; j += blockDim.x * ACT_VEC) {
            float v[ACT_VEC];
            load_vec(x + j, v);
            write_probs(x, d, j, v, row_max, inv, target);
        }
    } else {
        for (int j = threadIdx.x; j < V; j += blockDim.x) {
            const float p = exp_row(to_f32(x[j]) - row_max) * inv;
            store(x + j, p);
            if (d != nullptr) d[j] = fp8x2((j == target ? p - 1.0f : p) * DLOGITS_SCALE, 0.0f, 1) & 0xffu;
        }
    }
}

// dlogits is a buffer of its own: copy the probabilities, less one at the target.
extern "C" __global__ void __launch_bounds__(LOSS_THREADS)
k_loss_bwd(act_t* dlogits, const act_t* probs, const int* targets, long long n_rows, int V) {
    const long long row = blockIdx.x;
    const int target = targets[row];
    const act_t* p = probs + row * V;
    act_t* d = dlogits + row * V;
    for (int j = threadIdx.x; j < V; j += blockDim.x) store(d + j, j == target ? to_f32(p[j]) - 1.0f : to_f32(p[j]));
}

// dlogits is probs: only each row's target entry changes.
extern "C" __global__ void k_loss_bwd_in_place(act_t* probs, const int* targets, long long n_rows, int V) {
    GRID_STRIDE_LOOP(row, n_rows) {
        act_t* p = probs + row * V + targets[row];
        store(p, to_f32(*p) - 1.0f);
    }
}

// Row d = w (p - onehot(target)) from the probabilities p (d may be p itself: each element is read and written
// by the same thread). A row of weight 0 is written as zeros without reading p.
__device__ __forceinline__ void weighted_row(act_t* d, const act_t* p, int target, float w, int V) {
    if (V % ACT_VEC == 0 && aligned16(d, p)) {
        for (int j = threadIdx.x * ACT_VEC; j < V; j += blockDim.x * ACT_VEC) {
            float v[ACT_VEC] = {};
            if (w != 0.0f) {
                load_vec(p + j, v);
#pragma unroll
                for (int i = 0; i < ACT_VEC; i++) v[i] = w * (j + i == target ? v[i] - 1.0f : v[i]);
            }
            store_vec(d + j, v);
        }
    } else {
        for (int j = threadIdx.x; j < V; j += blockDim.x)
            store(d + j, w == 0.0f ? 0.0f : w * (j == target ? to_f32(p[j]) - 1.0f : to_f32(p[j])));
    }
}

// dlogits is a buffer of its own, rows weighted: one block a row.
extern "C" __global__ void __launch_bounds__(LOSS_WEIGHTED_THREADS)
k_loss_bwd_weighted(act_t* dlogits, const act_t* probs, const int* targets, const float* weights, int V) {
    const long long row = blockIdx.x;
    weighted_row(dlogits + row * V, probs + row * V, targets[row], weights[row], V);
}

// dlogits is probs, rows weighted: one block a row. A row of weight 1 changes at its target only (as in
// k_loss_bwd_in_place, the same bits); any other weight scales the row whole.
extern "C" __global__ void __launch_bounds__(LOSS_WEIGHTED_THREADS)
k_loss_bwd_in_place_weighted(act_t* probs, const int* targets, const float* weights, int V) {
    const long long row = blockIdx.x;
    const float w = weights[row];
    const int target = targets[row];
    act_t* p = probs + row * V;
    if (w != 1.0f) {
        weighted_row(p, p, target, w, V);
    } else if (threadIdx.x == 0) {
        store(p + target, to_f32(p[target]) - 1.0f);
    }
}

// The weighted input gradient from the unweighted product: dinp = beta dinp + scale (w[n] p[n]) row by row, p [N, C]
// = d_logits wte over unweighted d_logits (precision fp8's, the forward's E5M2 copy, which carries no weights: a
// row's weight scales its row of the product alike). One block a row (grid-stride), its threads along the row.
extern "C" __global__ void k_loss_dinp_weighted(act_t* dinp, const float* p, const float* weights, float scale,
                                                float beta, long long n_rows, int C) {
    for (long long row = blockIdx.x; row < n_rows; row += gridDim.x) {
        const float w = weights[row];
        act_t* d = dinp + row * C;
        const float* q = p + row * C;
        for (int c = threadIdx.x; c < C; c += blockDim.x) {
            const float g = scale * (w * q[c]);
            store(d + c, beta == 0.0f ? g : beta * to_f32(d[c]) + g);  // beta 0 reads no dinp (as a product's)
        }
    }
}

// The mean loss's two sums, so that the host reads 16 bytes instead of the per-position losses (mean_loss):
// sums[0] = the sum of w[n] losses[n] over the positions of weight w[n] != 0 (a position of weight 0 counts for
// nothing, even where its loss is not finite), sums[1] = the sum of those weights; with null weights every weight
// is 1. In float64, one block: thread t takes positions t, t + LOSS_SUM_THREADS, ..., then a fixed tree (the
// same bits every run).
#define LOSS_SUM_THREADS 1024
extern "C" __global__ void __launch_bounds__(LOSS_SUM_THREADS)
k_loss_sums(double* sums, const float* losses, const float* weights, long long n) {
    __shared__ double part[2][LOSS_SUM_THREADS];
    const int t = threadIdx.x;
    double s = 0.0, total = 0.0;
    for (long long i = t; i < n; i += LOSS_SUM_THREADS) {
        const double w = weights == nullptr ? 1.0 : static_cast<double>(weights[i]);
        if (w != 0.0) {
            s += w * static_cast<double>(losses[i]);
            total += w;
        }
    }
    part[0][t] = s;
    part[1][t] = total;
    __syncthreads();
    for (int half = LOSS_SUM_THREADS / 2; half > 0; half >>= 1) {
        if (t < half) {
            part[0][t] += part[0][t + half];
            part[1][t] += part[1][t + half];
        }
        __syncthreads();
    }
    if (t == 0) {
        sums[0] = part[0][0];
        sums[1] = part[1][0];
    }
}
