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

// Sum and max over the 4 lanes that share a row of an mma accumulator (lanes 4g .. 4g + 3).
__device__ __forceinline__ float row_sum4(float v) {
    v += __shfl_xor_sync(FULL_MASK, v, 1);
    return v + __shfl_xor_sync(FULL_MASK, v, 2);
}

__device__ __forceinline__ float row_max4(float v) {
    v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, 1));
    return fmaxf(v, __shfl_xor_sync(FULL_MASK, v, 2));
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

// fp16 storage the same way (IEEE half bits); conversions round to nearest even.
__device__ __forceinline__ float f16_to_f32(unsigned short x) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x));
    return f;
}
__device__ __forceinline__ unsigned short f32_to_f16(float x) {
    unsigned short r;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(x));
    return r;
}
__device__ __forceinline__ unsigned pack_f16x2(float lo, float hi) {
    unsigned r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// act_t: the element type of activations and of the activation gradients that feed matrix products,
// fixed per build: -DACT_BF16 (precision bf16) or -DACT_FP16 (fp16) make it a 16-bit `lowp`, read and
// written through the build's conversions below; float otherwise. Statistics (LayerNorm mean and rstd,
// attention lse, losses), parameters and their gradients stay float; arithmetic is float throughout.
typedef unsigned short lowp;  // a 16-bit activation of this build: bf16 bits, or fp16 bits under ACT_FP16
#ifdef ACT_FP16
__device__ __forceinline__ float lowp_to_f32(lowp x) { return f16_to_f32(x); }
__device__ __forceinline__ lowp f32_to_lowp(float x) { return f32_to_f16(x); }
__device__ __forceinline__ unsigned pack_lowp2(float lo, float hi) { return pack_f16x2(lo, hi); }
#else
__device__ __forceinline__ float lowp_to_f32(lowp x) { return bf16_to_f32(x); }
__device__ __forceinline__ lowp f32_to_lowp(float x) { return f32_to_bf16(x); }
__device__ __forceinline__ unsigned pack_lowp2(float lo, float hi) { return pack_bf16x2(lo, hi); }
#endif
// The two 16-bit values of a 32-bit word: the lower address first.
__device__ __forceinline__ void unpack_lowp2(unsigned w, float& lo, float& hi) {
    lo = lowp_to_f32(static_cast<lowp>(w & 0xffffu));
    hi = lowp_to_f32(static_cast<lowp>(w >> 16));
}
#if defined(ACT_BF16) || defined(ACT_FP16)
#define ACT_LOWP  // a 16-bit build: kernels may use approximations below its rounding (GELU's tanh, softmax's exp)
typedef lowp act_t;
#else
typedef float act_t;
#endif
__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(lowp x) { return lowp_to_f32(x); }
__device__ __forceinline__ void store(float* p, float x) { *p = x; }
__device__ __forceinline__ void store(lowp* p, float x) { *p = f32_to_lowp(x); }

// A value as an act_t store leaves it: rounded to the 16-bit type, unchanged in the fp32 build.
__device__ __forceinline__ float as_stored(float x) {
#ifdef ACT_LOWP
    return lowp_to_f32(f32_to_lowp(x));
#else
    return x;
#endif
}

// amax of the values a producer stored (precision fp8: the casts' scales, andrea/ops/fp8.py), into *amax as
// float bits (non-negative floats order as their bits; *amax starts at 0). `m` is the thread's max |x| before
// the store's rounding: rounding to nearest is monotonic and symmetric, so rounding the max gives the max of
// the rounded values. fmaxf passes NaN over, as the cast's own amax pass does. Every thread of the block
// calls it.
__device__ __forceinline__ void block_amax(unsigned* amax, float m) {
    __shared__ float scratch[32];
    m = block_max(m, scratch);
    if (threadIdx.x == 0) {
        m = as_stored(m);
        if (m > 0.0f) atomicMax(amax, __float_as_uint(m));
    }
}
// The same from one warp (every lane calls it): for kernels whose warps end apart, or that keep their shared memory.
__device__ __forceinline__ void warp_amax(unsigned* amax, float m) {
    m = as_stored(warp_max(m));
    if (threadIdx.x % WARP_SIZE == 0 && m > 0.0f) atomicMax(amax, __float_as_uint(m));
}
// Two floats as FP8 bytes (E5M2 where e5m2, else E4M3), rounded to nearest even, saturating at the format's
// largest value: `lo` in the low byte.
__device__ __forceinline__ unsigned short fp8x2(float lo, float hi, int e5m2) {
    unsigned short r = 0;
#if __CUDA_ARCH__ >= 890
    if (e5m2) asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
    else asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
#else
    __trap();  // FP8 conversions are sm_89+ (the engine refuses precision fp8 below)
#endif
    return r;
}

// The scale's exponent e (s = 2^e) for amax bits `a`: amax = 1.f * 2^k, the format's max 1.75 * 2^emax,
// so e = emax - k, one less where the mantissa is over 1.75; kept inside float's normal range.
__device__ __forceinline__ int fp8_scale_exponent(unsigned a, int emax) {
    if (a == 0u) return 0;  // all zeros: any scale, 1
    const int k = static_cast<int>((a >> 23) & 0xffu) - 127;
    const int e = emax - k - ((a & 0x7fffffu) > 0x600000u ? 1 : 0);
    return max(-126, min(127, e));
}

// 16 bytes of activations as floats: ACT_VEC of them (4 float or 8 lowp). Elementwise kernels move 16
// bytes per load and store where every pointer they touch is 16-byte aligned (aligned16), else one element.
#define ACT_VEC (16 / (int)sizeof(act_t))
__device__ __forceinline__ bool aligned16(const void* a, const void* b = nullptr, const void* c = nullptr) {
    return ((reinterpret_cast<unsigned long long>(a) | reinterpret_cast<unsigned long long>(b) |
             reinterpret_cast<unsigned long long>(c)) & 15ull) == 0;
}
__device__ __forceinline__ void load_vec(const float* p, float (&v)[4]) {
    const float4 u = *reinterpret_cast<const float4*>(p);
    v[0] = u.x, v[1] = u.y, v[2] = u.z, v[3] = u.w;
}
// 16 bytes as loaded (a uint4) to ACT_VEC floats: for kernels that keep a group's bytes in registers.
__device__ __forceinline__ void unpack_vec(const uint4 u, float (&v)[4]) {
    v[0] = __uint_as_float(u.x), v[1] = __uint_as_float(u.y), v[2] = __uint_as_float(u.z), v[3] = __uint_as_float(u.w);
}
__device__ __forceinline__ void unpack_vec(const uint4 u, float (&v)[8]) {
    const unsigned w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int i = 0; i < 4; i++) unpack_lowp2(w[i], v[2 * i], v[2 * i + 1]);
}
__device__ __forceinline__ void load_vec(const lowp* p, float (&v)[8]) { unpack_vec(*reinterpret_cast<const uint4*>(p), v); }
__device__ __forceinline__ void store_vec(float* p, const float (&v)[4]) {
    *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
}
__device__ __forceinline__ void store_vec(lowp* p, const float (&v)[8]) {
    *reinterpret_cast<uint4*>(p) = make_uint4(pack_lowp2(v[0], v[1]), pack_lowp2(v[2], v[3]),
                                              pack_lowp2(v[4], v[5]), pack_lowp2(v[6], v[7]));
}
// ACT_VEC floats of an fp32 tensor (a gradient beside act_t activations): ACT_VEC / 4 float4s.
__device__ __forceinline__ void load_f32(const float* p, float (&v)[ACT_VEC]) {
#pragma unroll
    for (int i = 0; i < ACT_VEC; i += 4) {
        const float4 u = *reinterpret_cast<const float4*>(p + i);
        v[i] = u.x, v[i + 1] = u.y, v[i + 2] = u.z, v[i + 3] = u.w;
    }
}
__device__ __forceinline__ void store_f32(float* p, const float (&v)[ACT_VEC]) {
#pragma unroll
    for (int i = 0; i < ACT_VEC; i += 4) *reinterpret_cast<float4*>(p + i) = make_float4(v[i], v[i + 1], v[i + 2], v[i + 3]);
}

// Elementwise over [0, n): `vector(i)` for each whole group of ACT_VEC starting at i (when `vec`), then
// `scalar(i)` for every element left; grid-stride, any grid size.
template <typename Vector, typename Scalar>
__device__ __forceinline__ void elementwise(long long n, bool vec, Vector vector, Scalar scalar) {
    const long long start = blockIdx.x * (long long)blockDim.x + threadIdx.x, stride = (long long)gridDim.x * blockDim.x;
    long long done = 0;
    if (vec) {
        const long long groups = n / ACT_VEC;
        for (long long g = start; g < groups; g += stride) vector(g * ACT_VEC);
        done = groups * ACT_VEC;
    }
    for (long long i = done + start; i < n; i += stride) scalar(i);
}

// ---- GELU, the tanh approximation (as GPT-2): mlp.cu's passes, and fp8.cu's cast of the gradient at pre ----
#define GELU_K 0.7978845608028654f  // sqrt(2 / pi)
#define GELU_C 0.044715f

// tanh: in the 16-bit builds the hardware's tanh.approx.f32 (one instruction, relative error below 2^-10.9,
// under the rounding of a bf16 result); libm's tanhf takes some twenty instructions, which made the GELU
// passes compute-bound at bf16's byte count. The fp32 build keeps tanhf.
__device__ __forceinline__ float gelu_tanh(float u) {
#ifdef ACT_LOWP
    float t;
    asm("tanh.approx.f32 %0, %1;" : "=f"(t) : "f"(u));
    return t;
#else
    return tanhf(u);
#endif
}

__device__ __forceinline__ float gelu(float x) { return 0.5f * x * (1.0f + gelu_tanh(GELU_K * (x + GELU_C * x * x * x))); }

__device__ __forceinline__ float gelu_grad(float x) {
    const float th = gelu_tanh(GELU_K * (x + GELU_C * x * x * x));
    return 0.5f * (1.0f + th) + 0.5f * x * (1.0f - th * th) * GELU_K * (1.0f + 3.0f * GELU_C * x * x);
}
