// embed: token + position embedding.
//   forward:  out[b, t, :] = wte[tokens[b, t], :] + wpe[t, :]
//   backward: dwte[v, :] += sum of dout[n, :] over the positions n whose token is v
//             dwpe[t, :] += sum over b of dout[b, t, :]
// The backward sums run in a fixed order with no atomics, so repeated tokens give the same bits on
// every run: the block of position n owns token v = tokens[n] only where n is v's first occurrence,
// and the owner gathers all of v's occurrences in ascending position order.
#include "common.cuh"

// Columns one thread accumulates in the backward pass: C <= EMBED_BWD_THREADS * EMBED_BWD_COLS.
#define EMBED_BWD_THREADS 256
#define EMBED_BWD_COLS 16

// One block per position n (grid-stride over positions), its threads along the row: 16 bytes of out a store
// where C is a whole number of ACT_VEC groups and the rows are aligned, else one element.
extern "C" __global__ void k_embed_fwd(act_t* out, const int* tokens, const float* wte, const float* wpe,
                                       long long n_pos, int T, int C) {
    for (long long n = blockIdx.x; n < n_pos; n += gridDim.x) {
        const float* e = wte + (long long)tokens[n] * C;
        const float* p = wpe + (n % T) * C;
        act_t* y = out + n * C;
        if (C % ACT_VEC == 0 && aligned16(e, p, y)) {
            for (int c = threadIdx.x * ACT_VEC; c < C; c += blockDim.x * ACT_VEC) {
                float a[ACT_VEC], b[ACT_VEC];
                load_f32(e + c, a);
                load_f32(p + c, b);
#pragma unroll
                for (int k = 0; k < ACT_VEC; k++) a[k] += b[k];
                store_vec(y + c, a);
            }
        } else {
            for (int c = threadIdx.x; c < C; c += blockDim.x) store(y + c, e[c] + p[c]);
        }
    }
}

// Blocks [0, n_pos) own token rows of dwte; blocks [n_pos, n_pos + T) own rows of dwpe.
extern "C" __global__ void __launch_bounds__(EMBED_BWD_THREADS)
k_embed_bwd(float* dwte, float* dwpe, const float* dout, const int* tokens, long long n_pos, int T, int C) {
    const int tid = threadIdx.x;
    if (blockIdx.x >= n_pos) {
        const int t = (int)(blockIdx.x - n_pos);
        const long long B = n_pos / T;
        for (int c = tid; c < C; c += blockDim.x) {
            float sum = 0.0f;
            for (long long b = 0; b < B; b++) sum += dout[(b * T + t) * C + c];
            dwpe[(long long)t * C + c] += sum;
        }
        return;
    }
    const long long n = blockIdx.x;
    const int token = tokens[n];
    // Not the first occurrence: an earlier block owns this token.
    for (long long j0 = 0; j0 < n; j0 += blockDim.x) {
        const long long j = j0 + tid;
        if (__syncthreads_or(j < n && tokens[j] == token)) return;
    }
    __shared__ int hits[EMBED_BWD_THREADS];  // offsets in the current chunk that hold `token`, ascending
    __shared__ int warp_hits[EMBED_BWD_THREADS / WARP_SIZE];
    const int lane = tid % WARP_SIZE, warp = tid / WARP_SIZE, n_warps = blockDim.x / WARP_SIZE;
    float acc[EMBED_BWD_COLS];
#pragma unroll
    for (int k = 0; k < EMBED_BWD_COLS; k++) acc[k] = 0.0f;
    for (long long j0 = n; j0 < n_pos; j0 += blockDim.x) {
        const long long j = j0 + tid;
        const bool hit = j < n_pos && tokens[j] == token;
        const unsigned ballot = __ballot_sync(FULL_MASK, hit);
        if (lane == 0) warp_hits[warp] = __popc(ballot);
        __syncthreads();
        int before = 0, total = 0;
        for (int w = 0; w < n_warps; w++) {
            before += w < warp ? warp_hits[w] : 0;
            total += warp_hits[w];
        }
        if (hit) hits[before + __popc(ballot & ((1u << lane) - 1u))] = tid;
        __syncthreads();
        for (int h = 0; h < total; h++) {
            const float* row = dout + (j0 + hits[h]) * C;
#pragma unroll
            for (int k = 0; k < EMBED_BWD_COLS; k++) {
                const int c = tid + k * EMBED_BWD_THREADS;
                if (c < C) acc[k] += row[c];
            }
        }
        __syncthreads();  // hits and warp_hits are rewritten by the next chunk
    }
#pragma unroll
    for (int k = 0; k < EMBED_BWD_COLS; k++) {
        const int c = tid + k * EMBED_BWD_THREADS;
        if (c < C) dwte[(long long)token * C + c] += acc[k];
    }
}
