// Helpers shared by the ANDREA kernels.
//
// Every reduction here combines values in an order fixed by the launch shape alone, never by
// timing, so the same inputs give the same bits on every run (docs/REPRODUCIBILITY.md).
#pragma once

#define WARP_SIZE 32
#define FULL_MASK 0xffffffffu
#define NEG_INF __int_as_float(0xff800000)

// Butterfly sums: every lane ends with the same bits, since each step adds a commuting pair.
__device__ __forceinline__ float warp_sum(float v) {
    for (int offset = WARP_SIZE / 2; offset > 0; offset >>= 1) v += __shfl_xor_sync(FULL_MASK, v, offset);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int offset = WARP_SIZE / 2; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, offset));
    return v;
}

// Sum over the whole block (blockDim.x a multiple of 32, at most 1024); every thread gets the
// result. `scratch` is 32 floats of shared memory, free for reuse once the call returns.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    v = warp_sum(v);
    __syncthreads();  // an earlier call may still be reading scratch
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < blockDim.x / WARP_SIZE ? scratch[lane] : 0.0f;
    return warp_sum(v);
}

__device__ __forceinline__ float block_max(float v, float* scratch) {
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < blockDim.x / WARP_SIZE ? scratch[lane] : NEG_INF;
    return warp_max(v);
}

// Grid-stride loop over [0, n) with 64-bit indices (the 120M shape has tensors near 2^31 elements).
#define GRID_STRIDE_LOOP(i, n) \
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < (n); i += (long long)gridDim.x * blockDim.x)

// bf16 storage without headers: the top 16 bits of an fp32 (unsigned short in memory). Conversions to
// bf16 round to nearest even (cvt.rn, sm_80+); NaN stays NaN.
typedef unsigned short bf16;
__device__ __forceinline__ float bf16_to_f32(bf16 x) { return __uint_as_float(static_cast<unsigned>(x) << 16); }
__device__ __forceinline__ bf16 f32_to_bf16(float x) {
    unsigned short r;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(x));
    return r;
}
// Two floats as one bf16x2 register: `lo` in the low half (the lower address, the lower mma k-index).
__device__ __forceinline__ unsigned pack_bf16x2(float lo, float hi) {
    unsigned r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// act_t: the element type of activations and of the activation gradients that feed matrix products,
// fixed per build (-DACT_BF16 for precision bf16; float otherwise). Statistics (LayerNorm mean and rstd,
// attention lse, losses), parameters and their gradients stay float; arithmetic is float throughout.
#ifdef ACT_BF16
typedef bf16 act_t;
#else
typedef float act_t;
#endif
__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(bf16 x) { return bf16_to_f32(x); }
__device__ __forceinline__ void store(float* p, float x) { *p = x; }
__device__ __forceinline__ void store(bf16* p, float x) { *p = f32_to_bf16(x); }
