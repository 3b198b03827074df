// attn_bf16: causal scaled dot-product attention for bf16 activations and head width 64, per batch row b and head h:
//   forward:  S = Q K^T * scale,  P = softmax(S) over keys j <= i,  Y = P V;  saves lse_i = ln sum_j exp(S_ij) (fp32)
//   backward: P = exp(S - lse),  dP = dY V^T,  D_i = rowsum(dY * Y) (= rowsum(P * dP)),  dS = P * (dP - D) * scale,
//             dQ += dS K,  dK += dS^T Q,  dV += P^T dY
// The same algorithm, interface conventions and lse / D as kernels/attn.cu, on the bf16 tensor cores: every product
// is mma m16n8k16 with bf16 operands and fp32 accumulation. Softmax, lse, D and the accumulators are fp32; P and dS
// are rounded to bf16 only as operands of the next product, and each result is rounded to bf16 once, when stored
// (the backward adds into dqkv: old bf16 value + fp32 result, one rounding; or, with add = 0, writes over it).
// The fp16 build (ACT_FP16) is the same kernels on IEEE half operands (the f16 mma): its activations are fp16.
//
// Layouts (row-major): qkv is [3, B, T, C] (Q, K, V planes), out (Y) and dout (dY) [B, T, C], head h the columns
// [64 h, 64 h + 64) of C (so C = 64 H); lse and D are fp32 [B, H, T]. dqkv's rows are dld elements apart and its dQ,
// dK, dV planes dplane apart: dld C, dplane B T C for [3, B, T, C]; dld 3 C, dplane C for the rows [B, T, 3, C] that
// attn_qkv_bwd reads as one [B T, 3 C] matrix. T is any length >= 1: rows past T read
// as zero and are never written. No atomics in the sums: every sum runs in an order fixed by the launch shape, so
// repeated runs give identical bits. With `amax` (precision fp8; else null) each kernel also takes the amax of what it
// stores (Y; dQ, and dK with dV, into one word for dqkv), an order-free max (warp_amax, kernels/common.cuh).
// The backward is two kernels, as in attn.cu: k_attn_bwd_dq_bf16, one block per query tile, writes D and loops over
// key tiles to add dQ; then k_attn_bwd_bf16, one block per key tile, reads D and loops over query tiles to add dK
// and dV.
//
// Launch configuration (the host reads it from the module's int[4] constant attn_bf16_launch = {THREADS, ROWS,
// KV_THREADS, KV_ROWS}, not from a copy of these #defines), in launch order:
//   k_attn_fwd_bf16     block ATTN_BF16_THREADS     grid (B * H, ceil(T / ATTN_BF16_ROWS))
//   k_attn_bwd_dq_bf16  block ATTN_BF16_THREADS     grid (B * H, ceil(T / ATTN_BF16_ROWS))
//   k_attn_bwd_bf16     block ATTN_BF16_KV_THREADS  grid (B * H, ceil(T / ATTN_BF16_KV_ROWS))
// with THREADS 128, ROWS 64: 4 warps of 16 query rows, 4 blocks an SM (128 registers); KV_THREADS 128, KV_ROWS 64:
// 4 warps of 16 keys, 3 blocks an SM (168 registers). Each kernel's last argument, `heads_first`, orders the
// blocks: 0 with the grids above; 1 with each grid's dimensions swapped, a head's tiles together (block_at; the
// host's rule is andrea/ops/attn.py heads_first); the order moves no bit. dev/cuda/ keeps the other launch shapes
// measured against these, with their checker. Shared memory is static only, at most 48 KB a block: ATTN_BF16_FWD_SMEM,
// _DQ_SMEM = 49152 bytes, _BWD_SMEM = 33792 bytes. Launch with 0 dynamic bytes, no attribute to set; the largest
// shared-memory carveout (which the engine asks for) lets 4 blocks of 48 KB share an SM.
//
// Hopper's build (sm_90a, where __CUDA_ARCH_FEAT_SM90_ALL is defined) adds k_attn_fwd_wg, k_attn_bwd_dq_wg and
// k_attn_bwd_kv_wg: the same arguments, launch shape and results (the same bits: their fp32 sums run in the mma
// kernels' order), each block one warpgroup whose products are wgmma with B read by the tensor cores from the
// shared tiles. k_attn_bwd_kv_wg takes ATTN_BF16_WG_KV_SMEM = 50688 bytes of dynamic shared memory (the module's
// int constant attn_wg_kv_smem; the host raises the kernel's dynamic limit to it) for three query buffers.
//
// Each block owns a tile of queries (keys in k_attn_bwd_bf16); warp w owns WT m-tiles of 16 rows (WT =
// ATTN_BF16_WARP_TILES, _KV_WARP_TILES), rows 16 WT w .. 16 WT (w + 1) - 1 of the tile, held in registers as mma A
// operands, while the other operand streams through shared memory in tiles of 64 rows, filled with cp.async: three
// stages in the forward and dQ kernels (the next two tiles in flight), two in k_attn_bwd_bf16; one barrier a tile
// (a stage is refilled right after the barrier that follows the last reads of it). A tile that lies wholly at or
// below the diagonal for a warp takes a path without masks or bounds tests; the warp's one diagonal tile takes a
// masked path that also skips the 16-row blocks wholly past the diagonal. The forward takes 64 keys a softmax step
// and skips the rescaling of its accumulators in steps where no row maximum of the warp moves. The results leave
// through the shared memory the tiles no longer need, a warp's 16 rows at a time as 16-byte pieces (store_staged).
#include "common.cuh"

#define ATTN_BF16_THREADS 128       // k_attn_fwd_bf16, k_attn_bwd_dq_bf16: 4 warps
#define ATTN_BF16_ROWS 64           // their query tile: grid.y = ceil(T / ROWS)
#define ATTN_BF16_WARP_TILES 1      // their 16-row m-tiles a warp: ROWS = 16 WARP_TILES THREADS / 32
#define ATTN_BF16_BLOCKS 4          // their blocks per SM the register budget is set for (128 registers a thread)
#define ATTN_BF16_KV_THREADS 128    // k_attn_bwd_bf16: 4 warps
#define ATTN_BF16_KV_ROWS 64        // its key tile: grid.y = ceil(T / KV_ROWS)
#define ATTN_BF16_KV_WARP_TILES 1   // its 16-key m-tiles a warp
#define ATTN_BF16_KV_BLOCKS 3       // its blocks per SM (168 registers a thread)

#define ATTN_BF16_STREAM 64           // rows of a streamed tile: keys (fwd, bwd_dq) or queries (bwd)
#define ATTN_BF16_HD 64               // head width, the only one these kernels take
#define ATTN_BF16_ROW_BYTES 128       // one row of 64 bf16
#define ATTN_BF16_TILE_BYTES (ATTN_BF16_STREAM * ATTN_BF16_ROW_BYTES)  // 8 KB: a streamed tile
#define ATTN_BF16_STAGE_BYTES (2 * ATTN_BF16_TILE_BYTES)              // 16 KB: K and V, or Q and dY, of one tile
#define ATTN_BF16_STAT_BYTES (2 * ATTN_BF16_STREAM * 4)               // a query tile's lse and D (fp32)
// Static shared memory of each kernel, in bytes:
#define ATTN_BF16_FWD_SMEM (3 * ATTN_BF16_STAGE_BYTES)  // 49152: K and V three times (Q first, over stage 2)
#define ATTN_BF16_DQ_SMEM (3 * ATTN_BF16_STAGE_BYTES)   // 49152: K and V three times (Q, dY first, over stage 2)
#define ATTN_BF16_BWD_SMEM (2 * (ATTN_BF16_STAGE_BYTES + ATTN_BF16_STAT_BYTES))  // 33792: Q, dY, lse, D twice
#define ATTN_BF16_WG_KV_SMEM (3 * (ATTN_BF16_STAGE_BYTES + ATTN_BF16_STAT_BYTES))  // 50688, dynamic: three times
#define LOG2E 1.4426950408889634f
#define LN2 0.6931471805599453f
#define POS_INF __int_as_float(0x7f800000)

static_assert(ATTN_BF16_ROWS == 16 * ATTN_BF16_WARP_TILES * (ATTN_BF16_THREADS / 32), "ROWS: 16-row m-tiles of warps");
static_assert(ATTN_BF16_KV_ROWS == 16 * ATTN_BF16_KV_WARP_TILES * (ATTN_BF16_KV_THREADS / 32), "KV_ROWS likewise");
static_assert(ATTN_BF16_ROWS * ATTN_BF16_ROW_BYTES <= ATTN_BF16_STAGE_BYTES, "Q (and dY) fit one stage each");
static_assert(2 * ATTN_BF16_KV_ROWS * ATTN_BF16_ROW_BYTES <= ATTN_BF16_BWD_SMEM, "K and V fit the bwd buffers");

extern "C" __constant__ int attn_bf16_launch[4] = {ATTN_BF16_THREADS, ATTN_BF16_ROWS, ATTN_BF16_KV_THREADS,
                                                   ATTN_BF16_KV_ROWS};

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

// A lane's ldmatrix.x4 row address, split in a part fixed per lane and a part fixed at compile time. Every band
// starts at a multiple of 8 rows, so the swizzle only sees the lane's row within the band; chunk 2x + e (e = 0, 1
// from the lane) lands at (2x + e) ^ (row % 8) = 2x ^ (e ^ row % 8), i.e. byte offset (16 (e ^ row % 8)) ^ 32x.
// With base = tile + part (the tile 128-byte aligned, so the sum has the part's bits 0-6), the address of band,
// k-step x is (base ^ 32x) + 128 band: the XOR touches bits 5-6 only and the band adds multiples of 128.
__device__ __forceinline__ unsigned rows_first_part(int lane) {  // row lane % 16, chunk e = lane / 16
    return (lane & 15) * ATTN_BF16_ROW_BYTES + ((((lane >> 4) ^ lane) & 7) << 4);
}
__device__ __forceinline__ unsigned chunks_first_part(int lane) {  // row 8 (lane / 16) + lane % 8, e = lane / 8 % 2
    return (((lane >> 4) << 3) + (lane & 7)) * ATTN_BF16_ROW_BYTES + (((((lane >> 3) & 1) ^ lane) & 7) << 4);
}
__device__ __forceinline__ unsigned lds_at(unsigned base, int band, int x) {
    return (base ^ (x << 5)) + band * ATTN_BF16_ROW_BYTES;
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

// c[16 x 8] += a[16 x 16] b[16 x 8]: bf16 operands, or IEEE half ones in the fp16 build (ACT_FP16)
#ifdef ACT_FP16
#define MMA_16BIT "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
#else
#define MMA_16BIT "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
#endif
__device__ __forceinline__ void mma_bf16(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    asm(MMA_16BIT
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// The A fragment of k-step k from a 16-column pair of C fragments (P or dS), rounded to the build's 16 bits.
__device__ __forceinline__ void pack_a(unsigned (&a)[4], const float (&lo)[4], const float (&hi)[4]) {
    a[0] = pack_lowp2(lo[0], lo[1]);
    a[1] = pack_lowp2(lo[2], lo[3]);
    a[2] = pack_lowp2(hi[0], hi[1]);
    a[3] = pack_lowp2(hi[2], hi[3]);
}

// The A fragments of the warp's m-tiles: f[i][kc] of Q / dY / K / V fragments, or f[i] of P / dS ones.
template <int WT>
__device__ __forceinline__ auto k_step(const unsigned (&f)[WT][4][4], int kc) {
    return [&f, kc](int i) -> const unsigned (&)[4] { return f[i][kc]; };
}
template <int WT>
__device__ __forceinline__ auto m_tiles(const unsigned (&f)[WT][4]) {
    return [&f](int i) -> const unsigned (&)[4] { return f[i]; };
}

// One 16 x 16 block of a shared tile as B (ldmatrix, or TRANS: ldmatrix.trans) against each of the warp's WT
// m-tiles a(i): c[i][n] += its first 8 columns, c[i][n + 1] += its last 8.
template <bool TRANS, int WT, int N, typename A>
__device__ __forceinline__ void mma_block(float (&c)[WT][N][4], int n, A a, unsigned tile, int row, int chunk) {
    unsigned b[4];
    if constexpr (TRANS) ldsm_trans(b, lds_at(tile, row, chunk));
    else ldsm(b, lds_at(tile, row, chunk));
#pragma unroll
    for (int i = 0; i < WT; i++) {
        mma_bf16(c[i][n], a(i), b[0], b[1]);
        mma_bf16(c[i][n + 1], a(i), b[2], b[3]);
    }
}

// ---- Hopper's warpgroup products (sm_90a builds only) -----------------------------------------------------------
// wgmma.mma_async m64nNk16: the 4 warps of a warpgroup (a 128-thread block here) multiply 64 rows, warp w rows
// 16w .. 16w+15, with the same register layouts as the mma above: the A fragment of a k-step is a0..a3 of that warp's
// 16 rows (registers: Q, dY, K, V rows, or P and dS packed from the accumulators) and accumulator d[n][r] is C
// fragment r of columns 8n .. 8n+7. B is read by the tensor cores straight from a shared tile in the layout
// tile_offset writes, which is Hopper's 128-byte swizzle: a tile 1024-byte aligned, 8-row groups 1024 bytes apart.
// K-major B (rows = n, the 64 columns = k: K for S = Q K^T, Q for S^T = K Q^T, ...): k-step x starts 32 x bytes
// into the tile; MN-major B (rows = k, columns = n: V for Y += P V, ...), with the transpose bit: k-step x starts
// 16 x rows in. The products are asynchronous: issued after wgmma.fence (registers they read or accumulate into
// were written by ordinary instructions), committed as a group, and waited for before their results are read.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define ATTN_WGMMA 1
#ifdef ACT_FP16
#define WGMMA_TYPES ".f16.f16"
#else
#define WGMMA_TYPES ".bf16.bf16"
#endif

// The matrix descriptor of a swizzled tile at shared address `addr`: start address, leading and stride byte offsets
// (the 8-row group stride, 1024, serves as both; a 64-column tile has one swizzle atom across), 128-byte swizzle.
__device__ __forceinline__ unsigned long long wg_desc(unsigned addr) {
    constexpr unsigned long long GROUP = 1024 >> 4, SWIZZLE_128B = 1ull << 62;
    return SWIZZLE_128B | (GROUP << 32) | (GROUP << 16) | ((addr & 0x3ffff) >> 4);
}
__device__ __forceinline__ unsigned long long k_major(unsigned tile, int x) { return wg_desc(tile + 32 * x); }
__device__ __forceinline__ unsigned long long mn_major(unsigned tile, int row) {
    return wg_desc(tile + row * ATTN_BF16_ROW_BYTES);
}

__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wg_wait() { asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory"); }
// After wg_wait: the accumulators' values are the products' (no read of them may move above the wait).
template <int N>
__device__ __forceinline__ void wg_hold(float (&d)[N][4]) {
#pragma unroll
    for (int n = 0; n < N; n++)
#pragma unroll
        for (int r = 0; r < 4; r++) asm volatile("" : "+f"(d[n][r])::"memory");
}
// Shared memory written by cp.async, read next by the tensor cores: each writing thread orders its writes before
// the barrier that publishes them.
__device__ __forceinline__ void fence_async_smem() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// d[64 x N] (+)= a[64 x 16] b[16 x N] for N = 64 (d[8][4]) or 32 (d[4][4]), a from registers, b a descriptor;
// acc = 0: d = a b.
template <int TRANS_B>
__device__ __forceinline__ void wgmma(float (&d)[8][4], const unsigned (&a)[4], unsigned long long b, int acc) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %38, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32" WGMMA_TYPES
                 " {%0, %1, %2, %3, %4, %5, %6, %7,"
                 "%8, %9, %10, %11, %12, %13, %14, %15,"
                 "%16, %17, %18, %19, %20, %21, %22, %23,"
                 "%24, %25, %26, %27, %28, %29, %30, %31},"
                 " {%32, %33, %34, %35}, %36, p, 1, 1, %37;\n}\n"
                 : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]),
                   "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]),
                   "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]),
                   "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]),
                   "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]),
                   "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]),
                   "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]),
                   "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "n"(TRANS_B), "r"(acc));
}

template <int TRANS_B>
__device__ __forceinline__ void wgmma(float (&d)[4][4], const unsigned (&a)[4], unsigned long long b, int acc) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %22, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n32k16.f32" WGMMA_TYPES
                 " {%0, %1, %2, %3, %4, %5, %6, %7,"
                 "%8, %9, %10, %11, %12, %13, %14, %15},"
                 " {%16, %17, %18, %19}, %20, p, 1, 1, %21;\n}\n"
                 : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]),
                   "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]),
                   "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]),
                   "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "n"(TRANS_B), "r"(acc));
}

// d = a x^T over the head's 64 columns: a the A fragments of 64 rows' 4 k-steps (Q, dY, K or V), x the 8 N rows of
// a K-major tile from `tile` on (K or V for S and dP; Q or dY for S^T and dP^T).
template <int N>
__device__ __forceinline__ void wg_scores(float (&d)[N][4], const unsigned (&a)[4][4], unsigned tile) {
#pragma unroll
    for (int kc = 0; kc < 4; kc++) wgmma<0>(d, a[kc], k_major(tile, kc), kc);
}
#endif

// Before the barrier that publishes a block's cp.async writes: on the warpgroup products (WG), which the tensor
// cores read next, each writing thread orders its writes for them; nothing on the mma.
template <bool WG>
__device__ __forceinline__ void fence_for_tensor_reads() {
#ifdef ATTN_WGMMA
    if constexpr (WG) fence_async_smem();
#endif
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

// base + 64 off: the start of a head's slice.
__device__ __forceinline__ const bf16* at64(const bf16* base, unsigned off) { return base + ((size_t)off << 6); }
__device__ __forceinline__ bf16* at64(bf16* base, unsigned off) { return base + ((size_t)off << 6); }
// The same element of a byte image of the tensor (E5M2 gradients); null stays null.
__device__ __forceinline__ unsigned char* at64(unsigned char* base, unsigned off) {
    return base == nullptr ? nullptr : base + ((size_t)off << 6);
}

// Starts copying rows [row0, row0 + ROWS) of one head's [T, 64] slice at64(base, off) (row stride C) into the
// swizzled tile at shared address `tile`; rows at or past T read as zero (their copies name row T - 1, inside the
// slice, and read nothing). Thread i copies chunk i % 8 of rows i / 8, i / 8 + THREADS / 8, ... Offsets within a
// slice are 32-bit (T C < 2^31; the slice's start is 64-bit).
template <int ROWS, int THREADS>
__device__ __forceinline__ void load_tile(unsigned tile, const bf16* base, unsigned off, int row0, int T, int C) {
    constexpr int ROWS_PER_PASS = THREADS / 8;
    static_assert(ROWS % ROWS_PER_PASS == 0, "whole passes");
    const int r = threadIdx.x / 8, c = threadIdx.x % 8;
    const bf16* src = at64(base, off);
#pragma unroll
    for (int k = 0; k < ROWS / ROWS_PER_PASS; k++) {
        const int row = row0 + r + k * ROWS_PER_PASS;
        cp_async16(tile + tile_offset(r + k * ROWS_PER_PASS, c), src + (min(row, T - 1) * C + 8 * c), row < T);
    }
}

// Starts copying key tile kt of a head (K at k_off, V one plane on) into a stage: K, then V after it.
template <int THREADS>
__device__ __forceinline__ void load_kv_tile(unsigned stage, const bf16* qkv, unsigned k_off, unsigned plane, int kt,
                                             int T, int C) {
    load_tile<ATTN_BF16_STREAM, THREADS>(stage, qkv, k_off, kt * ATTN_BF16_STREAM, T, C);
    load_tile<ATTN_BF16_STREAM, THREADS>(stage + ATTN_BF16_TILE_BYTES, qkv, k_off + plane, kt * ATTN_BF16_STREAM, T, C);
}

// ---- small helpers ---------------------------------------------------------------------------------------------
// 2^x by the hardware approximation (relative error about 2^-22); results below 2^-126 flush to zero (harmless next
// to the row's largest term, 1), and 2^-inf = 0. exp2f() would add a rescaling path for such results.
__device__ __forceinline__ float exp2_approx(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

template <int N>
__device__ __forceinline__ void zero(float (&acc)[N][4]) {
#pragma unroll
    for (int n = 0; n < N; n++)
#pragma unroll
        for (int r = 0; r < 4; r++) acc[n][r] = 0.0f;
}

// The low and high 16-bit value of a pair, as floats (bf16: the bits moved into place).
#ifdef ACT_FP16
__device__ __forceinline__ float lo_f32(unsigned x) { return lowp_to_f32(static_cast<lowp>(x & 0xffffu)); }
__device__ __forceinline__ float hi_f32(unsigned x) { return lowp_to_f32(static_cast<lowp>(x >> 16)); }
#else
__device__ __forceinline__ float lo_f32(unsigned x) { return __uint_as_float(x << 16); }
__device__ __forceinline__ float hi_f32(unsigned x) { return __uint_as_float(x & 0xffff0000u); }
#endif

// dst[row, 8n + 2t .. +1] += scale * acc for the thread's two rows (row0, row0 + 8) below T: the old bf16 value plus
// the fp32 result, rounded once (the backward adding into dqkv, add = 1). `top` takes the max |value| stored (before
// the rounding: warp_amax).
__device__ __forceinline__ void add_rows(bf16* __restrict__ dst, const float (&acc)[8][4], const float (&scale)[2],
                                         int row0, int T, int C, int t, float& top) {
#pragma unroll
    for (int half = 0; half < 2; half++) {
        const int row = row0 + 8 * half;
        if (row >= T) continue;
        unsigned* d = reinterpret_cast<unsigned*>(dst + (long long)row * C + 2 * t);
#pragma unroll
        for (int n = 0; n < 8; n++) {
            float x = acc[n][2 * half] * scale[half], y = acc[n][2 * half + 1] * scale[half];
            const unsigned old = d[4 * n];
            x += lo_f32(old);
            y += hi_f32(old);
            top = fmaxf(top, fmaxf(fabsf(x), fabsf(y)));
            d[4 * n] = pack_lowp2(x, y);
        }
    }
}

// Every copy landed and every warp done with the block's tiles: their shared memory is free for store_staged.
__device__ __forceinline__ void free_tiles() {
    cp_async_wait<0>();
    __syncthreads();
}

// A store of a warp's 16-row tile through shared memory (after free_tiles): a lane's 2-element pieces (scale * acc
// rounded once to bf16; or with E5M2, those bf16 values scaled by s and converted as k_fp8_cast converts them,
// kernels/fp8.cu) into the warp's `stage`, rows LD bytes apart (the 8 rows of one piece on distinct banks); then the
// tile's rows (row0 .. row0 + 15 of dst, ld bytes apart: a head's rows, 16-byte aligned) below T as 16-byte stores,
// lane l taking pieces l, l + 32, ...: a quarter (E5M2: an eighth) of the stores that a piece's own 4-byte (2-byte)
// stores would take, each a whole 16 bytes of a row.
// `top` takes the max |value| of the rows below T.
template <bool E5M2>
struct Staged {
    static constexpr int ROW = E5M2 ? ATTN_BF16_HD : 2 * ATTN_BF16_HD;  // a row's bytes
    static constexpr int LD = ROW + 16;                                  // bank offset 4 (E5M2: 20) words a row
    static constexpr int BYTES = 16 * LD;                                // a warp's tile
};

static_assert(ATTN_BF16_THREADS / 32 * ATTN_BF16_WARP_TILES * Staged<false>::BYTES <= ATTN_BF16_DQ_SMEM &&
                  ATTN_BF16_THREADS / 32 * ATTN_BF16_WARP_TILES * Staged<false>::BYTES <= ATTN_BF16_FWD_SMEM,
              "the forward's and dQ's warps stage their tiles in the block's buffers");
static_assert(ATTN_BF16_KV_THREADS / 32 * 2 * ATTN_BF16_KV_WARP_TILES * Staged<false>::BYTES <= ATTN_BF16_BWD_SMEM,
              "the dK, dV warps stage theirs (two a tile) in the block's buffers");

template <bool E5M2>
__device__ __forceinline__ void store_staged(unsigned char* __restrict__ dst, int ld, unsigned char* stage,
                                             const float (&acc)[8][4], const float (&scale)[2], int row0, int T,
                                             int lane, float s, float& top) {
    using S = Staged<E5M2>;
    const int g = lane / 4, t = lane % 4;
#pragma unroll
    for (int half = 0; half < 2; half++) {
        const int r = g + 8 * half;
#pragma unroll
        for (int n = 0; n < 8; n++) {
            const float x = acc[n][2 * half] * scale[half], y = acc[n][2 * half + 1] * scale[half];
            if (row0 + r < T) top = fmaxf(top, fmaxf(fabsf(x), fabsf(y)));
            if constexpr (E5M2) {
                float lo, hi;
                unpack_lowp2(pack_lowp2(x, y), lo, hi);
                *reinterpret_cast<unsigned short*>(stage + r * S::LD + 8 * n + 2 * t) = fp8x2(lo * s, hi * s, 1);
            } else {
                *reinterpret_cast<unsigned*>(stage + r * S::LD + 16 * n + 4 * t) = pack_lowp2(x, y);
            }
        }
    }
    __syncwarp();
    constexpr int PIECES = S::ROW / 16;  // a row's
#pragma unroll
    for (int c = lane; c < 16 * PIECES; c += WARP_SIZE) {
        const int r = c / PIECES, k = c % PIECES;
        if (row0 + r < T)
            *reinterpret_cast<uint4*>(dst + (long long)(row0 + r) * ld + 16 * k) =
                *reinterpret_cast<const uint4*>(stage + r * S::LD + 16 * k);
    }
}

// The backward's gradients as bf16 added into dqkv (add), through add_rows; else written over it (add = 0), or with
// e5m2 (precision fp8's dqkv under delayed scaling) as E5M2 bytes at the scale *e5m2_scale into e5m2 (the byte image
// of dqkv's layout, a byte an element), both through the warp's `stage` of shared memory (store_staged), which the
// block no longer reads (the caller's barrier). off: the head's offset in dqkv, in 64 elements (at64); row0: the
// tile's first row.
__device__ __forceinline__ void store_grad(bf16* dqkv, unsigned char* e5m2, float s, int add, unsigned off, int ld,
                                           unsigned char* stage, const float (&acc)[8][4], const float (&scale)[2],
                                           int row0, int T, int lane, float& top) {
    if (e5m2 != nullptr)
        store_staged<true>(at64(e5m2, off), ld, stage, acc, scale, row0, T, lane, s, top);
    else if (!add)
        store_staged<false>(reinterpret_cast<unsigned char*>(at64(dqkv, off)), 2 * ld, stage, acc, scale, row0, T,
                            lane, 1.0f, top);
    else
        add_rows(at64(dqkv, off), acc, scale, row0 + lane / 4, T, ld, lane % 4, top);
}

// Whether the backward's stores go through shared memory (store_grad), block-uniform: the caller then calls
// free_tiles first.
__device__ __forceinline__ bool staged_grad(int add, const unsigned char* e5m2) { return e5m2 != nullptr || !add; }

// The block's (b, h) and its tile's rank (0: the longest). `heads_first` 0: the grid is (B H, tiles), a rank across
// every head, then the next rank (longest first across all, the best balance); 1: the grid is (tiles, B H), each
// head's tiles together, longest first, so that its K / V (or Q / dY) stay in L2 while its blocks run, where every
// head's would not fit.
struct BlockAt {
    int bh, rank;
};
__device__ __forceinline__ BlockAt block_at(int heads_first) {
    return heads_first ? BlockAt{(int)blockIdx.y, (int)blockIdx.x} : BlockAt{(int)blockIdx.x, (int)blockIdx.y};
}

// The block's (b, h) again, from a fresh read of its place, so that the compiler cannot reuse an earlier read (nor
// values derived from it): recomputing the head's offsets is cheaper than keeping them in registers through a loop.
__device__ __forceinline__ int block_bh(int heads_first) {
    unsigned bh;
    if (heads_first)
        asm volatile("mov.u32 %0, %%ctaid.y;" : "=r"(bh));
    else
        asm volatile("mov.u32 %0, %%ctaid.x;" : "=r"(bh));
    return static_cast<int>(bh);
}

// One (b, h), as offsets in units of 64 elements (every row of a head starts at a multiple of 64; 32-bit offsets in
// these units cover tensors of up to 2^38 elements): the head's columns in the [B, T, C] activations, and the
// distance between the planes of qkv (and dqkv). `stat` is the offset of its row [b, h, 0] in a [B, H, T] tensor.
struct Head {
    unsigned seq;    // element [b, 0, 64 h] of a [B, T, C] tensor, / 64
    unsigned plane;  // B T C / 64: Q, K, V (and dQ, dK, dV) are consecutive planes of qkv
    unsigned stat;
};

__device__ __forceinline__ Head head_of(int bh, int B, int T, int H) {
    const unsigned b = bh / H, h = bh % H;
    return {b * T * H + h, (unsigned)B * T * H, (unsigned)bh * T};
}

// The same (b, h) in dqkv, whose rows are dld and planes dplane elements apart (both multiples of 64).
__device__ __forceinline__ Head grad_head_of(int bh, int T, int H, int dld, int dplane) {
    const unsigned b = bh / H, h = bh % H;
    return {b * T * (unsigned)(dld / 64) + h, (unsigned)dplane / 64, (unsigned)bh * T};
}

__device__ __forceinline__ int next_stage(int s) { return s == 2 ? 0 : s + 1; }

// ---- forward: one block per (b, h) and query tile, key tiles of 64 -----------------------------------------------
// One step of the online softmax over the 64 keys kb .. kb+63 of a K / V tile, on the scores s of the warp's WT
// m-tiles of rows R .. R + 16 WT - 1 (this thread's rows R + 16 i + g and + 8): moves the running maxima m, leaves
// P (unnormalised, base 2) in s and adds its row sums to l, after scaling l by corr, the factor the rows' earlier
// terms take (1 where a row's maximum stays). Returns whether any row of the warp moved (a warp-uniform value):
// then the accumulators are to be rescaled by corr too. MASK: keys after a row are masked (-inf).
template <int WT, bool MASK>
__device__ __forceinline__ bool softmax_step(float (&s)[WT][8][4], float (&m)[WT][2], float (&l)[WT][2],
                                             float (&corr)[WT][2], int kb, int R, int g, int t, float s2) {
    // The running maximum m of a row (base 2) moves when the step's maximum passes it; a step where no row of the
    // warp moves skips computing corr (and the rescale).
    float mx[WT][2];  // the step's row maxima of S, scaled (-inf: every key masked)
    bool move = false;
#pragma unroll
    for (int i = 0; i < WT; i++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            if (MASK) {  // key > row: -inf (every row keeps key 0 <= row from its first tile, so m stays finite)
                const int row = R + 16 * i + g + 8 * h;
#pragma unroll
                for (int n = 0; n < 8; n++)
#pragma unroll
                    for (int e = 0; e < 2; e++)
                        if (kb + 8 * n + 2 * t + e > row) s[i][n][2 * h + e] = NEG_INF;
            }
            float x[8];  // the maximum as a tree
#pragma unroll
            for (int n = 0; n < 8; n++) x[n] = fmaxf(s[i][n][2 * h], s[i][n][2 * h + 1]);
#pragma unroll
            for (int w = 4; w > 0; w /= 2)
#pragma unroll
                for (int n = 0; n < w; n++) x[n] = fmaxf(x[n], x[n + w]);
            mx[i][h] = row_max4(x[0]) * s2;  // scale > 0 keeps the order
            move |= mx[i][h] > m[i][h];  // m = -inf: any finite maximum moves it
            corr[i][h] = 1.0f;
        }
    const bool moved = __any_sync(FULL_MASK, move);
    if (moved) {
#pragma unroll
        for (int i = 0; i < WT; i++)
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const float m_new = mx[i][h] > m[i][h] ? mx[i][h] : m[i][h];
                corr[i][h] = exp2_approx(m[i][h] - m_new);  // 1, or 0 from m = -inf
                m[i][h] = m_new;
                l[i][h] *= corr[i][h];
            }
    }
#pragma unroll
    for (int i = 0; i < WT; i++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            float ps[8];  // this step's share of the row sum, as a tree
#pragma unroll
            for (int n = 0; n < 8; n++) {
                const float p0 = exp2_approx(fmaf(s[i][n][2 * h], s2, -m[i][h]));  // masked: 2^-inf = 0
                const float p1 = exp2_approx(fmaf(s[i][n][2 * h + 1], s2, -m[i][h]));
                s[i][n][2 * h] = p0;
                s[i][n][2 * h + 1] = p1;
                ps[n] = p0 + p1;
            }
#pragma unroll
            for (int w = 4; w > 0; w /= 2)
#pragma unroll
                for (int n = 0; n < w; n++) ps[n] += ps[n + w];
            l[i][h] += ps[0];
        }
    return moved;
}

template <int WT>
__device__ __forceinline__ void rescale(float (&o)[WT][8][4], const float (&corr)[WT][2]) {
#pragma unroll
    for (int i = 0; i < WT; i++)
#pragma unroll
        for (int n = 0; n < 8; n++)
#pragma unroll
            for (int r = 0; r < 4; r++) o[i][n][r] *= corr[i][r >> 1];
}

// The step on the mma: S and Y += P V for the warp alone. kq: the K tile plus chunks_first_part, vq: the V tile plus
// rows_first_part. MASK: the tile reaches past the warp's first row, so keys after a row are masked, and 16-key
// blocks after the warp's last row are skipped (warp-uniform tests).
template <int WT, bool MASK>
__device__ __forceinline__ void fwd_step(unsigned kq, unsigned vq, const unsigned (&qf)[WT][4][4],
                                         float (&o)[WT][8][4], float (&m)[WT][2], float (&l)[WT][2],
                                         int kb, int R, int g, int t, float s2) {
    float s[WT][8][4];
#pragma unroll
    for (int i = 0; i < WT; i++) zero(s[i]);
#pragma unroll
    for (int kc = 0; kc < 4; kc++)
#pragma unroll
        for (int np = 0; np < 4; np++) {  // keys 16 np .. 16 np + 15 of the tile
            if (MASK && kb + 16 * np >= R + 16 * WT) continue;
            mma_block<false>(s, 2 * np, k_step(qf, kc), kq, 16 * np, kc);
        }
    float corr[WT][2];
    if (softmax_step<WT, MASK>(s, m, l, corr, kb, R, g, t, s2)) rescale(o, corr);
#pragma unroll
    for (int kc = 0; kc < 4; kc++) {  // keys 16 kc .. 16 kc + 15 of the tile
        if (MASK && kb + 16 * kc >= R + 16 * WT) continue;
        unsigned pf[WT][4];  // P as A fragments
#pragma unroll
        for (int i = 0; i < WT; i++) pack_a(pf[i], s[i][2 * kc], s[i][2 * kc + 1]);
#pragma unroll
        for (int np = 0; np < 4; np++) mma_block<true>(o, 2 * np, m_tiles(pf), vq, 16 * kc, np);  // V's 16-column blocks
    }
}

#ifdef ATTN_WGMMA
// The step on the warpgroup products: the block's 64 rows at once (one m-tile a warp). Ks, Vs: the K and V tiles.
// MASK: the block's diagonal tile, keys after a row masked.
template <bool MASK>
__device__ __forceinline__ void fwd_step_wg(unsigned Ks, unsigned Vs, const unsigned (&qf)[1][4][4],
                                            float (&o)[1][8][4], float (&m)[1][2], float (&l)[1][2], int kb, int R,
                                            int g, int t, float s2) {
    float s[1][8][4], corr[1][2];
    wg_fence();
    wg_scores(s[0], qf[0], Ks);
    wg_commit();
    wg_wait();
    wg_hold(s[0]);
    if (softmax_step<1, MASK>(s, m, l, corr, kb, R, g, t, s2)) rescale(o, corr);
    unsigned pf[4][4];  // P as A fragments, k-steps of 16 keys
#pragma unroll
    for (int kc = 0; kc < 4; kc++) pack_a(pf[kc], s[0][2 * kc], s[0][2 * kc + 1]);
    wg_fence();
#pragma unroll
    for (int kc = 0; kc < 4; kc++) wgmma<1>(o[0], pf[kc], mn_major(Vs, 16 * kc), 1);
    wg_commit();
    wg_wait();
    wg_hold(o[0]);
}
#endif

// WG: the block is one warpgroup on the warpgroup products (the Hopper build's k_attn_fwd_wg), else four warps on
// the mma (k_attn_fwd_bf16).
template <bool WG>
__device__ __forceinline__ void attn_fwd(bf16* out, float* lse, const bf16* qkv, int B, int T, int C, int H,
                                         float scale, unsigned* amax, int heads_first) {
    constexpr int WT = ATTN_BF16_WARP_TILES, ROWS = ATTN_BF16_ROWS, THREADS = ATTN_BF16_THREADS;
    static_assert(!WG || (WT == 1 && THREADS == 128), "a warpgroup of 64 rows");
    __shared__ __align__(1024) bf16 smem[ATTN_BF16_FWD_SMEM / 2];  // 1024: the swizzle's period
    // stage s: K at S0 + s STAGE, V after it; Q first, over stage 2
    const unsigned S0 = smem_u32(smem), Qs = S0 + 2 * ATTN_BF16_STAGE_BYTES;
    const int n_tiles = (T + ROWS - 1) / ROWS;
    const BlockAt at = block_at(heads_first);
    const int q0 = (n_tiles - 1 - at.rank) * ROWS;  // the longest rows first
    const Head hh = head_of(at.bh, B, T, H);
    const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE, g = lane / 4, t = lane % 4;
    const int R = q0 + 16 * WT * warp;  // the warp's first row
    const int n_kt = (min(T, q0 + ROWS) + ATTN_BF16_STREAM - 1) / ATTN_BF16_STREAM;
    const float s2 = scale * LOG2E;  // softmax in base 2: exp(x) = exp2(x log2 e)

    const unsigned k_off = hh.seq + hh.plane;  // the head's slices of Q, K and V: at64(qkv, seq, + plane, + 2 plane)
    load_tile<ROWS, THREADS>(Qs, qkv, hh.seq, q0, T, C);
    cp_async_commit();
#pragma unroll
    for (int k = 0; k < 2; k++) {  // key tiles 0 and 1 into stages 0 and 1
        if (k < n_kt) load_kv_tile<THREADS>(S0 + k * ATTN_BF16_STAGE_BYTES, qkv, k_off, hh.plane, k, T, C);
        cp_async_commit();
    }
    cp_async_wait<2>();  // Q
    __syncthreads();
    unsigned qf[WT][4][4];  // the warp's query rows as A fragments, k-steps over the head's 64 columns
#pragma unroll
    for (int i = 0; i < WT; i++)
#pragma unroll
        for (int kc = 0; kc < 4; kc++)
            ldsm(qf[i][kc], lds_at(Qs + rows_first_part(lane), 16 * (WT * warp + i), kc));

    float o[WT][8][4], m[WT][2], l[WT][2];  // running max (base 2) and this lane's share of the sum
#pragma unroll
    for (int i = 0; i < WT; i++) {
        zero(o[i]);
        m[i][0] = m[i][1] = NEG_INF;
        l[i][0] = l[i][1] = 0.0f;
    }
    const unsigned kpart = chunks_first_part(lane), vpart = rows_first_part(lane);
    int stage = 0;
    for (int kt = 0; kt < n_kt; kt++) {
        cp_async_wait<1>();  // tile kt (tile kt + 1 may still be on its way)
        fence_for_tensor_reads<WG>();
        __syncthreads();     // ... for everyone; and everyone is done with tile kt - 1 (and with Q)
        if (kt + 2 < n_kt)  // prefetch tile kt + 2 into the stage of tile kt - 1
            load_kv_tile<THREADS>(S0 + next_stage(next_stage(stage)) * ATTN_BF16_STAGE_BYTES, qkv, k_off, hh.plane,
                                  kt + 2, T, C);
        cp_async_commit();
        const unsigned Ks = S0 + stage * ATTN_BF16_STAGE_BYTES, Vs = Ks + ATTN_BF16_TILE_BYTES;
        const int kb = kt * ATTN_BF16_STREAM;  // the tile's first key
#ifdef ATTN_WGMMA
        if constexpr (WG) {  // block-uniform: every row of the block takes part
            if (kb + ATTN_BF16_STREAM <= q0) fwd_step_wg<false>(Ks, Vs, qf, o, m, l, kb, R, g, t, s2);
            else fwd_step_wg<true>(Ks, Vs, qf, o, m, l, kb, R, g, t, s2);
        } else
#endif
        if (R < T) {  // warp-uniform; warps wholly past T only keep the barriers
            if (kb + ATTN_BF16_STREAM - 1 <= R)
                fwd_step<WT, false>(Ks + kpart, Vs + vpart, qf, o, m, l, kb, R, g, t, s2);
            else if (kb < R + 16 * WT)
                fwd_step<WT, true>(Ks + kpart, Vs + vpart, qf, o, m, l, kb, R, g, t, s2);
        }
        stage = next_stage(stage);
    }
    // The head's offsets again, from a fresh read of the block index: recomputing them is cheaper than keeping them
    // in registers through the loop.
    const Head hs = head_of(block_bh(heads_first), B, T, H);
    float top = 0.0f;
    free_tiles();  // Y through shared memory (store_staged)
    unsigned char* tiles = reinterpret_cast<unsigned char*>(smem) + warp * WT * Staged<false>::BYTES;
#pragma unroll
    for (int i = 0; i < WT; i++) {
        const int row0 = R + 16 * i + g;
        float inv[2];
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const float sum = row_sum4(l[i][h]);
            inv[h] = 1.0f / sum;
            const int row = row0 + 8 * h;
            if (t == 0 && row < T) lse[hs.stat + row] = (m[i][h] + log2f(sum)) * LN2;
        }
        unsigned char* y = reinterpret_cast<unsigned char*>(at64(out, hs.seq));
        store_staged<false>(y, 2 * C, tiles + i * Staged<false>::BYTES, o[i], inv, R + 16 * i, T, lane, 1.0f, top);
    }
    if (amax != nullptr) warp_amax(amax, top);
}

extern "C" __global__ void __launch_bounds__(ATTN_BF16_THREADS, ATTN_BF16_BLOCKS)
k_attn_fwd_bf16(bf16* out, float* lse, const bf16* qkv, int B, int T, int C, int H, float scale, unsigned* amax,
                int heads_first) {
    attn_fwd<false>(out, lse, qkv, B, T, C, H, scale, amax, heads_first);
}
#ifdef ATTN_WGMMA
extern "C" __global__ void __launch_bounds__(ATTN_BF16_THREADS, ATTN_BF16_BLOCKS)
k_attn_fwd_wg(bf16* out, float* lse, const bf16* qkv, int B, int T, int C, int H, float scale, unsigned* amax,
              int heads_first) {
    attn_fwd<true>(out, lse, qkv, B, T, C, H, scale, amax, heads_first);
}
#endif

// ---- backward, first kernel: D and dQ, one block per (b, h) and query tile, key tiles of 64 -----------------------
// D of this thread's rows row0 and row0 + 8 into dsum (and, from lane t = 0, into delta), and their lse in base 2
// (rows past T: D = 0 and lse = +inf, so P = 0). Lane t takes columns 8t .. 8t+7 and 32 + 8t .. 32 + 8t + 7 of dY
// and Y, read from global memory.
__device__ __forceinline__ void row_stats(float (&lse2)[2], float (&dsum)[2], float* __restrict__ delta,
                                          const bf16* __restrict__ dout, const bf16* __restrict__ y,
                                          const float* __restrict__ lse, const Head& hh, int row0, int T, int C,
                                          int t) {
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const int row = row0 + 8 * h;
        float acc = 0.0f;
        if (row < T) {
            const uint4* dy_row = reinterpret_cast<const uint4*>(at64(dout, hh.seq) + row * C);
            const uint4* y_row = reinterpret_cast<const uint4*>(at64(y, hh.seq) + row * C);
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
        dsum[h] = row_sum4(acc);
        if (t == 0 && row < T) delta[hh.stat + row] = dsum[h];
        lse2[h] = row < T ? lse[hh.stat + row] * LOG2E : POS_INF;
    }
}

// dS = P (dP - D) into dp, for the 8 N keys key0 .. key0 + 8 N - 1 (this thread's 2 N of them) of rows row0 and
// row0 + 8, from their scores s and dP; P = exp(S - lse). MASK: keys after a row give P = 0.
template <int N, bool MASK>
__device__ __forceinline__ void dq_ds(const float (&s)[N][4], float (&dp)[N][4], const float (&lse2)[2],
                                      const float (&dsum)[2], int key0, int row0, int t, float s2) {
#pragma unroll
    for (int n = 0; n < N; n++)
#pragma unroll
        for (int r = 0; r < 4; r++) {
            const int h = r >> 1;
            float p = exp2_approx(fmaf(s[n][r], s2, -lse2[h]));  // rows past T: lse +inf, P = 0
            if (MASK && key0 + 8 * n + 2 * t + (r & 1) > row0 + 8 * h) p = 0.0f;
            dp[n][r] = p * (dp[n][r] - dsum[h]);
        }
}

// The 64 keys kb .. kb+63 of a K / V tile for the warp's rows R .. R + 16 WT - 1, 16 keys at a time: S and dP, then
// dS, then dQ += dS K. kq, vq: the K and V tiles plus chunks_first_part; kt_: the K tile plus rows_first_part. MASK:
// the tile reaches past the warp's first row (keys after a row give P = 0; 16-key blocks past its last row skipped).
template <int WT, bool MASK>
__device__ __forceinline__ void dq_step(unsigned kq, unsigned vq, unsigned kt_, const unsigned (&qf)[WT][4][4],
                                        const unsigned (&yf)[WT][4][4], float (&dq)[WT][8][4],
                                        const float (&lse2)[WT][2], const float (&dsum)[WT][2], int kb, int R, int g,
                                        int t, float s2) {
#pragma unroll(MASK ? 1 : 2)  // two blocks at a time: what the registers allow
    for (int c = 0; c < 4; c++) {
        if (MASK && kb + 16 * c >= R + 16 * WT) break;  // this and later blocks lie past every row of the warp
        float s[WT][2][4], dp[WT][2][4];
#pragma unroll
        for (int i = 0; i < WT; i++) {
            zero(s[i]);
            zero(dp[i]);
        }
#pragma unroll
        for (int kc = 0; kc < 4; kc++) {
            mma_block<false>(s, 0, k_step(qf, kc), kq, 16 * c, kc);
            mma_block<false>(dp, 0, k_step(yf, kc), vq, 16 * c, kc);
        }
        unsigned a[WT][4];  // dS, rounded to bf16
#pragma unroll
        for (int i = 0; i < WT; i++) {
            dq_ds<2, MASK>(s[i], dp[i], lse2[i], dsum[i], kb + 16 * c, R + 16 * i + g, t, s2);
            pack_a(a[i], dp[i][0], dp[i][1]);
        }
#pragma unroll
        for (int np = 0; np < 4; np++) mma_block<true>(dq, 2 * np, m_tiles(a), kt_, 16 * c, np);
    }
}

#ifdef ATTN_WGMMA
// The step on the warpgroup products: the block's 64 rows, 32 keys at a time. Ks, Vs: the K and V tiles. MASK: the
// block's diagonal tile.
template <bool MASK>
__device__ __forceinline__ void dq_step_wg(unsigned Ks, unsigned Vs, const unsigned (&qf)[1][4][4],
                                           const unsigned (&yf)[1][4][4], float (&dq)[1][8][4],
                                           const float (&lse2)[1][2], const float (&dsum)[1][2], int kb, int R,
                                           int g, int t, float s2) {
#pragma unroll
    for (int c = 0; c < 2; c++) {  // keys kb + 32 c .. kb + 32 c + 31: rows 32 c .. of the tiles
        float s[4][4], dp[4][4];
        wg_fence();
        wg_scores(s, qf[0], Ks + 32 * c * ATTN_BF16_ROW_BYTES);
        wg_scores(dp, yf[0], Vs + 32 * c * ATTN_BF16_ROW_BYTES);
        wg_commit();
        wg_wait();
        wg_hold(s);
        wg_hold(dp);
        dq_ds<4, MASK>(s, dp, lse2[0], dsum[0], kb + 32 * c, R + g, t, s2);
        unsigned a[2][4];  // dS as A fragments, k-steps of 16 keys
#pragma unroll
        for (int kk = 0; kk < 2; kk++) pack_a(a[kk], dp[2 * kk], dp[2 * kk + 1]);
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < 2; kk++) wgmma<1>(dq[0], a[kk], mn_major(Ks, 32 * c + 16 * kk), 1);
        wg_commit();
        wg_wait();
        wg_hold(dq[0]);
    }
}
#endif

// WG: as in attn_fwd (k_attn_bwd_dq_wg, k_attn_bwd_dq_bf16).
template <bool WG>
__device__ __forceinline__ void attn_bwd_dq(bf16* dqkv, float* delta, const bf16* dout, const bf16* y,
                                            const bf16* qkv, const float* lse, int B, int T, int C, int H,
                                            float scale, int add, unsigned* amax, int dld, int dplane,
                                            unsigned char* e5m2, const float* e5m2_scale, int heads_first) {
    constexpr int WT = ATTN_BF16_WARP_TILES, ROWS = ATTN_BF16_ROWS, THREADS = ATTN_BF16_THREADS;
    static_assert(!WG || (WT == 1 && THREADS == 128), "a warpgroup of 64 rows");
    __shared__ __align__(1024) bf16 smem[ATTN_BF16_DQ_SMEM / 2];
    // stage s: K at S0 + s STAGE, V after it; the Q and dY tiles first, over stage 2
    const unsigned S0 = smem_u32(smem);
    const unsigned Qs = S0 + 2 * ATTN_BF16_STAGE_BYTES, dYs = Qs + ATTN_BF16_TILE_BYTES;
    const int n_tiles = (T + ROWS - 1) / ROWS;
    const BlockAt at = block_at(heads_first);
    const int q0 = (n_tiles - 1 - at.rank) * ROWS;
    const Head hh = head_of(at.bh, B, T, H);
    const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE, g = lane / 4, t = lane % 4;
    const int R = q0 + 16 * WT * warp;
    const int n_kt = (min(T, q0 + ROWS) + ATTN_BF16_STREAM - 1) / ATTN_BF16_STREAM;
    const float s2 = scale * LOG2E;

    const unsigned k_off = hh.seq + hh.plane;
    load_tile<ROWS, THREADS>(Qs, qkv, hh.seq, q0, T, C);
    load_tile<ROWS, THREADS>(dYs, dout, hh.seq, q0, T, C);
    cp_async_commit();
#pragma unroll
    for (int k = 0; k < 2; k++) {  // key tiles 0 and 1 into stages 0 and 1
        if (k < n_kt) load_kv_tile<THREADS>(S0 + k * ATTN_BF16_STAGE_BYTES, qkv, k_off, hh.plane, k, T, C);
        cp_async_commit();
    }
    // While they arrive: D and lse of the thread's rows
    float lse2[WT][2], dsum[WT][2];  // lse in base 2, and D
#pragma unroll
    for (int i = 0; i < WT; i++) row_stats(lse2[i], dsum[i], delta, dout, y, lse, hh, R + 16 * i + g, T, C, t);
    cp_async_wait<2>();  // Q and dY
    __syncthreads();
    unsigned qf[WT][4][4], yf[WT][4][4];  // the warp's rows of Q and dY as A fragments
#pragma unroll
    for (int i = 0; i < WT; i++)
#pragma unroll
        for (int kc = 0; kc < 4; kc++) {
            ldsm(qf[i][kc], lds_at(Qs + rows_first_part(lane), 16 * (WT * warp + i), kc));
            ldsm(yf[i][kc], lds_at(dYs + rows_first_part(lane), 16 * (WT * warp + i), kc));
        }

    float dq[WT][8][4];
#pragma unroll
    for (int i = 0; i < WT; i++) zero(dq[i]);
    const unsigned cpart = chunks_first_part(lane), rpart = rows_first_part(lane);
    int stage = 0;
    for (int kt = 0; kt < n_kt; kt++) {
        cp_async_wait<1>();  // tile kt (tile kt + 1 may still be on its way)
        fence_for_tensor_reads<WG>();
        __syncthreads();  // ... for everyone; and everyone is done with tile kt - 1 (and with Q and dY)
        if (kt + 2 < n_kt)  // prefetch tile kt + 2 into the stage of tile kt - 1
            load_kv_tile<THREADS>(S0 + next_stage(next_stage(stage)) * ATTN_BF16_STAGE_BYTES, qkv, k_off, hh.plane,
                                  kt + 2, T, C);
        cp_async_commit();
        const unsigned Ks = S0 + stage * ATTN_BF16_STAGE_BYTES, Vs = Ks + ATTN_BF16_TILE_BYTES;
        const int kb = kt * ATTN_BF16_STREAM;
#ifdef ATTN_WGMMA
        if constexpr (WG) {
            if (kb + ATTN_BF16_STREAM <= q0) dq_step_wg<false>(Ks, Vs, qf, yf, dq, lse2, dsum, kb, R, g, t, s2);
            else dq_step_wg<true>(Ks, Vs, qf, yf, dq, lse2, dsum, kb, R, g, t, s2);
        } else
#endif
        if (R < T) {
            if (kb + ATTN_BF16_STREAM - 1 <= R)
                dq_step<WT, false>(Ks + cpart, Vs + cpart, Ks + rpart, qf, yf, dq, lse2, dsum, kb, R, g, t, s2);
            else if (kb < R + 16 * WT)
                dq_step<WT, true>(Ks + cpart, Vs + cpart, Ks + rpart, qf, yf, dq, lse2, dsum, kb, R, g, t, s2);
        }
        stage = next_stage(stage);
    }
    const float sc[2] = {scale, scale};
    const Head hs = grad_head_of(block_bh(heads_first), T, H, dld, dplane);  // offsets recomputed, as in the forward
    float top = 0.0f;
    if (staged_grad(add, e5m2)) free_tiles();
    unsigned char* tiles = reinterpret_cast<unsigned char*>(smem) + warp * WT * Staged<false>::BYTES;
    const float es = e5m2 != nullptr ? *e5m2_scale : 1.0f;
#pragma unroll
    for (int i = 0; i < WT; i++)
        store_grad(dqkv, e5m2, es, add, hs.seq, dld, tiles + i * Staged<false>::BYTES, dq[i], sc, R + 16 * i, T, lane,
                   top);
    if (amax != nullptr) warp_amax(amax, top);
}

extern "C" __global__ void __launch_bounds__(ATTN_BF16_THREADS, ATTN_BF16_BLOCKS)
k_attn_bwd_dq_bf16(bf16* dqkv, float* delta, const bf16* dout, const bf16* y, const bf16* qkv, const float* lse,
                   int B, int T, int C, int H, float scale, int add, unsigned* amax, int dld, int dplane,
                   unsigned char* e5m2, const float* e5m2_scale, int heads_first) {
    attn_bwd_dq<false>(dqkv, delta, dout, y, qkv, lse, B, T, C, H, scale,
                       add, amax, dld, dplane, e5m2, e5m2_scale, heads_first);
}
#ifdef ATTN_WGMMA
extern "C" __global__ void __launch_bounds__(ATTN_BF16_THREADS, ATTN_BF16_BLOCKS)
k_attn_bwd_dq_wg(bf16* dqkv, float* delta, const bf16* dout, const bf16* y, const bf16* qkv, const float* lse,
                 int B, int T, int C, int H, float scale, int add, unsigned* amax, int dld, int dplane,
                 unsigned char* e5m2, const float* e5m2_scale, int heads_first) {
    attn_bwd_dq<true>(dqkv, delta, dout, y, qkv, lse, B, T, C, H, scale,
                      add, amax, dld, dplane, e5m2, e5m2_scale, heads_first);
}
#endif

// ---- backward, second kernel: dK and dV, one block per (b, h) and key tile, query tiles of 64 ---------------------
// lse (base 2) and D of this thread's queries col0 + 8 n + 2 t + e of a query tile, from its shared lse and D.
template <int N>
__device__ __forceinline__ void load_stats(float (&l2)[N][2], float (&d)[N][2], unsigned ls, unsigned ds, int col0,
                                           int t) {
#pragma unroll
    for (int n = 0; n < N; n++) {
        const int col = col0 + 8 * n + 2 * t;
        const float2 lv = lds_f2(ls + col * 4), dv = lds_f2(ds + col * 4);
        l2[n][0] = lv.x * LOG2E;
        l2[n][1] = lv.y * LOG2E;
        d[n][0] = dv.x;
        d[n][1] = dv.y;
    }
}

// P^T into s and dS^T = P^T (dP^T - D) into dp, for keys key0 and key0 + 8 (this thread's rows) against the 8 N
// queries q0 .. q0 + 8 N - 1, from their S^T and dP^T. MASK: queries before a key give P = 0.
template <int N, bool MASK>
__device__ __forceinline__ void kv_pds(float (&s)[N][4], float (&dp)[N][4], const float (&l2)[N][2],
                                       const float (&d)[N][2], int q0, int key0, int t, float s2) {
#pragma unroll
    for (int n = 0; n < N; n++)
#pragma unroll
        for (int r = 0; r < 4; r++) {
            const int e = r & 1;
            float p = exp2_approx(fmaf(s[n][r], s2, -l2[n][e]));
            if (MASK && q0 + 8 * n + 2 * t + e < key0 + 8 * (r >> 1)) p = 0.0f;
            s[n][r] = p;
            dp[n][r] = p * (dp[n][r] - d[n][e]);
        }
}

// The 64 queries Q0 .. Q0+63 of a query tile for the warp's keys K0 .. K0 + 16 WT - 1, 16 queries at a time: S^T and
// dP^T, then P^T and dS^T, then dV += P^T dY and dK += dS^T Q. qc, yc: the Q and dY tiles plus chunks_first_part;
// qr, yr: the same plus rows_first_part; ls, ds: the tile's lse and D; kf, vf: the warp's keys of K and V as A
// fragments. MASK: the tile holds queries before some key of the warp (masked: P = 0; 16-query blocks wholly before
// the warp's keys skipped) or past T (blocks skipped).
template <int WT, bool MASK>
__device__ __forceinline__ void kv_step(unsigned qc, unsigned yc, unsigned qr, unsigned yr, unsigned ls, unsigned ds,
                                        const unsigned (&kf)[WT][4][4], const unsigned (&vf)[WT][4][4],
                                        float (&dk)[WT][8][4], float (&dv)[WT][8][4], int Q0, int K0, int T, int g,
                                        int t, float s2) {
#pragma unroll(WT == 1 ? 4 : 1)  // two m-tiles a warp: one block at a time, what the registers allow
    for (int c = 0; c < 4; c++) {
        const int qb = Q0 + 16 * c;  // the block's first query
        if (MASK && (qb + 15 < K0 || qb >= T)) continue;
        float s[WT][2][4], dp[WT][2][4];
#pragma unroll
        for (int i = 0; i < WT; i++) {
            zero(s[i]);
            zero(dp[i]);
        }
#pragma unroll
        for (int kc = 0; kc < 4; kc++) {
            mma_block<false>(s, 0, k_step(kf, kc), qc, 16 * c, kc);
            mma_block<false>(dp, 0, k_step(vf, kc), yc, 16 * c, kc);
        }
        float l2[2][2], d[2][2];  // lse (base 2) and D of this thread's queries 16 c + 8 n + 2 t + e
        load_stats(l2, d, ls, ds, 16 * c, t);
        unsigned pa[WT][4], da[WT][4];  // P^T and dS^T, rounded to bf16
#pragma unroll
        for (int i = 0; i < WT; i++) {
            kv_pds<2, MASK>(s[i], dp[i], l2, d, qb, K0 + 16 * i + g, t, s2);
            pack_a(pa[i], s[i][0], s[i][1]);
            pack_a(da[i], dp[i][0], dp[i][1]);
        }
#pragma unroll
        for (int np = 0; np < 4; np++) {
            mma_block<true>(dv, 2 * np, m_tiles(pa), yr, 16 * c, np);
            mma_block<true>(dk, 2 * np, m_tiles(da), qr, 16 * c, np);
        }
    }
}

// Starts loading query tile qt (Q, dY, lse, D) into buffer s (Q at QY + s STAGE, dY after it; lse then D at
// ST + s STAT); lse and D past T read as zero, harmless since those queries' Q and dY rows are zero too (so are
// their dS and their share of dV).
template <int THREADS>
__device__ __forceinline__ void load_queries(unsigned QY, unsigned ST, const bf16* qkv, const bf16* dout,
                                             const float* lse, const float* delta, const Head& hh, int qt, int s,
                                             int T, int C) {
    const unsigned buf = QY + s * ATTN_BF16_STAGE_BYTES;
    const int row0 = qt * ATTN_BF16_STREAM;
    load_tile<ATTN_BF16_STREAM, THREADS>(buf, qkv, hh.seq, row0, T, C);
    load_tile<ATTN_BF16_STREAM, THREADS>(buf + ATTN_BF16_TILE_BYTES, dout, hh.seq, row0, T, C);
    // lse by threads j < 64, D by 64 <= j < 128 (j = the thread, or with fewer threads thread + k THREADS)
#pragma unroll
    for (int k = 0; k < (THREADS < 2 * ATTN_BF16_STREAM ? 2 * ATTN_BF16_STREAM / THREADS : 1); k++) {
        const unsigned j = k * THREADS + threadIdx.x % THREADS;
        if (j >= 2 * ATTN_BF16_STREAM) break;
        const int row = row0 + (int)(j % ATTN_BF16_STREAM);
        const float* src = (j < ATTN_BF16_STREAM ? lse : delta) + hh.stat + min(row, T - 1);
        cp_async4(ST + s * ATTN_BF16_STAT_BYTES + j * 4, src, row < T);
    }
}

#ifdef ATTN_WGMMA
// The step on the warpgroup products: the block's 64 keys against a query tile, 32 queries at a time. Qs, dYs, Ls,
// Ds: the tile's Q, dY, lse and D. MASK: the block's diagonal tile (queries before a key masked), or a tile that
// reaches past T (halves wholly past T skipped).
template <bool MASK>
__device__ __forceinline__ void kv_step_wg(unsigned Qs, unsigned dYs, unsigned Ls, unsigned Ds,
                                           const unsigned (&kf)[1][4][4], const unsigned (&vf)[1][4][4],
                                           float (&dk)[1][8][4], float (&dv)[1][8][4], int Q0, int K0, int T, int g,
                                           int t, float s2) {
#pragma unroll
    for (int c = 0; c < 2; c++) {  // queries Q0 + 32 c .. Q0 + 32 c + 31: rows 32 c .. of the tiles
        const int qb = Q0 + 32 * c;
        if (MASK && qb >= T) continue;  // block-uniform
        float s[4][4], dp[4][4];
        wg_fence();
        wg_scores(s, kf[0], Qs + 32 * c * ATTN_BF16_ROW_BYTES);
        wg_scores(dp, vf[0], dYs + 32 * c * ATTN_BF16_ROW_BYTES);
        wg_commit();
        float l2[4][2], d[4][2];
        load_stats(l2, d, Ls, Ds, 32 * c, t);  // while the products run
        wg_wait();
        wg_hold(s);
        wg_hold(dp);
        kv_pds<4, MASK>(s, dp, l2, d, qb, K0 + g, t, s2);
        unsigned pa[2][4], da[2][4];  // P^T and dS^T as A fragments, k-steps of 16 queries
#pragma unroll
        for (int kk = 0; kk < 2; kk++) {
            pack_a(pa[kk], s[2 * kk], s[2 * kk + 1]);
            pack_a(da[kk], dp[2 * kk], dp[2 * kk + 1]);
        }
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < 2; kk++) {
            wgmma<1>(dv[0], pa[kk], mn_major(dYs, 32 * c + 16 * kk), 1);
            wgmma<1>(dk[0], da[kk], mn_major(Qs, 32 * c + 16 * kk), 1);
        }
        wg_commit();
        wg_wait();
        wg_hold(dv[0]);
        wg_hold(dk[0]);
    }
}
#endif

// WG: as in attn_fwd (k_attn_bwd_kv_wg, k_attn_bwd_bf16). The query tiles stream through NBUF buffers: two in
// static shared memory on the mma, three in dynamic shared memory (ATTN_BF16_WG_KV_SMEM) on the warpgroup products,
// where a tile is then requested two tiles ahead. K and V arrive first, in the last buffer, beside the first tiles.
template <bool WG>
__device__ __forceinline__ void attn_bwd_kv(bf16* dqkv, const float* delta, const bf16* dout, const bf16* qkv,
                                            const float* lse, int B, int T, int C, int H, float scale, int add,
                                            unsigned* amax, int dld, int dplane, unsigned char* e5m2,
                                            const float* e5m2_scale, int heads_first) {
    constexpr int WT = ATTN_BF16_KV_WARP_TILES, KROWS = ATTN_BF16_KV_ROWS, THREADS = ATTN_BF16_KV_THREADS;
    constexpr int NBUF = WG ? 3 : 2;
    static_assert(!WG || (WT == 1 && THREADS == 128), "a warpgroup of 64 keys");
    static_assert(2 * KROWS * ATTN_BF16_ROW_BYTES <= ATTN_BF16_STAGE_BYTES, "K and V fit a buffer");
    unsigned QY;  // buffer s: Q at QY + s STAGE, dY after it; its lse (64 floats) then D (64 floats) at ST + s STAT
    if constexpr (WG) {
        extern __shared__ __align__(1024) unsigned char attn_wg_smem[];
        QY = smem_u32(attn_wg_smem);
    } else {
        __shared__ __align__(128) bf16 smem[ATTN_BF16_BWD_SMEM / 2];
        QY = smem_u32(smem);
    }
    const unsigned ST = QY + NBUF * ATTN_BF16_STAGE_BYTES;
    const unsigned Ks = QY + (NBUF - 1) * ATTN_BF16_STAGE_BYTES, Vs = Ks + KROWS * ATTN_BF16_ROW_BYTES;
    const BlockAt at = block_at(heads_first);
    const int k0 = at.rank * KROWS;  // the longest columns first
    const Head hh = head_of(at.bh, B, T, H);
    const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE, g = lane / 4, t = lane % 4;
    const int K0 = k0 + 16 * WT * warp;  // the warp's first key
    const int qt0 = k0 / ATTN_BF16_STREAM, n_qt = (T + ATTN_BF16_STREAM - 1) / ATTN_BF16_STREAM;
    const float s2 = scale * LOG2E;

    load_tile<KROWS, THREADS>(Ks, qkv, hh.seq + hh.plane, k0, T, C);
    load_tile<KROWS, THREADS>(Vs, qkv, hh.seq + 2 * hh.plane, k0, T, C);
    cp_async_commit();
#pragma unroll
    for (int k = 0; k < NBUF - 1; k++) {  // query tiles qt0 .. into buffers 0 ..
        if (qt0 + k < n_qt) load_queries<THREADS>(QY, ST, qkv, dout, lse, delta, hh, qt0 + k, k, T, C);
        cp_async_commit();
    }
    cp_async_wait<NBUF - 1>();  // K and V
    __syncthreads();
    unsigned kf[WT][4][4], vf[WT][4][4];  // the warp's keys of K and V as A fragments
#pragma unroll
    for (int i = 0; i < WT; i++)
#pragma unroll
        for (int kc = 0; kc < 4; kc++) {
            ldsm(kf[i][kc], lds_at(Ks + rows_first_part(lane), 16 * (WT * warp + i), kc));
            ldsm(vf[i][kc], lds_at(Vs + rows_first_part(lane), 16 * (WT * warp + i), kc));
        }

    float dk[WT][8][4], dv[WT][8][4];
#pragma unroll
    for (int i = 0; i < WT; i++) {
        zero(dk[i]);
        zero(dv[i]);
    }
    const unsigned cpart = chunks_first_part(lane), rpart = rows_first_part(lane);
    int s = 0;  // tile qt's buffer
    for (int qt = qt0; qt < n_qt; qt++) {
        cp_async_wait<NBUF - 2>();  // tile qt
        fence_for_tensor_reads<WG>();
        __syncthreads();  // ... for everyone; and everyone is done with tile qt - 1 (and with K and V)
        const int ps = s == 0 ? NBUF - 1 : s - 1;  // the buffer of tile qt - 1 (first: K and V's)
        if (qt + NBUF - 1 < n_qt) load_queries<THREADS>(QY, ST, qkv, dout, lse, delta, hh, qt + NBUF - 1, ps, T, C);
        cp_async_commit();
        const unsigned Qs = QY + s * ATTN_BF16_STAGE_BYTES, dYs = Qs + ATTN_BF16_TILE_BYTES;
        const unsigned Ls = ST + s * ATTN_BF16_STAT_BYTES, Ds = Ls + ATTN_BF16_STREAM * 4;
        const int Q0 = qt * ATTN_BF16_STREAM;  // the tile's first query
#ifdef ATTN_WGMMA
        if constexpr (WG) {  // every query tile from the block's first key on sees some key of it
            if (Q0 >= k0 + KROWS && Q0 + ATTN_BF16_STREAM <= T)
                kv_step_wg<false>(Qs, dYs, Ls, Ds, kf, vf, dk, dv, Q0, K0, T, g, t, s2);
            else
                kv_step_wg<true>(Qs, dYs, Ls, Ds, kf, vf, dk, dv, Q0, K0, T, g, t, s2);
        } else
#endif
        if (K0 < T && Q0 + ATTN_BF16_STREAM - 1 >= K0) {  // warp-uniform: some query of the tile sees some key
            if (Q0 >= K0 + 16 * WT - 1 && Q0 + ATTN_BF16_STREAM <= T)
                kv_step<WT, false>(Qs + cpart, dYs + cpart, Qs + rpart, dYs + rpart, Ls, Ds, kf, vf, dk, dv, Q0, K0, T,
                                   g, t, s2);
            else
                kv_step<WT, true>(Qs + cpart, dYs + cpart, Qs + rpart, dYs + rpart, Ls, Ds, kf, vf, dk, dv, Q0, K0, T,
                                  g, t, s2);
        }
        s = s == NBUF - 1 ? 0 : s + 1;
    }
    const float one[2] = {1.0f, 1.0f}, sc[2] = {scale, scale};
    const Head hs = grad_head_of(block_bh(heads_first), T, H, dld, dplane);  // offsets recomputed, as in the forward
    float top = 0.0f;
    if (staged_grad(add, e5m2)) free_tiles();
    constexpr int TILE = Staged<false>::BYTES;
    unsigned char* tiles = static_cast<unsigned char*>(__cvta_shared_to_generic(QY)) + warp * 2 * WT * TILE;
    const float es = e5m2 != nullptr ? *e5m2_scale : 1.0f;
#pragma unroll
    for (int i = 0; i < WT; i++) {
        store_grad(dqkv, e5m2, es, add, hs.seq + hs.plane, dld, tiles + 2 * i * TILE, dk[i], sc, K0 + 16 * i, T, lane,
                   top);
        store_grad(dqkv, e5m2, es, add, hs.seq + 2 * hs.plane, dld, tiles + (2 * i + 1) * TILE, dv[i], one, K0 + 16 * i,
                   T, lane, top);
    }
    if (amax != nullptr) warp_amax(amax, top);
}

// Runs after k_attn_bwd_dq_bf16, whose D it reads.
extern "C" __global__ void __launch_bounds__(ATTN_BF16_KV_THREADS, ATTN_BF16_KV_BLOCKS)
k_attn_bwd_bf16(bf16* dqkv, const float* delta, const bf16* dout, const bf16* qkv, const float* lse,
                int B, int T, int C, int H, float scale, int add, unsigned* amax, int dld, int dplane,
                unsigned char* e5m2, const float* e5m2_scale, int heads_first) {
    attn_bwd_kv<false>(dqkv, delta, dout, qkv, lse, B, T, C, H, scale,
                       add, amax, dld, dplane, e5m2, e5m2_scale, heads_first);
}
#ifdef ATTN_WGMMA
// Runs after k_attn_bwd_dq_wg, whose D it reads; with ATTN_BF16_WG_KV_SMEM bytes of dynamic shared memory (the
// module's constant attn_wg_kv_smem).
extern "C" __constant__ int attn_wg_kv_smem = ATTN_BF16_WG_KV_SMEM;
extern "C" __global__ void __launch_bounds__(ATTN_BF16_KV_THREADS, ATTN_BF16_KV_BLOCKS)
k_attn_bwd_kv_wg(bf16* dqkv, const float* delta, const bf16* dout, const bf16* qkv, const float* lse,
                 int B, int T, int C, int H, float scale, int add, unsigned* amax, int dld, int dplane,
                 unsigned char* e5m2, const float* e5m2_scale, int heads_first) {
    attn_bwd_kv<true>(dqkv, delta, dout, qkv, lse, B, T, C, H, scale,
                      add, amax, dld, dplane, e5m2, e5m2_scale, heads_first);
}
#endif
