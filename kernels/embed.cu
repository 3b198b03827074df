// embed: token + position embedding.
//   forward:  out[b, t, :] = wte[tokens[b, t], :] + wpe[t, :]
//   backward: dwte[v, :] += sum of dout[n, :] over the positions n whose token is v
//             dwpe[t, :] += sum over b of dout[b, t, :]   (add_wpe 0: written, a step's first micro-batch)
// The backward sums run in a fixed order with no atomics, so repeated tokens give the same bits on
// every run: one block owns each token that occurs and adds its occurrences' rows in ascending position
// order, from 0, then adds that sum into dwte. The owners come from a sort of the keys token << 16 |
// position (k_embed_sort, k_embed_merge), and in k_embed_bwd_sorted the block of sorted entry i owns its
// token where i starts the token's run. Where the sort does not apply (over
// EMBED_SORT_MAX positions, or tokens or positions from 2^16 on), k_embed_bwd finds the owners by scanning:
// the block of position n owns token v = tokens[n] where n is v's first occurrence. Both give the same bits.
#include "common.cuh"

// Columns one thread accumulates in the backward pass: the kernels are built for J = 1, 2, 3, 4, 8, 16 (the
// EMBED_BWD instances at the end, C <= EMBED_BWD_THREADS * 16) and the engine takes the least J that covers C:
// registers sized for 16 columns held 2 blocks an SM, so a 768-wide row's owners ran in 35 waves.
#define EMBED_BWD_THREADS 256
#define EMBED_SORT_THREADS 1024
#define EMBED_SORT_CHUNK 2048  // keys a block of k_embed_sort sorts in shared memory
#define EMBED_SORT_MAX 32768   // positions the sort takes (the engine's embed_sorted holds twice as many keys)

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

// dwpe[t] += the sum over b of dout[b, t], b ascending; add 0: dwpe[t] = that sum (a step's first micro-batch).
__device__ __forceinline__ void embed_bwd_wpe(float* dwpe, const float* dout, long long n_pos, int T, int C, int t,
                                              int add) {
    const long long B = n_pos / T;
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
        float sum = 0.0f;
        for (long long b = 0; b < B; b++) sum += dout[(b * T + t) * C + c];
        float* d = dwpe + (long long)t * C + c;
        *d = add ? *d + sum : sum;
    }
}

// Sorting the keys token << 16 | position of n_pos positions, ascending, in two launches. The keys are
// distinct, so each has one place in the order whatever the sort: the same bits every run.
// k_embed_sort: block b sorts the keys of positions [b EMBED_SORT_CHUNK, (b + 1) EMBED_SORT_CHUNK) in shared
// memory (bitonic; pad keys sort last) into chunks.
extern "C" __global__ void __launch_bounds__(EMBED_SORT_THREADS)
k_embed_sort(unsigned* chunks, const int* tokens, int n_pos) {
    __shared__ unsigned keys[EMBED_SORT_CHUNK];
    const int first = blockIdx.x * EMBED_SORT_CHUNK;
    for (int i = threadIdx.x; i < EMBED_SORT_CHUNK; i += blockDim.x) {
        const int n = first + i;
        keys[i] = n < n_pos ? (static_cast<unsigned>(tokens[n]) << 16) | static_cast<unsigned>(n) : 0xffffffffu;
    }
    __syncthreads();
    for (int size = 2; size <= EMBED_SORT_CHUNK; size <<= 1) {
        for (int stride = size >> 1; stride > 0; stride >>= 1) {
            for (int p = threadIdx.x; p < EMBED_SORT_CHUNK / 2; p += blockDim.x) {
                const int lo = 2 * p - (p & (stride - 1)), hi = lo + stride;  // the pair at distance `stride`
                const unsigned a = keys[lo], b = keys[hi];
                if ((a > b) == ((lo & size) == 0)) {  // ascending where bit `size` of lo is clear
                    keys[lo] = b;
                    keys[hi] = a;
                }
            }
            __syncthreads();
        }
    }
    for (int i = threadIdx.x; i < EMBED_SORT_CHUNK && first + i < n_pos; i += blockDim.x) chunks[first + i] = keys[i];
}

// k_embed_merge: each key's place in the whole order is its place in its chunk plus, in every other chunk, the
// number of keys below it (a binary search); one thread a key.
extern "C" __global__ void k_embed_merge(unsigned* sorted, const unsigned* chunks, int n_pos) {
    const int n = blockIdx.x * blockDim.x + threadIdx.x;
    if (n >= n_pos) return;
    const unsigned key = chunks[n];
    const int own = n / EMBED_SORT_CHUNK, n_chunks = (n_pos + EMBED_SORT_CHUNK - 1) / EMBED_SORT_CHUNK;
    int place = n - own * EMBED_SORT_CHUNK;
    for (int c = 0; c < n_chunks; c++) {
        if (c == own) continue;
        const unsigned* chunk = chunks + c * EMBED_SORT_CHUNK;
        int lo = 0, hi = min(EMBED_SORT_CHUNK, n_pos - c * EMBED_SORT_CHUNK);  // keys below `key`: [0, lo)
        while (lo < hi) {
            const int mid = (lo + hi) / 2;
            if (chunk[mid] < key) lo = mid + 1;
            else hi = mid;
        }
        place += lo;
    }
    sorted[place] = key;
}

// Blocks [0, n_pos) take the sorted keys of k_embed_merge: the block of entry i owns its token where i starts
// the token's run, and adds the run's rows (ascending positions), EMBED_BWD_THREADS keys at a time through
// shared memory and EMBED_GATHER rows' loads in flight before their adds (in the same order). Blocks
// [n_pos, n_pos + T) own rows of dwpe.
#define EMBED_GATHER 4
template <int J>
__device__ __forceinline__ void embed_bwd_sorted(float* dwte, float* dwpe, const float* dout, const unsigned* sorted,
                                                 long long n_pos, int T, int C, int add_wpe) {
    if (blockIdx.x >= n_pos) {
        embed_bwd_wpe(dwpe, dout, n_pos, T, C, (int)(blockIdx.x - n_pos), add_wpe);
        return;
    }
    const long long i = blockIdx.x;
    const unsigned token = sorted[i] >> 16;
    if (i > 0 && (sorted[i - 1] >> 16) == token) return;  // an earlier block owns this token (uniform: no barrier yet)
    __shared__ unsigned run[EMBED_BWD_THREADS];
    const int tid = threadIdx.x;
    float acc[J];
#pragma unroll
    for (int k = 0; k < J; k++) acc[k] = 0.0f;
    for (long long j0 = i; j0 < n_pos; j0 += EMBED_BWD_THREADS) {
        const long long j = j0 + tid;
        const bool mine = j < n_pos && (sorted[j] >> 16) == token;
        run[tid] = mine ? sorted[j] & 0xffffu : 0u;
        const int len = __syncthreads_count(mine);  // the run continues from the chunk's start (the keys are sorted)
        for (int h = 0; h < len; h += EMBED_GATHER) {
            float v[EMBED_GATHER][J];
#pragma unroll
            for (int u = 0; u < EMBED_GATHER; u++) {
                const float* row = dout + static_cast<long long>(run[h + u < len ? h + u : h]) * C;
#pragma unroll
                for (int k = 0; k < J; k++) {
                    const int c = tid + k * EMBED_BWD_THREADS;
                    v[u][k] = c < C ? row[c] : 0.0f;
                }
            }
#pragma unroll
            for (int u = 0; u < EMBED_GATHER; u++)
                if (h + u < len)
#pragma unroll
                    for (int k = 0; k < J; k++) acc[k] += v[u][k];
        }
        __syncthreads();  // run is rewritten by the next chunk
        if (len < EMBED_BWD_THREADS) break;  // the run ended in this chunk
    }
#pragma unroll
    for (int k = 0; k < J; k++) {
        const int c = tid + k * EMBED_BWD_THREADS;
        if (c < C) dwte[(long long)token * C + c] += acc[k];
    }
}

// Blocks [0, n_pos) own token rows of dwte; blocks [n_pos, n_pos + T) own rows of dwpe.
template <int J>
__device__ __forceinline__ void embed_bwd(float* dwte, float* dwpe, const float* dout, const int* tokens,
                                          long long n_pos, int T, int C, int add_wpe) {
    const int tid = threadIdx.x;
    if (blockIdx.x >= n_pos) {
        embed_bwd_wpe(dwpe, dout, n_pos, T, C, (int)(blockIdx.x - n_pos), add_wpe);
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
    float acc[J];
#pragma unroll
    for (int k = 0; k < J; k++) acc[k] = 0.0f;
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
            for (int k = 0; k < J; k++) {
                const int c = tid + k * EMBED_BWD_THREADS;
                if (c < C) acc[k] += row[c];
            }
        }
        __syncthreads();  // hits and warp_hits are rewritten by the next chunk
    }
#pragma unroll
    for (int k = 0; k < J; k++) {
        const int c = tid + k * EMBED_BWD_THREADS;
        if (c < C) dwte[(long long)token * C + c] += acc[k];
    }
}

#define EMBED_BWD(J)                                                                                                \
    extern "C" __global__ void __launch_bounds__(EMBED_BWD_THREADS)                                               \
    k_embed_bwd_sorted##J(float* dwte, float* dwpe, const float* dout, const unsigned* sorted, long long n_pos,     \
                          int T, int C, int add_wpe) {                                                              \
        embed_bwd_sorted<J>(dwte, dwpe, dout, sorted, n_pos, T, C, add_wpe);                                        \
    }                                                                                                               \
    extern "C" __global__ void __launch_bounds__(EMBED_BWD_THREADS)                                               \
    k_embed_bwd##J(float* dwte, float* dwpe, const float* dout, const int* tokens, long long n_pos, int T, int C,   \
                   int add_wpe) {                                                                                   \
        embed_bwd<J>(dwte, dwpe, dout, tokens, n_pos, T, C, add_wpe);                                               \
    }
EMBED_BWD(1)
EMBED_BWD(2)
EMBED_BWD(3)
EMBED_BWD(4)
EMBED_BWD(8)
EMBED_BWD(16)
