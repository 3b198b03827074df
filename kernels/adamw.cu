// adamw: one AdamW step over the flat parameter vector, with decoupled weight decay.
//   m = beta1 m + (1 - beta1) g,   v = beta2 v + (1 - beta2) g^2
//   update = (m / bc1) / (sqrt(v / bc2) + eps),  plus weight_decay * p where p decays,
//   p -= lr * update;   bc1 = 1 - beta1^step, bc2 = 1 - beta2^step (host-computed, step 1-based)
// Decay applies inside the sorted, disjoint ranges [ranges[2k], ranges[2k + 1]) (the matrices; never
// LayerNorm gamma/beta), found by binary search, so the whole update is one launch: a warp searches at the two ends
// of its 128 elements, and its lanes each for themselves only where a range's edge lies between.
// The gradient is read as (g scale0) scale1 (the step's mean over micro-batches or a loss scale's undoing, then the
// clipping), each product rounded to float32 on its own: the values scaling passes over g would have stored.
// With a gate (k_grad_gate's: the clipping scale, whether the step updates) scale1 is read from it, and a gate that
// says no leaves everything as it is.
// Under mixed precision the same pass writes params_lp, the act_t copy the matrix products read (a pure
// function of the fp32 weights, so a resumed run rebuilds it exactly); k_cast_params builds it at load.
// Under precision fp8 it also takes the amax of the copy's matrices that prepare_fp8_weights casts (ops/fp8.py):
// amax_ranges holds n_amax rows, amax_stride int64 words apart (spare words of k_fp8_cast_many's table), each a
// matrix's [start, end) bytes in params_lp and the address of the amax word its largest |params_lp| goes to (an
// order-free max: the bits k_fp8_amax_many finds), rows sorted by start. The word is zero before the launch; the
// float after it is set to 1, telling k_fp8_amax_many that the amax is there. A gate that says no still takes them,
// of the weights as they are.
#include "common.cuh"

// Where a lies among n sorted, disjoint ranges [ranges[stride k], ranges[stride k + 1]): 2 k inside range k, 2 k - 1
// in the gap before it (2 n - 1 after the last). Two addresses with the same place have no range edge between them.
__device__ __forceinline__ int range_place(long long a, const long long* ranges, int n, int stride) {
    int lo = 0, hi = n;  // lo ends as the number of ranges that start at or before a
    while (lo < hi) {
        const int mid = (lo + hi) / 2;
        if (ranges[stride * mid] <= a) lo = mid + 1;
        else hi = mid;
    }
    return lo > 0 && a < ranges[stride * (lo - 1) + 1] ? 2 * (lo - 1) : 2 * lo - 1;
}
// The range of a place, or -1 outside them all.
__device__ __forceinline__ int place_range(int place) { return place >= 0 && place % 2 == 0 ? place / 2 : -1; }

// The place shared by the active lanes' groups [first_a, last_a] (a warp's lanes hold consecutive groups, in lane
// order), found by its first and last active lanes alone (one search, both lanes at once), or -2 where the two ends
// differ (each lane then looks for itself). Called by every active lane.
__device__ __forceinline__ int warp_place(long long first_a, long long last_a, const long long* ranges, int n,
                                          int stride) {
    const unsigned active = __activemask();
    const int lane = threadIdx.x % WARP_SIZE, lo_lane = __ffs(active) - 1, hi_lane = 31 - __clz(active);
    if (lo_lane == hi_lane) {
        const int place = range_place(first_a, ranges, n, stride);
        return place == range_place(last_a, ranges, n, stride) ? place : -2;
    }
    int mine = 0;
    if (lane == lo_lane || lane == hi_lane) mine = range_place(lane == lo_lane ? first_a : last_a, ranges, n, stride);
    const int lo_place = __shfl_sync(active, mine, lo_lane), hi_place = __shfl_sync(active, mine, hi_lane);
    return lo_place == hi_place ? lo_place : -2;
}

struct AmaxRanges {
    const long long* rows;
    int n, stride;
    __device__ __forceinline__ int find(const act_t* p) const {
        return place_range(range_place(address(p), rows, n, stride));
    }
    static __device__ __forceinline__ long long address(const act_t* p) {
        return static_cast<long long>(reinterpret_cast<size_t>(p));
    }
    // NaN and 0 send nothing (k_fp8_amax_many's block_amax sends only a positive max).
    __device__ __forceinline__ void send(int r, float m) const {
        if (!(m > 0.0f)) return;
        unsigned* word = reinterpret_cast<unsigned*>(rows[stride * r + 2]);
        atomicMax(word, __float_as_uint(m));
        reinterpret_cast<float*>(word)[1] = 1.0f;  // the amax is taken: the slot's FP8_SLOT_TAKEN (kernels/fp8.cu)
    }
};

// A thread's running amax: of range r (-1: none yet), sent when the thread moves to another range.
struct AmaxRun {
    int r = -1;
    float m = 0.0f;
    __device__ __forceinline__ void add(const AmaxRanges& ranges, int range, float value) {
        if (range != r) {
            if (r >= 0) ranges.send(r, m);
            r = range;
            m = 0.0f;
        }
        m = fmaxf(m, value);  // NaN passed over, as k_fp8_amax_many does
    }
};

// The block's runs into their words: a warp whose lanes hold one range sends one max, the block's warps of one range
// one atomic between them. Every thread of the block calls it.
__device__ __forceinline__ void amax_flush(const AmaxRanges& ranges, AmaxRun run) {
    __shared__ int warp_r[32];
    __shared__ float warp_m[32];
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    const int r0 = __shfl_sync(FULL_MASK, run.r, 0);
    const bool uniform = __all_sync(FULL_MASK, run.r == r0);
    const float m = warp_max(run.m);
    if (!uniform && run.r >= 0) ranges.send(run.r, run.m);
    if (lane == 0) {
        warp_r[warp] = uniform ? r0 : -1;
        warp_m[warp] = m;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        int r = -1;
        float acc = 0.0f;
        for (int w = 0; w < blockDim.x / WARP_SIZE; w++) {
            if (warp_r[w] != r) {
                if (r >= 0) ranges.send(r, acc);
                r = warp_r[w];
                acc = 0.0f;
            }
            acc = fmaxf(acc, warp_m[w]);
        }
        if (r >= 0) ranges.send(r, acc);
    }
}

__device__ __forceinline__ bool decays(long long i, const long long* ranges, int n_ranges) {
    return place_range(range_place(i, ranges, n_ranges, 2)) >= 0;
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
                                   float scale0, float scale1, const float* gate, const long long* amax_rows,
                                   int n_amax, int amax_stride) {
    const AmaxRanges ranges{amax_rows, n_amax, amax_stride};
    bool step = true;
    if (gate != nullptr) {
        step = gate[1] != 0.0f;
        if (!step && n_amax == 0) return;
        scale1 = gate[0];
    }
    const bool vec = aligned16(params, grads, m) && aligned16(v) && (!write_lp || sizeof(act_t) == 4 ||
                                                                     (reinterpret_cast<unsigned long long>(params_lp) & 7) == 0);
    const long long start = blockIdx.x * (long long)blockDim.x + threadIdx.x, stride = (long long)gridDim.x * blockDim.x;
    long long done = 0;
    AmaxRun run;
    if (vec) {
        const long long groups = n / 4;
        for (long long q = start; q < groups; q += stride) {
            const long long i = 4 * q;
            float4 p = *reinterpret_cast<const float4*>(params + i);
            float* pp = &p.x;
            if (step) {
                const float4 g = *reinterpret_cast<const float4*>(grads + i);
                float4 mi = *reinterpret_cast<const float4*>(m + i), vi = *reinterpret_cast<const float4*>(v + i);
                const float* gg = &g.x;
                float* mm = &mi.x;
                float* vv = &vi.x;
                // a warp's 128 elements mostly lie in one range or gap: a search at each end, not one an element
                const int place = warp_place(i, i + 3, decay_ranges, n_ranges, 2);
#pragma unroll
                for (int k = 0; k < 4; k++)
                    pp[k] = adamw_update(pp[k], scaled(gg[k], scale0, scale1), mm[k], vv[k],
                                         place != -2 ? place_range(place) >= 0 : decays(i + k, decay_ranges, n_ranges),
                                         lr, beta1, one_minus_beta1, beta2, one_minus_beta2, eps, weight_decay, bc1,
                                         bc2);
                *reinterpret_cast<float4*>(params + i) = p;
                *reinterpret_cast<float4*>(m + i) = mi;
                *reinterpret_cast<float4*>(v + i) = vi;
                if (write_lp)
#pragma unroll
                    for (int k = 0; k < 4; k++) store(params_lp + i + k, pp[k]);
            }
            if (n_amax > 0) {
                const int place = warp_place(ranges.address(params_lp + i), ranges.address(params_lp + i + 3),
                                             amax_rows, n_amax, amax_stride);
                const int r = place != -2 ? place_range(place) : ranges.find(params_lp + i);
                if (place != -2 || r == ranges.find(params_lp + i + 3)) {
                    if (r >= 0)
#pragma unroll
                        for (int k = 0; k < 4; k++) run.add(ranges, r, fabsf(as_stored(pp[k])));
                } else {  // a group across a range's edge: each element to its own range
                    for (int k = 0; k < 4; k++) {
                        const int rk = ranges.find(params_lp + i + k);
                        if (rk >= 0) ranges.send(rk, fabsf(as_stored(pp[k])));
                    }
                }
            }
        }
        done = groups * 4;
    }
    for (long long i = done + start; i < n; i += stride) {
        float p = params[i];
        if (step) {
            float mi = m[i], vi = v[i];
            p = adamw_update(p, scaled(grads[i], scale0, scale1), mi, vi, decays(i, decay_ranges, n_ranges), lr, beta1,
                             one_minus_beta1, beta2, one_minus_beta2, eps, weight_decay, bc1, bc2);
            m[i] = mi;
            v[i] = vi;
            params[i] = p;
            if (write_lp) store(params_lp + i, p);
        }
        if (n_amax > 0) {
            const int r = ranges.find(params_lp + i);
            if (r >= 0) ranges.send(r, fabsf(as_stored(p)));
        }
    }
    if (n_amax > 0) amax_flush(ranges, run);
}

extern "C" __global__ void k_cast_params(act_t* params_lp, const float* params, long long n) {
    GRID_STRIDE_LOOP(i, n) store(params_lp + i, params[i]);
}
