// attn: causal scaled dot-product attention, per batch row b and head h (head width hd = C / H, at most 64):
//   forward:  S = Q K^T / sqrt(hd),  P = softmax(S) over keys j <= i,  Y = P V;  saves lse_i = log sum_j exp(S_ij)
//   backward: P = exp(S - lse),  dP = dY V^T,  D_i = rowsum(dY * Y) (= rowsum(P * dP)),  dS = P * (dP - D) / sqrt(hd),
//             dQ += dS K,  dK += dS^T Q,  dV += P^T dY   (= instead of += when the kernels' `add` is 0)
// Fused (flash-style): 64 x 64 tiles of S live in registers only, tiles above the diagonal are skipped,
// and the backward recomputes P from the saved lse. Products run on the tensor cores (mma m16n8k8):
// TF32 inputs with FP32 accumulation, or, for the fp32 engine, "3xTF32" (each operand split into a
// TF32 high part and a TF32 remainder, three products), which keeps FP32-level accuracy.
//
// The backward is two kernels, neither with atomics: k_attn_bwd_dq, one block per query tile, writes D
// and loops over key tiles to add dQ; then k_attn_bwd, one block per key tile, loops over query tiles
// to add dK and dV.
// qkv is [3, B, T, C] (Q, K, V planes); dqkv's rows are dld elements apart and its planes dplane: dld C, dplane
// B T C for [3, B, T, C], or dld 3 C, dplane C for the rows [B, T, 3, C] (as in attn_bf16.cu).
#include "common.cuh"

#define ATTN_THREADS 128  // 4 warps; warp w owns rows 16w .. 16w + 15 of the block's 64-row tile
// Blocks per SM the register budget is set for: the forward's 3 tiles (52 KB of shared memory) fit 4
// times, the backward's 4 tiles (70 KB) 3 times.
#define ATTN_FWD_BLOCKS 4
#define ATTN_BWD_BLOCKS 3
#define ATTN_TILE 64      // rows of a query or key tile, and the widest head a tile holds
#define ATTN_LD 68        // shared-memory row stride in floats: 68 = 4 (mod 32) keeps both fragment reads conflict-free
#define ATTN_TILE_FLOATS (ATTN_TILE * ATTN_LD)
#define LOG2E 1.4426950408889634f
#define LN2 0.6931471805599453f
#define POS_INF __int_as_float(0x7f800000)

// Starts copying rows [row0, row0 + 64) of one head's [T, hd] slice (row stride C) into a 64 x ATTN_LD
// tile; rows at or past T and columns at or past hd read as zero. Asynchronous (cp.async, 16 bytes a
// copy), so all of a tile's loads are in flight at once; tiles_arrived() waits for them.
__device__ __forceinline__ void load_tile(float* tile, const float* __restrict__ src, int row0, int T, int C, int hd) {
    // Each thread copies one 16-byte column group of every 8th row: a fixed trip count, so the loop unrolls.
    constexpr int GROUPS = ATTN_TILE / 4, ROWS_PER_PASS = ATTN_THREADS / GROUPS;
    const int c = (threadIdx.x % GROUPS) * 4;
#pragma unroll
    for (int k = 0; k < ATTN_TILE / ROWS_PER_PASS; k++) {
        const int r = threadIdx.x / GROUPS + k * ROWS_PER_PASS;
        const bool inside = row0 + r < T && c < hd;
        const float* from = inside ? src + (long long)(row0 + r) * C + c : src;  // a valid address either way
        const unsigned to = static_cast<unsigned>(__cvta_generic_to_shared(tile + r * ATTN_LD + c));
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(to), "l"(from), "r"(inside ? 16 : 0) : "memory");
    }
}

// Four consecutive activations as floats (16-byte aligned for float, 8-byte for lowp).
__device__ __forceinline__ float4 load4(const float* p) { return *reinterpret_cast<const float4*>(p); }
__device__ __forceinline__ float4 load4(const lowp* p) {
    const uint2 u = *reinterpret_cast<const uint2*>(p);
    float4 v;
    unpack_lowp2(u.x, v.x, v.y);
    unpack_lowp2(u.y, v.z, v.w);
    return v;
}

// The same tile from 16-bit activations, widened to float as it lands (plain loads: the 16-bit builds at a head
// width other than 64, which attn_bf16.cu does not take).
__device__ __forceinline__ void load_tile(float* tile, const lowp* __restrict__ src, int row0, int T, int C, int hd) {
    constexpr int GROUPS = ATTN_TILE / 4, ROWS_PER_PASS = ATTN_THREADS / GROUPS;
    const int c = (threadIdx.x % GROUPS) * 4;
#pragma unroll
    for (int k = 0; k < ATTN_TILE / ROWS_PER_PASS; k++) {
        const int r = threadIdx.x / GROUPS + k * ROWS_PER_PASS;
        const bool inside = row0 + r < T && c < hd;
        *reinterpret_cast<float4*>(tile + r * ATTN_LD + c) =
            inside ? load4(src + (long long)(row0 + r) * C + c) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
}

// This thread's tile copies have landed; a __syncthreads() after it makes everyone's visible.
__device__ __forceinline__ void tiles_arrived() { asm volatile("cp.async.wait_all;" ::: "memory"); }

// Splits x into TF32 operands with integer arithmetic: cvt.rna.tf32.f32 costs four instructions on sm_90 (a
// finiteness test and a select around an add and a mask), and the splits run for every fragment of every mma.
// Adding half a TF32 ulp rounds to nearest (ties away, as cvt.rna); the mma reads only the top 19 bits of an
// operand, so only the high part that the remainder is taken from needs its low bits cleared. The remainder
// x - hi is exact and at most 2^-11 |x|, so however its low bits are read, the split stays within 2^-22 |x|;
// unsplit (tf32), the one add is the rounding.
template <bool SPLIT, int N>
__device__ __forceinline__ void split_tf32(const float (&x)[N], unsigned (&hi)[N], unsigned (&lo)[N]) {
#pragma unroll
    for (int i = 0; i < N; i++) {
        const unsigned r = __float_as_uint(x[i]) + 0x1000u;
        if (SPLIT) {
            hi[i] = r & 0xffffe000u;
            lo[i] = __float_as_uint(x[i] - __uint_as_float(hi[i]));
        } else {
            hi[i] = r;
        }
    }
}

__device__ __forceinline__ void mma_tf32(float (&c)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
    asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// c[16 x 8] += a[16 x 8] b[8 x 8]; small terms first (lo*lo is below FP32 rounding and left out).
template <bool SPLIT>
__device__ __forceinline__ void mma(float (&c)[4], const unsigned (&ah)[4], const unsigned (&al)[4],
                                    const unsigned (&bh)[2], const unsigned (&bl)[2]) {
    if (SPLIT) {
        mma_tf32(c, al, bh);
        mma_tf32(c, ah, bl);
    }
    mma_tf32(c, ah, bh);
}

// A warp's 16 x 64 accumulator: acc[n][r] is row g + 8 (r / 2), column 8 n + 2 t + r % 2, where
// g = lane / 4 and t = lane % 4 (the mma's C fragment).
typedef float Acc[8][4];

// acc += A B^T, A the warp's 16 rows of a row-major tile, B a row-major 64 x 64 tile.
template <bool SPLIT>
__device__ __forceinline__ void mma_abt(Acc& acc, const float* A, const float* B, int g, int t) {
#pragma unroll
    for (int kc = 0; kc < ATTN_TILE / 8; kc++) {
        const float* a_row = A + g * ATTN_LD + kc * 8 + t;
        const float a[4] = {a_row[0], a_row[8 * ATTN_LD], a_row[4], a_row[8 * ATTN_LD + 4]};
        unsigned ah[4], al[4];
        split_tf32<SPLIT>(a, ah, al);
#pragma unroll
        for (int n = 0; n < 8; n++) {
            const float* b_row = B + (n * 8 + g) * ATTN_LD + kc * 8 + t;
            const float b[2] = {b_row[0], b_row[4]};
            unsigned bh[2], bl[2];
            split_tf32<SPLIT>(b, bh, bl);
            mma<SPLIT>(acc[n], ah, al, bh, bl);
        }
    }
}

// acc += P B, P a warp's 16 x 64 accumulator in registers, B a row-major 64 x 64 tile. An accumulator serves
// as the A fragment when each step's eight summation indices are taken in the order 2t, 2t + 1 (k-slots t
// and t + 4); B's rows are read in the same order.
template <bool SPLIT>
__device__ __forceinline__ void mma_pb(Acc& acc, const Acc& P, const float* B, int g, int t) {
#pragma unroll
    for (int kc = 0; kc < ATTN_TILE / 8; kc++) {
        const float a[4] = {P[kc][0], P[kc][2], P[kc][1], P[kc][3]};
        unsigned ah[4], al[4];
        split_tf32<SPLIT>(a, ah, al);
        const float* b_row = B + (kc * 8 + 2 * t) * ATTN_LD + g;
#pragma unroll
        for (int n = 0; n < ATTN_TILE / 8; n++) {
            const float b[2] = {b_row[n * 8], b_row[ATTN_LD + n * 8]};
            unsigned bh[2], bl[2];
            split_tf32<SPLIT>(b, bh, bl);
            mma<SPLIT>(acc[n], ah, al, bh, bl);
        }
    }
}

__device__ __forceinline__ void zero(Acc& acc) {
#pragma unroll
    for (int n = 0; n < 8; n++)
#pragma unroll
        for (int r = 0; r < 4; r++) acc[n][r] = 0.0f;
}

// Two consecutive activations (+)= (x, y).
template <bool ADD>
__device__ __forceinline__ void store2(float* p, float x, float y) {
    float2* q = reinterpret_cast<float2*>(p);
    if (ADD) {
        const float2 old = *q;
        x += old.x;
        y += old.y;
    }
    *q = make_float2(x, y);
}
template <bool ADD>
__device__ __forceinline__ void store2(lowp* p, float x, float y) {
    unsigned* q = reinterpret_cast<unsigned*>(p);
    if (ADD) {
        float ox, oy;
        unpack_lowp2(*q, ox, oy);
        x += ox;
        y += oy;
    }
    *q = pack_lowp2(x, y);
}

// dst[row, 8n + 2t .. +1] (+)= scale * acc for the warp's rows below T and columns below hd.
template <bool ADD>
__device__ __forceinline__ void store_rows(act_t* __restrict__ dst, const Acc& acc, const float (&scale)[2],
                                           int row0, int T, int C, int hd, int t) {
#pragma unroll
    for (int half = 0; half < 2; half++) {
        const int row = row0 + 8 * half;
        if (row >= T) continue;
        act_t* d = dst + (long long)row * C;
#pragma unroll
        for (int n = 0; n < 8; n++) {
            const int col = n * 8 + 2 * t;
            if (col >= hd) continue;
            store2<ADD>(d + col, acc[n][2 * half] * scale[half], acc[n][2 * half + 1] * scale[half]);
        }
    }
}

// The backward's gradients: added into dqkv, or (add = 0) written over whatever it held, unzeroed.
__device__ __forceinline__ void store_grad_rows(act_t* __restrict__ dst, const Acc& acc, const float (&scale)[2],
                                                int row0, int T, int C, int hd, int t, int add) {
    if (add) store_rows<true>(dst, acc, scale, row0, T, C, hd, t);
    else store_rows<false>(dst, acc, scale, row0, T, C, hd, t);
}

struct Head {  // one (b, h): the head's column offset into the [B, T, C] activations and its lse row
    long long seq;  // offset of element [b, 0, h * hd] in a [B, T, C] tensor
    long long stat;  // offset of row [b, h, 0] in a [B, H, T] tensor
    long long plane;  // B * T * C: Q, K, V (and dQ, dK, dV) are consecutive planes of qkv
};

__device__ __forceinline__ Head head_of(int bh, int B, int T, int C, int H) {
    const int b = bh / H, h = bh % H;
    return {(long long)b * T * C + (long long)h * (C / H), (long long)bh * T, (long long)B * T * C};
}

// The same (b, h) in dqkv, whose rows are dld and planes dplane elements apart.
__device__ __forceinline__ Head grad_head_of(int bh, int T, int C, int H, int dld, int dplane) {
    const int b = bh / H, h = bh % H;
    return {(long long)b * T * dld + (long long)h * (C / H), (long long)bh * T, (long long)dplane};
}

// ---- forward: one block per (b, h) and 64-query tile ---------------------------------------------------
template <bool SPLIT>
__device__ __forceinline__ void attn_fwd(act_t* out, float* lse, const act_t* qkv, int B, int T, int C, int H,
                                         float scale, float* smem) {
    float* Qs = smem;
    float* Ks = Qs + ATTN_TILE_FLOATS;
    float* Vs = Ks + ATTN_TILE_FLOATS;
    const int hd = C / H, n_tiles = (T + ATTN_TILE - 1) / ATTN_TILE;
    const int qt = n_tiles - 1 - blockIdx.y;  // the longest rows first
    const Head hh = head_of(blockIdx.x, B, T, C, H);
    const act_t* q = qkv + hh.seq;
    const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE, g = lane / 4, t = lane % 4;
    const int row0 = qt * ATTN_TILE + warp * 16 + g;  // this thread's rows: row0 and row0 + 8
    const float s2 = scale * LOG2E;  // softmax in base 2: exp(x) = exp2(x log2 e)

    load_tile(Qs, q, qt * ATTN_TILE, T, C, hd);
    Acc o, s;
    zero(o);
    float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.0f, 0.0f};  // running max (base 2) and this lane's share of the sum
    for (int kt = 0; kt <= qt; kt++) {
        __syncthreads();  // every warp is done with the previous K and V
        load_tile(Ks, q + hh.plane, kt * ATTN_TILE, T, C, hd);
        load_tile(Vs, q + 2 * hh.plane, kt * ATTN_TILE, T, C, hd);
        tiles_arrived();
        __syncthreads();
        zero(s);
        mma_abt<SPLIT>(s, Qs + warp * 16 * ATTN_LD, Ks, g, t);
        float mx[2] = {m[0], m[1]};
#pragma unroll
        for (int n = 0; n < 8; n++)
#pragma unroll
            for (int r = 0; r < 4; r++) {
                const int col = kt * ATTN_TILE + n * 8 + 2 * t + (r & 1);
                const float x = col > row0 + 8 * (r >> 1) ? NEG_INF : s[n][r] * s2;
                s[n][r] = x;
                mx[r >> 1] = fmaxf(mx[r >> 1], x);
            }
        float corr[2];
#pragma unroll
        for (int i = 0; i < 2; i++) {
            mx[i] = row_max4(mx[i]);  // finite: every row sees key kt * 64 <= its own position
            corr[i] = exp2f(m[i] - mx[i]);
            m[i] = mx[i];
            l[i] *= corr[i];
        }
#pragma unroll
        for (int n = 0; n < 8; n++)
#pragma unroll
            for (int r = 0; r < 4; r++) {
                const float p = exp2f(s[n][r] - m[r >> 1]);
                s[n][r] = p;
                l[r >> 1] += p;
                o[n][r] *= corr[r >> 1];
            }
        mma_pb<SPLIT>(o, s, Vs, g, t);
    }
    float inv[2];
#pragma unroll
    for (int i = 0; i < 2; i++) {
        l[i] = row_sum4(l[i]);
        inv[i] = 1.0f / l[i];
        const int row = row0 + 8 * i;
        if (t == 0 && row < T) lse[hh.stat + row] = (m[i] + log2f(l[i])) * LN2;
    }
    store_rows<false>(out + hh.seq, o, inv, row0, T, C, hd, t);
}

extern "C" __global__ void __launch_bounds__(ATTN_THREADS, ATTN_FWD_BLOCKS)
k_attn_fwd(act_t* out, float* lse, const act_t* qkv, int B, int T, int C, int H, float scale, int split) {
    extern __shared__ float4 smem_fwd[];
    if (split) attn_fwd<true>(out, lse, qkv, B, T, C, H, scale, reinterpret_cast<float*>(smem_fwd));
    else attn_fwd<false>(out, lse, qkv, B, T, C, H, scale, reinterpret_cast<float*>(smem_fwd));
}

// ---- backward, first kernel: D and dQ, one block per (b, h) and 64-query tile -----------------------------------
template <bool SPLIT>
__device__ __forceinline__ void attn_bwd_q(act_t* dqkv, float* delta, const act_t* dout, const act_t* y, const act_t* qkv,
                                           const float* lse, int B, int T, int C, int H, float scale, float* smem,
                                           int add, int dld, int dplane) {
    float* Qs = smem;
    float* dYs = Qs + ATTN_TILE_FLOATS;
    float* Ks = dYs + ATTN_TILE_FLOATS;
    float* Vs = Ks + ATTN_TILE_FLOATS;
    const int hd = C / H, n_tiles = (T + ATTN_TILE - 1) / ATTN_TILE;
    const int qt = n_tiles - 1 - blockIdx.y;
    const Head hh = head_of(blockIdx.x, B, T, C, H);
    const act_t* q = qkv + hh.seq;
    const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE, g = lane / 4, t = lane % 4;
    const int row0 = qt * ATTN_TILE + warp * 16 + g;
    const float s2 = scale * LOG2E;

    load_tile(Qs, q, qt * ATTN_TILE, T, C, hd);
    load_tile(dYs, dout + hh.seq, qt * ATTN_TILE, T, C, hd);
    tiles_arrived();
    __syncthreads();
    // D of the thread's two rows (rows past T: 0, their P is 0): lane t takes columns 4t + 16k .. + 3.
    float lse2[2], d[2];  // lse in base 2 (rows past T: +inf, so P = 0)
#pragma unroll
    for (int i = 0; i < 2; i++) {
        const int row = row0 + 8 * i;
        float acc = 0.0f;
        if (row < T) {
            const float* dy_row = dYs + (warp * 16 + g + 8 * i) * ATTN_LD;
            const act_t* y_row = y + hh.seq + (long long)row * C;
#pragma unroll
            for (int c = 4 * t; c < ATTN_TILE; c += 16) {
                if (c >= hd) break;
                const float4 a = *reinterpret_cast<const float4*>(dy_row + c);
                const float4 b = load4(y_row + c);
                acc += a.x * b.x + a.y * b.y + a.z * b.z + a.w * b.w;
            }
        }
        d[i] = row_sum4(acc);
        if (t == 0 && row < T) delta[hh.stat + row] = d[i];
        lse2[i] = row < T ? lse[hh.stat + row] * LOG2E : POS_INF;
    }
    Acc dq, p, ds;  // p: the current tile's P; ds: its dP, then dS
    zero(dq);
    for (int kt = 0; kt <= qt; kt++) {
        __syncthreads();
        load_tile(Ks, q + hh.plane, kt * ATTN_TILE, T, C, hd);
        load_tile(Vs, q + 2 * hh.plane, kt * ATTN_TILE, T, C, hd);
        tiles_arrived();
        __syncthreads();
        zero(p);
        mma_abt<SPLIT>(p, Qs + warp * 16 * ATTN_LD, Ks, g, t);
        zero(ds);
        mma_abt<SPLIT>(ds, dYs + warp * 16 * ATTN_LD, Vs, g, t);
#pragma unroll
        for (int n = 0; n < 8; n++)
#pragma unroll
            for (int r = 0; r < 4; r++) {
                const int col = kt * ATTN_TILE + n * 8 + 2 * t + (r & 1);
                const float pr = col > row0 + 8 * (r >> 1) ? 0.0f : exp2f(p[n][r] * s2 - lse2[r >> 1]);
                ds[n][r] = pr * (ds[n][r] - d[r >> 1]);
            }
        mma_pb<SPLIT>(dq, ds, Ks, g, t);
    }
    const float sc[2] = {scale, scale};
    const Head gh = grad_head_of(blockIdx.x, T, C, H, dld, dplane);
    store_grad_rows(dqkv + gh.seq, dq, sc, row0, T, dld, hd, t, add);
}

// ---- backward, second kernel: dK and dV, one block per (b, h) and 64-key tile -----------------------------------
template <bool SPLIT>
__device__ __forceinline__ void attn_bwd_kv(act_t* dqkv, const float* delta, const act_t* dout, const act_t* qkv,
                                            const float* lse, int B, int T, int C, int H, float scale, float* smem,
                                            int add, int dld, int dplane) {
    float* Ks = smem;
    float* Vs = Ks + ATTN_TILE_FLOATS;
    float* Qs = Vs + ATTN_TILE_FLOATS;
    float* dYs = Qs + ATTN_TILE_FLOATS;
    float* lse_s = dYs + ATTN_TILE_FLOATS;  // the query tile's lse (base 2) and D
    float* delta_s = lse_s + ATTN_TILE;
    const int hd = C / H, n_tiles = (T + ATTN_TILE - 1) / ATTN_TILE;
    const int kt = blockIdx.y;  // the longest columns first
    const Head hh = head_of(blockIdx.x, B, T, C, H);
    const act_t* q = qkv + hh.seq;
    const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE, g = lane / 4, t = lane % 4;
    const int key0 = kt * ATTN_TILE + warp * 16 + g;  // this thread's keys: key0 and key0 + 8
    const float s2 = scale * LOG2E;

    load_tile(Ks, q + hh.plane, kt * ATTN_TILE, T, C, hd);
    load_tile(Vs, q + 2 * hh.plane, kt * ATTN_TILE, T, C, hd);
    Acc dk, dv, p, ds;  // p: P^T for the warp's 16 keys x the tile's 64 queries; ds: dP^T, then dS^T
    zero(dk);
    zero(dv);
    for (int qt = kt; qt < n_tiles; qt++) {
        __syncthreads();
        load_tile(Qs, q, qt * ATTN_TILE, T, C, hd);
        load_tile(dYs, dout + hh.seq, qt * ATTN_TILE, T, C, hd);
        if (threadIdx.x < ATTN_TILE) {
            const int row = qt * ATTN_TILE + threadIdx.x;
            lse_s[threadIdx.x] = row < T ? lse[hh.stat + row] * LOG2E : POS_INF;
            delta_s[threadIdx.x] = row < T ? delta[hh.stat + row] : 0.0f;
        }
        tiles_arrived();
        __syncthreads();
        zero(p);
        mma_abt<SPLIT>(p, Ks + warp * 16 * ATTN_LD, Qs, g, t);
#pragma unroll
        for (int n = 0; n < 8; n++)
#pragma unroll
            for (int r = 0; r < 4; r++) {
                const int col = n * 8 + 2 * t + (r & 1);  // the query, within the tile
                p[n][r] = qt * ATTN_TILE + col < key0 + 8 * (r >> 1) ? 0.0f : exp2f(p[n][r] * s2 - lse_s[col]);
            }
        mma_pb<SPLIT>(dv, p, dYs, g, t);
        zero(ds);
        mma_abt<SPLIT>(ds, Vs + warp * 16 * ATTN_LD, dYs, g, t);
#pragma unroll
        for (int n = 0; n < 8; n++)
#pragma unroll
            for (int r = 0; r < 4; r++) ds[n][r] = p[n][r] * (ds[n][r] - delta_s[n * 8 + 2 * t + (r & 1)]);
        mma_pb<SPLIT>(dk, ds, Qs, g, t);
    }
    const float one[2] = {1.0f, 1.0f}, sc[2] = {scale, scale};
    const Head gh = grad_head_of(blockIdx.x, T, C, H, dld, dplane);
    store_grad_rows(dqkv + gh.plane + gh.seq, dk, sc, key0, T, dld, hd, t, add);
    store_grad_rows(dqkv + 2 * gh.plane + gh.seq, dv, one, key0, T, dld, hd, t, add);
}

extern "C" __global__ void __launch_bounds__(ATTN_THREADS, ATTN_BWD_BLOCKS)
k_attn_bwd_dq(act_t* dqkv, float* delta, const act_t* dout, const act_t* y, const act_t* qkv, const float* lse,
              int B, int T, int C, int H, float scale, int split, int add, int dld, int dplane) {
    extern __shared__ float4 smem_dq[];
    float* smem = reinterpret_cast<float*>(smem_dq);
    if (split) attn_bwd_q<true>(dqkv, delta, dout, y, qkv, lse, B, T, C, H, scale, smem, add, dld, dplane);
    else attn_bwd_q<false>(dqkv, delta, dout, y, qkv, lse, B, T, C, H, scale, smem, add, dld, dplane);
}

// Runs after k_attn_bwd_dq, whose delta it reads.
extern "C" __global__ void __launch_bounds__(ATTN_THREADS, ATTN_BWD_BLOCKS)
k_attn_bwd(act_t* dqkv, const float* delta, const act_t* dout, const act_t* qkv, const float* lse,
           int B, int T, int C, int H, float scale, int split, int add, int dld, int dplane) {
    extern __shared__ float4 smem_dkv[];
    float* smem = reinterpret_cast<float*>(smem_dkv);
    if (split) attn_bwd_kv<true>(dqkv, delta, dout, qkv, lse, B, T, C, H, scale, smem, add, dld, dplane);
    else attn_bwd_kv<false>(dqkv, delta, dout, qkv, lse, B, T, C, H, scale, smem, add, dld, dplane);
}
