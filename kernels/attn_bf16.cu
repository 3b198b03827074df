// attn_bf16: causal scaled dot-product attention for bf16 activations and head width 64, per batch row b and head h:
//   forward:  S = Q K^T * scale,  P = softmax(S) over keys j <= i,  Y = P V;  saves lse_i = ln sum_j exp(S_ij) (fp32)
//   backward: P = exp(S - lse),  dP = dY V^T,  D_i = rowsum(dY * Y) (= rowsum(P * dP)),  dS = P * (dP - D) * scale,
//             dQ += dS K,  dK += dS^T Q,  dV += P^T dY
// The same algorithm, interface conventions and lse / D as kernels/attn.cu, on the bf16 tensor cores: every product
// is mma m16n8k16 with bf16 operands and fp32 accumulation. Softmax, lse, D and the accumulators are fp32; P and dS
// are rounded to bf16 only as operands of the next product, and each result is rounded to bf16 once, when stored
// (the backward adds into dqkv: old bf16 value + fp32 result, one rounding).
//
// Layouts (row-major): qkv and dqkv are [3, B, T, C] (Q, K, V planes), out (Y) and dout (dY) [B, T, C], head h the
// columns [64 h, 64 h + 64) of C (so C = 64 H); lse and D are fp32 [B, H, T]. T is any length >= 1: rows past T read
// as zero and are never written. No atomics: every sum runs in an order fixed by the launch shape, so repeated runs
// give identical bits. The backward is two kernels, as in attn.cu: k_attn_bwd_dq_bf16, one block per query tile,
// writes D and loops over key tiles to add dQ; then k_attn_bwd_bf16, one block per key tile, reads D and loops over
// query tiles to add dK and dV.
//
// Launch configuration (the host mirrors these #defines), in launch order:
//   k_attn_fwd_bf16     block ATTN_BF16_THREADS (256)     grid (B * H, ceil(T / ATTN_BF16_ROWS))     (ROWS = 128)
//   k_attn_bwd_dq_bf16  block ATTN_BF16_THREADS (256)     grid (B * H, ceil(T / ATTN_BF16_ROWS))
//   k_attn_bwd_bf16     block ATTN_BF16_KV_THREADS (128)  grid (B * H, ceil(T / ATTN_BF16_KV_ROWS))  (KV_ROWS = 64)
// Shared memory is static only (ATTN_BF16_FWD_SMEM, _DQ_SMEM, _BWD_SMEM = 49152, 32768, 33792 bytes): launch with 0
// dynamic bytes, no attribute to set. Each block owns a tile of queries (keys in k_attn_bwd_bf16); warp w owns its
// rows 16 w .. 16 w + 15, held in registers as mma A operands, while the other operand streams through shared memory
// in 64-row tiles, double-buffered with cp.async. k_attn_bwd_bf16 keeps the dK and dV accumulators besides K and V
// (about 170 registers a thread), hence its smaller blocks.
#include "common.cuh"

#define ATTN_BF16_THREADS 256     // k_attn_fwd_bf16, k_attn_bwd_dq_bf16: 8 warps
#define ATTN_BF16_BLOCKS 2        // their blocks per SM the register budget is set for: at most 128 registers a thread
#define ATTN_BF16_ROWS 128        // their query tile: grid.y = ceil(T / 128)
#define ATTN_BF16_KV_THREADS 128  // k_attn_bwd_bf16: 4 warps
#define ATTN_BF16_KV_BLOCKS 3     // its blocks per SM: at most 168 registers a thread
#define ATTN_BF16_KV_ROWS 64      // its key tile: grid.y = ceil(T / 64)
#define ATTN_BF16_STREAM 64       // rows of a streamed tile: keys (fwd, bwd_dq) or queries (bwd)
#define ATTN_BF16_HD 64           // head width, the only one these kernels take
#define ATTN_BF16_ROW_BYTES 128                                         // one row of 64 bf16
#define ATTN_BF16_TILE_BYTES (ATTN_BF16_STREAM * ATTN_BF16_ROW_BYTES)  // 8 KB: a streamed tile (or a 64-key tile)
#define ATTN_BF16_OWN_BYTES (ATTN_BF16_ROWS * ATTN_BF16_ROW_BYTES)     // 16 KB: a 128-query tile
#define ATTN_BF16_STAT_BYTES (2 * ATTN_BF16_STREAM * 4)                // a query tile's lse and D (fp32)
// Static shared memory of each kernel, in bytes:
#define ATTN_BF16_FWD_SMEM (ATTN_BF16_OWN_BYTES + 4 * ATTN_BF16_TILE_BYTES)       // 49152: Q; K and V twice
#define ATTN_BF16_DQ_SMEM (4 * ATTN_BF16_TILE_BYTES)                              // 32768: K, V twice (Q, dY first)
#define ATTN_BF16_BWD_SMEM (4 * ATTN_BF16_TILE_BYTES + 2 * ATTN_BF16_STAT_BYTES)  // 33792: Q, dY, lse, D twice
// The launch shape, for the host: {THREADS, ROWS, KV_THREADS, KV_ROWS}.
extern "C" __constant__ int attn_bf16_launch[4] = {ATTN_BF16_THREADS, ATTN_BF16_ROWS, ATTN_BF16_KV_THREADS,
                                                   ATTN_BF16_KV_ROWS};
#define LOG2E 1.4426950408889634f
#define LN2 0.6931471805599453f
#define POS_INF __int_as_float(0x7f800000)

// ---- fragments -------------------------------------------------------------------------------------------------
// mma.m16n8k16.row.col, bf16 operands (two per 32-bit register, the lower k-index or column in the low half),
// fp32 accumulators, g = lane / 4, t = lane % 4:
//   A (16 x 16, row-major): a0 = (row g, k 2t .. 2t+1), a1 = (row g+8, k 2t .. 2t+1),
//                           a2 = (row g, k 2t+8 .. 2t+9), a3 = (row g+8, k 2t+8 .. 2t+9)
//   B (16 x 8, "col"):      b0 = (k 2t .. 2t+1, col g), b1 = (k 2t+8 .. 2t+9, col g)
//   C (16 x 8):             c0, c1 = (row g, cols 2t, 2t+1), c2, c3 = (row g+8, cols 2t, 2t+1)
// A warp's 16 x 64 accumulator is acc[n][r] = C fragment r of columns 8n .. 8n+7: row g + 8 (r / 2), column
// 8n + 2t + r % 2. Two adjacent C fragments (columns 16k .. 16k+15) of a product are, packed to bf16 pairs, the A
// fragment of k-step k of the next product: a0 = (c0, c1) and a1 = (c2, c3) of columns 16k .. 16k+7, a2 and a3 the
// same of columns 16k+8 .. 16k+15; that is how P and dS feed their products without leaving registers.
//
// ldmatrix.x4 loads four 8 x 8 bf16 matrices, matrix j from the eight 16-byte rows whose addresses lanes 8j .. 8j+7
// give; lane l gets in register j the pair (row l/4, columns 2(l%4), 2(l%4)+1) of matrix j, or with .trans the pair
// (rows 2(l%4), 2(l%4)+1, column l/4). So, over a 16-row band of a row-major tile:
//   rows-first order (matrices: rows +0 / +8 of 16-byte chunk 2x, then rows +0 / +8 of chunk 2x+1):
//     plain:  the A fragment of rows band .. band+15, k-step x (k = columns 16x .. 16x+15);
//     .trans: a tile stored [k][n] (rows = k): b0, b1 of columns 16x .. 16x+7, then b0, b1 of 16x+8 .. 16x+15,
//             k = the band's 16 rows;
//   chunks-first order (matrices: chunk 2x then 2x+1 of rows +0, then the same of rows +8), plain, a tile stored
//     [n][k] (rows = n): b0, b1 of n-block rows band .. band+7, then b0, b1 of rows band+8 .. band+15, k-step x.

// Shared-memory tiles hold rows of 64 bf16 (128 bytes, eight 16-byte chunks) without padding; chunk c of row r is
// stored at chunk c ^ (r % 8). The eight rows of one ldmatrix matrix (consecutive rows, one chunk) then lie in eight
// different bank groups, and a warp's cp.async writes (4 rows x 8 chunks) cover all banks once.
__device__ __forceinline__ unsigned tile_offset(int r, int c) { return r * ATTN_BF16_ROW_BYTES + ((c ^ (r & 7)) << 4); }

__device__ __forceinline__ unsigned smem_u32(const void* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// This lane's row address for an ldmatrix.x4 over rows band .. band+15 and chunks 2x, 2x+1 (see above).
__device__ __forceinline__ unsigned rows_first(unsigned tile, int band, int x, int lane) {
    return tile + tile_offset(band + (lane & 15), 2 * x + (lane >> 4));
}
__device__ __forceinline__ unsigned chunks_first(unsigned tile, int band, int x, int lane) {
    return tile + tile_offset(band + ((lane >> 4) << 3) + (lane & 7), 2 * x + ((lane >> 3) & 1));
}

__device__ __forceinline__ void ldsm(unsigned (&r)[4], unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

__device__ __forceinline__ void ldsm_trans(unsigned (&r)[4], unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

__device__ __forceinline__ float2 lds_f2(unsigned addr) {
    float2 v;
    asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];" : "=f"(v.x), "=f"(v.y) : "r"(addr));
    return v;
}

// c[16 x 8] += a[16 x 16] b[16 x 8]
__device__ __forceinline__ void mma_bf16(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// The A fragment of k-step k from a 16-column pair of C fragments (P or dS), rounded to bf16.
__device__ __forceinline__ void pack_a(unsigned (&a)[4], const float (&lo)[4], const float (&hi)[4]) {
    a[0] = pack_bf16x2(lo[0], lo[1]);
    a[1] = pack_bf16x2(lo[2], lo[3]);
    a[2] = pack_bf16x2(hi[0], hi[1]);
    a[3] = pack_bf16x2(hi[2], hi[3]);
}

// ---- asynchronous copies ---------------------------------------------------------------------------------------
// src_bytes 0 fills the destination with zeros and reads nothing (the address is still a valid one).
__device__ __forceinline__ void cp_async16(unsigned dst, const void* src, bool inside) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(inside ? 16 : 0) : "memory");
}

__device__ __forceinline__ void cp_async4(unsigned dst, const void* src, bool inside) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(dst), "l"(src), "r"(inside ? 4 : 0) : "memory");
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

// This thread's copies, except those of its N most recent groups, have landed; a __syncthreads() after it makes
// everyone's visible.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// Starts copying rows [row0, row0 + ROWS) of one head's [T, 64] slice (row stride C) into the swizzled tile at shared
// address `tile`; rows at or past T read as zero. Thread i copies chunk i % 8 of rows i / 8, i / 8 + THREADS / 8, ...;
// `src` is the slice's start plus this thread's offset (i / 8) C + 8 (i % 8), from slice_of(); rows past T copy
// nothing from `valid`, any address inside the tensor.
template <int ROWS, int THREADS = ATTN_BF16_THREADS>
__device__ __forceinline__ void load_tile(unsigned tile, const bf16* src, const bf16* valid, int row0, int T, int C) {
    constexpr int ROWS_PER_PASS = THREADS / 8;
    const int r = threadIdx.x / 8, c = threadIdx.x % 8;
#pragma unroll
    for (int k = 0; k < ROWS / ROWS_PER_PASS; k++) {
        const int row = row0 + r + k * ROWS_PER_PASS;
        const bool inside = row < T;
        const bf16* from = inside ? src + (long long)(row0 + k * ROWS_PER_PASS) * C : valid;
        cp_async16(tile + tile_offset(r + k * ROWS_PER_PASS, c), from, inside);
    }
}

// `base` (a head's [T, 64] slice) plus this thread's offset in load_tile(); dereferenced only for rows below T.
__device__ __forceinline__ const bf16* slice_of(const bf16* base, int C) {
    return base + (threadIdx.x / 8) * C + (threadIdx.x % 8) * 8;
}

// ---- small helpers ---------------------------------------------------------------------------------------------
// 2^x by the hardware approximation (relative error about 2^-22); results below 2^-126 flush to zero (harmless next
// to the row's largest term, 1), and 2^-inf = 0. exp2f() would add a rescaling path for such results.
__device__ __forceinline__ float exp2_approx(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// Sum over the 4 lanes that share a row of the accumulator.
__device__ __forceinline__ float row_sum4(float v) {
    v += __shfl_xor_sync(FULL_MASK, v, 1);
    return v + __shfl_xor_sync(FULL_MASK, v, 2);
}

__device__ __forceinline__ float row_max4(float v) {
    v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, 1));
    return fmaxf(v, __shfl_xor_sync(FULL_MASK, v, 2));
}

template <int N>
__device__ __forceinline__ void zero(float (&acc)[N][4]) {
#pragma unroll
    for (int n = 0; n < N; n++)
#pragma unroll
        for (int r = 0; r < 4; r++) acc[n][r] = 0.0f;
}

// The low and high bf16 of a pair, as floats.
__device__ __forceinline__ float lo_f32(unsigned x) { return __uint_as_float(x << 16); }
__device__ __forceinline__ float hi_f32(unsigned x) { return __uint_as_float(x & 0xffff0000u); }

// dst[row, 8n + 2t .. +1] (+)= scale * acc for the thread's two rows (row0, row0 + 8) below T: the old bf16 value
// (when ADD) plus the fp32 result, rounded once.
template <bool ADD>
__device__ __forceinline__ void store_rows(bf16* __restrict__ dst, const float (&acc)[8][4], const float (&scale)[2],
                                           int row0, int T, int C, int t) {
#pragma unroll
    for (int half = 0; half < 2; half++) {
        const int row = row0 + 8 * half;
        if (row >= T) continue;
        unsigned* d = reinterpret_cast<unsigned*>(dst + (long long)row * C + 2 * t);
#pragma unroll
        for (int n = 0; n < 8; n++) {
            float x = acc[n][2 * half] * scale[half], y = acc[n][2 * half + 1] * scale[half];
            if (ADD) {
                const unsigned old = d[4 * n];
                x += lo_f32(old);
                y += hi_f32(old);
            }
            d[4 * n] = pack_bf16x2(x, y);
        }
    }
}

// blockIdx.x, read so that the compiler cannot reuse an earlier read (nor values derived from it).
__device__ __forceinline__ int block_x() {
    unsigned x;
    asm volatile("mov.u32 %0, %%ctaid.x;" : "=r"(x));
    return static_cast<int>(x);
}

struct Head {  // one (b, h): the head's column offset into the [B, T, C] activations and its lse row
    long long seq;  // offset of element [b, 0, 64 h] in a [B, T, C] tensor
    long long stat;  // offset of row [b, h, 0] in a [B, H, T] tensor
    long long plane;  // B * T * C: Q, K, V (and dQ, dK, dV) are consecutive planes of qkv
};

__device__ __forceinline__ Head head_of(int bh, int B, int T, int C, int H) {
    const int b = bh / H, h = bh % H;
    return {(long long)b * T * C + (long long)h * ATTN_BF16_HD, (long long)bh * T, (long long)B * T * C};
}

// ---- forward: one block per (b, h) and 128-query tile, key tiles of 64 -------------------------------------------
extern "C" __global__ void __launch_bounds__(ATTN_BF16_THREADS, ATTN_BF16_BLOCKS)
k_attn_fwd_bf16(bf16* out, float* lse, const bf16* qkv, int B, int T, int C, int H, float scale) {
    __shared__ __align__(128) bf16 smem[ATTN_BF16_FWD_SMEM / 2];
    const unsigned Qs = smem_u32(smem), KV = Qs + ATTN_BF16_OWN_BYTES;  // buffer s: K at KV + 2 s TILE, V after it
    const int n_tiles = (T + ATTN_BF16_ROWS - 1) / ATTN_BF16_ROWS;
    const int q0 = (n_tiles - 1 - blockIdx.y) * ATTN_BF16_ROWS;  // the longest rows first
    const Head hh = head_of(blockIdx.x, B, T, C, H);
    const bf16* q = qkv + hh.seq;
    const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE, g = lane / 4, t = lane % 4;
    const int wrow = q0 + 16 * warp;  // the warp's first row
    const int row0 = wrow + g;        // this thread's rows: row0 and row0 + 8
    const int n_kt = (min(T, q0 + ATTN_BF16_ROWS) + ATTN_BF16_STREAM - 1) / ATTN_BF16_STREAM;
    const float s2 = scale * LOG2E;  // softmax in base 2: exp(x) = exp2(x log2 e)

    const bf16* q_src = slice_of(q, C);  // this thread's share of the Q, K and V tile copies
    const bf16* k_src = q_src + hh.plane;
    const bf16* v_src = q_src + 2 * hh.plane;
    load_tile<ATTN_BF16_ROWS>(Qs, q_src, qkv, q0, T, C);
    cp_async_commit();
    load_tile<ATTN_BF16_STREAM>(KV, k_src, qkv, 0, T, C);
    load_tile<ATTN_BF16_STREAM>(KV + ATTN_BF16_TILE_BYTES, v_src, qkv, 0, T, C);
    cp_async_commit();
    cp_async_wait<1>();  // Q (K and V of tile 0 may still be on their way)
    __syncthreads();
    unsigned qf[4][4];  // the warp's 16 query rows as A fragments, k-steps over the head's 64 columns
#pragma unroll
    for (int kc = 0; kc < 4; kc++) ldsm(qf[kc], rows_first(Qs, 16 * warp, kc, lane));

    float o[8][4];
    zero(o);
    float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.0f, 0.0f};  // running max (base 2) and this lane's share of the sum
    for (int kt = 0; kt < n_kt; kt++) {
        if (kt + 1 < n_kt) {  // prefetch the next K and V into the other buffer (its readers passed the last barrier)
            const unsigned nb = KV + ((kt + 1) & 1) * 2 * ATTN_BF16_TILE_BYTES;
            load_tile<ATTN_BF16_STREAM>(nb, k_src, qkv, (kt + 1) * ATTN_BF16_STREAM, T, C);
            load_tile<ATTN_BF16_STREAM>(nb + ATTN_BF16_TILE_BYTES, v_src, qkv, (kt + 1) * ATTN_BF16_STREAM, T, C);
        }
        cp_async_commit();
        cp_async_wait<1>();  // tile kt
        __syncthreads();
        const unsigned Ks = KV + (kt & 1) * 2 * ATTN_BF16_TILE_BYTES, Vs = Ks + ATTN_BF16_TILE_BYTES;
        // The tile in two halves of 32 keys, each a step of the online softmax (fewer live registers than one step
        // of 64). Warps whose rows all lie past T, or before the half's first key, skip it (warp-uniform).
#pragma unroll
        for (int half = 0; half < 2; half++) {
            const int kb = kt * ATTN_BF16_STREAM + 32 * half;  // the half's first key
            if (wrow >= T || kb > wrow + 15) break;
            float s[4][4];
            zero(s);
#pragma unroll
            for (int kc = 0; kc < 4; kc++)
#pragma unroll
                for (int np = 0; np < 2; np++) {  // keys 16 np .. 16 np + 15 of the half
                    unsigned b[4];
                    ldsm(b, chunks_first(Ks, 32 * half + 16 * np, kc, lane));
                    mma_bf16(s[2 * np], qf[kc], b[0], b[1]);
                    mma_bf16(s[2 * np + 1], qf[kc], b[2], b[3]);
                }
            const bool diagonal = kb + 31 > wrow;  // some key lies past some row of the warp
            float mx[2] = {NEG_INF, NEG_INF};  // the half's row maxima of S (before scaling)
#pragma unroll
            for (int n = 0; n < 4; n++)
#pragma unroll
                for (int r = 0; r < 4; r++) {
                    const int col = kb + n * 8 + 2 * t + (r & 1);
                    if (diagonal && col > row0 + 8 * (r >> 1)) s[n][r] = NEG_INF;
                    mx[r >> 1] = fmaxf(mx[r >> 1], s[n][r]);
                }
            float corr[2];
#pragma unroll
            for (int i = 0; i < 2; i++) {
                // finite: every row sees key 0 in the first step (scale > 0 keeps the order)
                const float m_new = fmaxf(m[i], row_max4(mx[i]) * s2);
                corr[i] = exp2_approx(m[i] - m_new);
                m[i] = m_new;
                l[i] *= corr[i];
            }
#pragma unroll
            for (int n = 0; n < 8; n++)
#pragma unroll
                for (int r = 0; r < 4; r++) o[n][r] *= corr[r >> 1];
#pragma unroll
            for (int n = 0; n < 4; n++)
#pragma unroll
                for (int r = 0; r < 4; r++) {
                    const float p = exp2_approx(fmaf(s[n][r], s2, -m[r >> 1]));  // masked: 2^-inf = 0
                    s[n][r] = p;
                    l[r >> 1] += p;
                }
#pragma unroll
            for (int kc = 0; kc < 2; kc++) {
                unsigned pf[4];  // P as the A fragment of keys 16 kc .. 16 kc + 15 of the half
                pack_a(pf, s[2 * kc], s[2 * kc + 1]);
#pragma unroll
                for (int np = 0; np < 4; np++) {  // columns 16 np .. 16 np + 15 of V
                    unsigned b[4];
                    ldsm_trans(b, rows_first(Vs, 32 * half + 16 * kc, np, lane));
                    mma_bf16(o[2 * np], pf, b[0], b[1]);
                    mma_bf16(o[2 * np + 1], pf, b[2], b[3]);
                }
            }
        }
        __syncthreads();  // every warp is done with this buffer before the next prefetch overwrites it
    }
    // The head's offsets again, from a fresh read of the block index: recomputing them is cheaper than keeping them
    // in registers through the loop.
    const Head hs = head_of(block_x(), B, T, C, H);
    float inv[2];
#pragma unroll
    for (int i = 0; i < 2; i++) {
        l[i] = row_sum4(l[i]);
        inv[i] = 1.0f / l[i];
        const int row = row0 + 8 * i;
        if (t == 0 && row < T) lse[hs.stat + row] = (m[i] + log2f(l[i])) * LN2;
    }
    store_rows<false>(out + hs.seq, o, inv, row0, T, C, t);
}

// ---- backward, first kernel: D and dQ, one block per (b, h) and 128-query tile, key tiles of 64 -------------------
extern "C" __global__ void __launch_bounds__(ATTN_BF16_THREADS, ATTN_BF16_BLOCKS)
k_attn_bwd_dq_bf16(bf16* dqkv, float* delta, const bf16* dout, const bf16* y, const bf16* qkv, const float* lse,
                   int B, int T, int C, int H, float scale) {
    __shared__ __align__(128) bf16 smem[ATTN_BF16_DQ_SMEM / 2];
    const unsigned KV = smem_u32(smem);  // buffer s: K at KV + 2 s TILE, V after it
    const unsigned Qs = KV, dYs = KV + ATTN_BF16_OWN_BYTES;  // the Q and dY tiles, before the first K and V
    const int n_tiles = (T + ATTN_BF16_ROWS - 1) / ATTN_BF16_ROWS;
    const int q0 = (n_tiles - 1 - blockIdx.y) * ATTN_BF16_ROWS;
    const Head hh = head_of(blockIdx.x, B, T, C, H);
    const bf16* q = qkv + hh.seq;
    const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE, g = lane / 4, t = lane % 4;
    const int wrow = q0 + 16 * warp, row0 = wrow + g;
    const int n_kt = (min(T, q0 + ATTN_BF16_ROWS) + ATTN_BF16_STREAM - 1) / ATTN_BF16_STREAM;
    const float s2 = scale * LOG2E;

    const bf16* q_src = slice_of(q, C);
    const bf16* k_src = q_src + hh.plane;
    const bf16* v_src = q_src + 2 * hh.plane;
    load_tile<ATTN_BF16_ROWS>(Qs, q_src, qkv, q0, T, C);
    load_tile<ATTN_BF16_ROWS>(dYs, slice_of(dout + hh.seq, C), dout, q0, T, C);
    cp_async_commit();
    // While they arrive: D and lse of the thread's two rows (rows past T: D = 0 and lse = +inf, so P = 0). Lane t
    // takes columns 8t .. 8t+7 and 32 + 8t .. 32 + 8t + 7 of dY and Y, read from global memory.
    float lse2[2], dsum[2];  // lse in base 2, and D
#pragma unroll
    for (int i = 0; i < 2; i++) {
        const int row = row0 + 8 * i;
        float acc = 0.0f;
        if (row < T) {
            const uint4* dy_row = reinterpret_cast<const uint4*>(dout + hh.seq + (long long)row * C);
            const uint4* y_row = reinterpret_cast<const uint4*>(y + hh.seq + (long long)row * C);
#pragma unroll
            for (int k = 0; k < 2; k++) {
                const uint4 a = dy_row[t + 4 * k], b = y_row[t + 4 * k];
                const unsigned av[4] = {a.x, a.y, a.z, a.w}, bv[4] = {b.x, b.y, b.z, b.w};
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    acc = fmaf(lo_f32(av[e]), lo_f32(bv[e]), acc);
                    acc = fmaf(hi_f32(av[e]), hi_f32(bv[e]), acc);
                }
            }
        }
        dsum[i] = row_sum4(acc);
        if (t == 0 && row < T) delta[hh.stat + row] = dsum[i];
        lse2[i] = row < T ? lse[hh.stat + row] * LOG2E : POS_INF;
    }
    cp_async_wait<0>();
    __syncthreads();
    unsigned qf[4][4], yf[4][4];  // the warp's 16 rows of Q and dY as A fragments
#pragma unroll
    for (int kc = 0; kc < 4; kc++) {
        ldsm(qf[kc], rows_first(Qs, 16 * warp, kc, lane));
        ldsm(yf[kc], rows_first(dYs, 16 * warp, kc, lane));
    }
    __syncthreads();  // Q and dY are in registers; their space becomes the K and V buffers
    load_tile<ATTN_BF16_STREAM>(KV, k_src, qkv, 0, T, C);
    load_tile<ATTN_BF16_STREAM>(KV + ATTN_BF16_TILE_BYTES, v_src, qkv, 0, T, C);
    cp_async_commit();

    float dq[8][4];
    zero(dq);
    for (int kt = 0; kt < n_kt; kt++) {
        if (kt + 1 < n_kt) {
            const unsigned nb = KV + ((kt + 1) & 1) * 2 * ATTN_BF16_TILE_BYTES;
            load_tile<ATTN_BF16_STREAM>(nb, k_src, qkv, (kt + 1) * ATTN_BF16_STREAM, T, C);
            load_tile<ATTN_BF16_STREAM>(nb + ATTN_BF16_TILE_BYTES, v_src, qkv, (kt + 1) * ATTN_BF16_STREAM, T, C);
        }
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();
        const unsigned Ks = KV + (kt & 1) * 2 * ATTN_BF16_TILE_BYTES, Vs = Ks + ATTN_BF16_TILE_BYTES;
        if (wrow < T) {
            // 16 keys at a time: S and dP of the warp's 16 rows x 16 keys, then dS, then dQ += dS K. Not unrolled:
            // one chunk at a time keeps the registers (Q and dY fragments, dQ) well inside the budget.
#pragma unroll 1
            for (int c = 0; c < 4; c++) {
                const int kb = kt * ATTN_BF16_STREAM + 16 * c;  // the chunk's first key
                if (kb > wrow + 15) break;  // this and later chunks lie past every row of the warp
                float s[2][4], dp[2][4];
                zero(s);
                zero(dp);
#pragma unroll
                for (int kc = 0; kc < 4; kc++) {
                    unsigned b[4];
                    ldsm(b, chunks_first(Ks, 16 * c, kc, lane));
                    mma_bf16(s[0], qf[kc], b[0], b[1]);
                    mma_bf16(s[1], qf[kc], b[2], b[3]);
                    ldsm(b, chunks_first(Vs, 16 * c, kc, lane));
                    mma_bf16(dp[0], yf[kc], b[0], b[1]);
                    mma_bf16(dp[1], yf[kc], b[2], b[3]);
                }
#pragma unroll
                for (int n = 0; n < 2; n++)
#pragma unroll
                    for (int r = 0; r < 4; r++) {
                        const int key = kb + 8 * n + 2 * t + (r & 1), i = r >> 1;
                        const float p = exp2_approx(key > row0 + 8 * i ? NEG_INF : fmaf(s[n][r], s2, -lse2[i]));
                        dp[n][r] = p * (dp[n][r] - dsum[i]);
                    }
                unsigned a[4];  // dS, rounded to bf16
                pack_a(a, dp[0], dp[1]);
#pragma unroll
                for (int np = 0; np < 4; np++) {
                    unsigned b[4];
                    ldsm_trans(b, rows_first(Ks, 16 * c, np, lane));
                    mma_bf16(dq[2 * np], a, b[0], b[1]);
                    mma_bf16(dq[2 * np + 1], a, b[2], b[3]);
                }
            }
        }
        __syncthreads();
    }
    const float sc[2] = {scale, scale};
    const Head hs = head_of(block_x(), B, T, C, H);  // offsets recomputed, as in the forward
    store_rows<true>(dqkv + hs.seq, dq, sc, row0, T, C, t);
}

// ---- backward, second kernel: dK and dV, one block per (b, h) and 64-key tile, query tiles of 64 ------------------
// Runs after k_attn_bwd_dq_bf16, whose D it reads.
extern "C" __global__ void __launch_bounds__(ATTN_BF16_KV_THREADS, ATTN_BF16_KV_BLOCKS)
k_attn_bwd_bf16(bf16* dqkv, const float* delta, const bf16* dout, const bf16* qkv, const float* lse,
                int B, int T, int C, int H, float scale) {
    __shared__ __align__(128) bf16 smem[ATTN_BF16_BWD_SMEM / 2];
    // buffer s: Q at QY + 2 s TILE, dY after it; its lse (64 floats) then D (64 floats) at ST + s STAT
    const unsigned QY = smem_u32(smem), ST = QY + 4 * ATTN_BF16_TILE_BYTES;
    const unsigned Ks = QY, Vs = QY + ATTN_BF16_TILE_BYTES;  // the K and V tiles, before the first Q and dY
    const int k0 = blockIdx.y * ATTN_BF16_KV_ROWS;  // the longest columns first
    const Head hh = head_of(blockIdx.x, B, T, C, H);
    const bf16* q = qkv + hh.seq;
    const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE, g = lane / 4, t = lane % 4;
    const int wkey = k0 + 16 * warp;  // the warp's first key
    const int key0 = wkey + g;        // this thread's keys: key0 and key0 + 8
    const int qt0 = k0 / ATTN_BF16_STREAM, n_qt = (T + ATTN_BF16_STREAM - 1) / ATTN_BF16_STREAM;
    const float s2 = scale * LOG2E;

    const bf16* q_src = slice_of(q, C);
    const bf16* y_src = slice_of(dout + hh.seq, C);
    load_tile<ATTN_BF16_KV_ROWS, ATTN_BF16_KV_THREADS>(Ks, q_src + hh.plane, qkv, k0, T, C);
    load_tile<ATTN_BF16_KV_ROWS, ATTN_BF16_KV_THREADS>(Vs, q_src + 2 * hh.plane, qkv, k0, T, C);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
    unsigned kf[4][4], vf[4][4];  // the warp's 16 keys of K and V as A fragments
#pragma unroll
    for (int kc = 0; kc < 4; kc++) {
        ldsm(kf[kc], rows_first(Ks, 16 * warp, kc, lane));
        ldsm(vf[kc], rows_first(Vs, 16 * warp, kc, lane));
    }
    __syncthreads();  // K and V are in registers; their space becomes the Q and dY buffers

    // Starts loading query tile qt (Q, dY, lse, D) into buffer s; lse and D past T read as zero, harmless since
    // those queries' Q and dY rows are zero too (so are their dS and their share of dV).
    auto load_queries = [&](int qt, int s) {
        const unsigned buf = QY + s * 2 * ATTN_BF16_TILE_BYTES;
        const int row0 = qt * ATTN_BF16_STREAM;
        load_tile<ATTN_BF16_STREAM, ATTN_BF16_KV_THREADS>(buf, q_src, qkv, row0, T, C);
        load_tile<ATTN_BF16_STREAM, ATTN_BF16_KV_THREADS>(buf + ATTN_BF16_TILE_BYTES, y_src, dout, row0, T, C);
        {  // lse by threads 0-63, D by threads 64-127
            const int i = threadIdx.x % ATTN_BF16_STREAM, row = row0 + i;
            const bool inside = row < T;
            const float* src = (threadIdx.x < ATTN_BF16_STREAM ? lse : delta) + hh.stat + (inside ? row : 0);
            cp_async4(ST + s * ATTN_BF16_STAT_BYTES + (threadIdx.x / ATTN_BF16_STREAM) * (ATTN_BF16_STREAM * 4) + i * 4,
                      src, inside);
        }
    };
    load_queries(qt0, 0);
    cp_async_commit();

    float dk[8][4], dv[8][4];
    zero(dk);
    zero(dv);
    for (int qt = qt0; qt < n_qt; qt++) {
        const int s = (qt - qt0) & 1;
        if (qt + 1 < n_qt) load_queries(qt + 1, s ^ 1);
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();
        const unsigned Qs = QY + s * 2 * ATTN_BF16_TILE_BYTES, dYs = Qs + ATTN_BF16_TILE_BYTES;
        const unsigned Ls = ST + s * ATTN_BF16_STAT_BYTES, Ds = Ls + ATTN_BF16_STREAM * 4;
        if (wkey < T) {
            // 16 queries at a time: S^T and dP^T of the warp's 16 keys x 16 queries, then P^T and dS^T, then
            // dV += P^T dY and dK += dS^T Q.
#pragma unroll
            for (int c = 0; c < 4; c++) {
                const int qb = qt * ATTN_BF16_STREAM + 16 * c;  // the chunk's first query
                if (qb + 15 < wkey || qb >= T) continue;  // every query before every key of the warp, or past T
                float s_[2][4], dp[2][4];
                zero(s_);
                zero(dp);
#pragma unroll
                for (int kc = 0; kc < 4; kc++) {
                    unsigned b[4];
                    ldsm(b, chunks_first(Qs, 16 * c, kc, lane));
                    mma_bf16(s_[0], kf[kc], b[0], b[1]);
                    mma_bf16(s_[1], kf[kc], b[2], b[3]);
                    ldsm(b, chunks_first(dYs, 16 * c, kc, lane));
                    mma_bf16(dp[0], vf[kc], b[0], b[1]);
                    mma_bf16(dp[1], vf[kc], b[2], b[3]);
                }
#pragma unroll
                for (int n = 0; n < 2; n++) {
                    const int col = 16 * c + 8 * n + 2 * t;  // the query of fragments 0 and 2, within the tile
                    const float2 ls = lds_f2(Ls + col * 4), ds = lds_f2(Ds + col * 4);
#pragma unroll
                    for (int r = 0; r < 4; r++) {
                        const int query = qt * ATTN_BF16_STREAM + col + (r & 1), key = key0 + 8 * (r >> 1);
                        const float l2 = (r & 1 ? ls.y : ls.x) * LOG2E, d = r & 1 ? ds.y : ds.x;
                        const float p = exp2_approx(query < key ? NEG_INF : fmaf(s_[n][r], s2, -l2));
                        s_[n][r] = p;
                        dp[n][r] = p * (dp[n][r] - d);
                    }
                }
                unsigned pa[4], da[4];  // P^T and dS^T, rounded to bf16
                pack_a(pa, s_[0], s_[1]);
                pack_a(da, dp[0], dp[1]);
#pragma unroll
                for (int np = 0; np < 4; np++) {
                    unsigned b[4];
                    ldsm_trans(b, rows_first(dYs, 16 * c, np, lane));
                    mma_bf16(dv[2 * np], pa, b[0], b[1]);
                    mma_bf16(dv[2 * np + 1], pa, b[2], b[3]);
                    ldsm_trans(b, rows_first(Qs, 16 * c, np, lane));
                    mma_bf16(dk[2 * np], da, b[0], b[1]);
                    mma_bf16(dk[2 * np + 1], da, b[2], b[3]);
                }
            }
        }
        __syncthreads();
    }
    const float one[2] = {1.0f, 1.0f}, sc[2] = {scale, scale};
    const Head hs = head_of(block_x(), B, T, C, H);  // offsets recomputed, as in the forward
    store_rows<true>(dqkv + hs.plane + hs.seq, dk, sc, key0, T, C, t);
    store_rows<true>(dqkv + 2 * hs.plane + hs.seq, dv, one, key0, T, C, t);
}
