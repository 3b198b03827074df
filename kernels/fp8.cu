// FP8 operands of the matrix products under precision fp8 (andrea/ops/fp8.py): per-tensor current scaling.
//
// A tensor's scale is the largest power of two s with amax * s <= the format's largest finite value
// (E4M3 448, E5M2 57344); x * s is then exact in float, the stored byte is x * s rounded to nearest even
// (satfinite), and the product takes 1 / s, also exact. amax is a max, which no order of combining
// changes: the same inputs give the same bytes on every run.
#include "common.cuh"

#define FP8_TILE 64      // a block casts a 64 x 64 tile (and writes its transpose)
#define FP8_THREADS 256  // 8 threads a tile row of 64 activations (8 each), 32 rows a pass, 2 passes
#define FP8_AMAX_THREADS 256

// amax of n activations into *amax (block_amax, kernels/common.cuh; the launcher clears it). NaN is passed
// over here and shows in the cast's output. 16-byte loads where x is 16-byte aligned (the tail, and any other
// x, one element at a time).
extern "C" __global__ void __launch_bounds__(FP8_AMAX_THREADS) k_fp8_amax(unsigned int* amax, const act_t* __restrict__ x,
                                                                          long long n) {
    constexpr int per = 16 / sizeof(act_t);
    float m = 0.0f;
    long long head = 0;
    if ((reinterpret_cast<size_t>(x) % 16) == 0) {
        head = n / per * per;
        const uint4* v = reinterpret_cast<const uint4*>(x);
        GRID_STRIDE_LOOP(i, head / per) {
            const uint4 w = v[i];
            const unsigned words[4] = {w.x, w.y, w.z, w.w};
#ifdef ACT_LOWP
            for (int j = 0; j < 4; ++j) {
                float lo, hi;
                unpack_lowp2(words[j], lo, hi);
                m = fmaxf(m, fmaxf(fabsf(lo), fabsf(hi)));
            }
#else
            for (int j = 0; j < 4; ++j) m = fmaxf(m, fabsf(__uint_as_float(words[j])));
#endif
        }
    }
    for (long long i = head + blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        m = fmaxf(m, fabsf(to_f32(x[i])));
    block_amax(amax, m);  // the values are stored ones already: as_stored leaves them as they are
}

// The scale's exponent e (s = 2^e) for amax bits `a`: amax = 1.f * 2^k, the format's max 1.75 * 2^emax,
// so e = emax - k, one less where the mantissa is over 1.75; kept inside float's normal range.
__device__ __forceinline__ int fp8_scale_exponent(unsigned a, int emax) {
    if (a == 0u) return 0;  // all zeros: any scale, 1
    const int k = static_cast<int>((a >> 23) & 0xffu) - 127;
    const int e = emax - k - ((a & 0x7fffffu) > 0x600000u ? 1 : 0);
    return max(-126, min(127, e));
}

// Cast x [batch, rows, cols] (row-major) to FP8 with the scale of *amax: q[z] (row-major, leading
// dimension ldq, batch z at q + z * q_batch) and/or its transpose qt[z] ([cols, rows], leading dimension
// ldqt, at qt + z * qt_batch); a null q or qt is not written. The block at (0, 0, 0) writes 1 / s to
// *descale. Grid: (ceil(cols / 64), ceil(rows / 64), batch).
extern "C" __global__ void __launch_bounds__(FP8_THREADS)
k_fp8_cast(unsigned char* q, long long ldq, long long q_batch, unsigned char* qt, long long ldqt, long long qt_batch,
           float* descale, const unsigned int* amax, const act_t* __restrict__ x, int rows, int cols, int e5m2) {
    __shared__ unsigned char tile[FP8_TILE][FP8_TILE + 8];  // [row][col]; 8 bytes of pad a row
    const int e = fp8_scale_exponent(*amax, e5m2 ? 15 : 8);
    const float s = __int_as_float((e + 127) << 23);
    if (blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0 && threadIdx.x == 0) *descale = __int_as_float((127 - e) << 23);
    const long long z = blockIdx.z;
    x += z * rows * static_cast<long long>(cols);
    const int r0 = blockIdx.y * FP8_TILE, c0 = blockIdx.x * FP8_TILE;
    const int cv = (threadIdx.x % 8) * 8;  // this thread's 8 columns of a tile row
    for (int pass = 0; pass < FP8_TILE / 32; ++pass) {
        const int tr = pass * 32 + threadIdx.x / 8;
        const int r = r0 + tr;
        const act_t* row = x + r * static_cast<long long>(cols);
        const bool whole = r < rows && c0 + cv + 8 <= cols;  // all 8 in bounds
        float v[8];
#ifdef ACT_LOWP
        if (whole && (cols % 8) == 0 && (reinterpret_cast<size_t>(x) % 16) == 0) {  // one 16-byte load
            const uint4 w = *reinterpret_cast<const uint4*>(row + c0 + cv);
            unpack_lowp2(w.x, v[0], v[1]);
            unpack_lowp2(w.y, v[2], v[3]);
            unpack_lowp2(w.z, v[4], v[5]);
            unpack_lowp2(w.w, v[6], v[7]);
        } else
#endif
        {
            for (int j = 0; j < 8; ++j) v[j] = (r < rows && c0 + cv + j < cols) ? to_f32(row[c0 + cv + j]) : 0.0f;
        }
        unsigned lo4 = 0, hi4 = 0;  // the 8 bytes, the lower column first
        for (int j = 0; j < 2; ++j) {
            lo4 |= static_cast<unsigned>(fp8x2(v[2 * j] * s, v[2 * j + 1] * s, e5m2)) << (16 * j);
            hi4 |= static_cast<unsigned>(fp8x2(v[4 + 2 * j] * s, v[5 + 2 * j] * s, e5m2)) << (16 * j);
        }
        *reinterpret_cast<uint2*>(&tile[tr][cv]) = make_uint2(lo4, hi4);
        if (q != nullptr && r < rows) {
            unsigned char* out = q + z * q_batch + r * ldq + c0 + cv;
            if (whole && (ldq % 8) == 0 && (q_batch % 8) == 0) *reinterpret_cast<uint2*>(out) = make_uint2(lo4, hi4);
            else
                for (int j = 0; j < 8; ++j)
                    if (c0 + cv + j < cols) out[j] = tile[tr][cv + j];
        }
    }
    if (qt == nullptr) return;
    __syncthreads();
    // the transpose: thread t writes 8 consecutive rows of one column (a row of qt)
    for (int pass = 0; pass < FP8_TILE / 32; ++pass) {
        const int tc = pass * 32 + threadIdx.x / 8;
        const int c = c0 + tc;
        if (c >= cols) continue;
        unsigned char* out = qt + z * qt_batch + c * ldqt + r0 + cv;
        if (r0 + cv + 8 <= rows && (ldqt % 8) == 0 && (qt_batch % 8) == 0) {
            unsigned lo4 = 0, hi4 = 0;
            for (int j = 0; j < 4; ++j) {
                lo4 |= static_cast<unsigned>(tile[cv + j][tc]) << (8 * j);
                hi4 |= static_cast<unsigned>(tile[cv + 4 + j][tc]) << (8 * j);
            }
            *reinterpret_cast<uint2*>(out) = make_uint2(lo4, hi4);
        } else {
            for (int j = 0; j < 8; ++j)
                if (r0 + cv + j < rows) out[j] = tile[cv + j][tc];
        }
    }
}
