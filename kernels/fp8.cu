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
// Blocks an SM the casts' registers are bounded for (all of a thread's loads are in flight at once: the more blocks,
// the more bytes in flight an SM): k_fp8_cast 8 (32 registers), k_fp8_cast_dgelu 6 (40)
#define FP8_CAST_BLOCKS 8
#define FP8_DGELU_BLOCKS 6

// This thread's share of the largest |x[j]| over [begin, end), begin a whole number of ACT_VEC groups: lane `lane`
// of `lanes` takes 16-byte groups in turn where x is 16-byte aligned, then the rest one element at a time. NaN is
// passed over here and shows in the cast's output.
__device__ __forceinline__ float amax_span(const act_t* __restrict__ x, long long begin, long long end, long long lane,
                                           long long lanes) {
    float m = 0.0f;
    long long tail = begin;
    if ((reinterpret_cast<size_t>(x) % 16) == 0) {
        tail = begin + (end - begin) / ACT_VEC * ACT_VEC;
        for (long long j = begin + lane * ACT_VEC; j < tail; j += lanes * ACT_VEC) {
            float v[ACT_VEC];
            load_vec(x + j, v);
#pragma unroll
            for (int k = 0; k < ACT_VEC; k++) m = fmaxf(m, fabsf(v[k]));
        }
    }
    for (long long j = tail + lane; j < end; j += lanes) m = fmaxf(m, fabsf(to_f32(x[j])));
    return m;
}

// amax of n activations into *amax (block_amax, kernels/common.cuh; the launcher clears it), grid-stride.
extern "C" __global__ void __launch_bounds__(FP8_AMAX_THREADS) k_fp8_amax(unsigned int* amax, const act_t* __restrict__ x,
                                                                          long long n) {
    const long long lanes = static_cast<long long>(gridDim.x) * blockDim.x;
    // the values are stored ones already: as_stored leaves them as they are
    block_amax(amax, amax_span(x, 0, n, blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x, lanes));
}

// 8 activations of a tile row from column c (zeros past rows or cols): one 16-byte load where all 8 are in bounds
// and aligned.
__device__ __forceinline__ void load8(const act_t* row, int r, int rows, int c, int cols, bool whole, bool vec,
                                      float (&v)[8]) {
#ifdef ACT_LOWP
    if (whole && vec) {
        load_vec(row + c, v);
        return;
    }
#endif
    for (int j = 0; j < 8; ++j) v[j] = (r < rows && c + j < cols) ? to_f32(row[c + j]) : 0.0f;
}

// The 64 x 64 tile (tx, ty) of batch z of a cast (k_fp8_cast's arguments) with the scale 2^e; the tile (0, 0, 0)
// writes the descale. DGELU (k_fp8_cast_dgelu): x holds dout @ W_2^T, multiplied here by gelu_grad(pre) and
// rounded as k_mlp_bwd stores it (stored back where `store`) before the cast, which casts the rounded values.
template <bool DGELU>
__device__ __forceinline__ void cast_tile(unsigned char* q, long long ldq, long long q_batch, unsigned char* qt, long long ldqt,
                                          long long qt_batch, float* descale, int e, act_t* x, const act_t* pre,
                                          int rows, int cols, int e5m2, int tx, int ty, long long z, bool store = false) {
    __shared__ unsigned char tile[FP8_TILE][FP8_TILE + 8];  // [row][col]; 8 bytes of pad a row
    const float s = __int_as_float((e + 127) << 23);
    if (tx == 0 && ty == 0 && z == 0 && threadIdx.x == 0) *descale = __int_as_float((127 - e) << 23);
    x += z * rows * static_cast<long long>(cols);
    const int r0 = ty * FP8_TILE, c0 = tx * FP8_TILE;
    const int cv = (threadIdx.x % 8) * 8;  // this thread's 8 columns of a tile row
    constexpr int PASSES = FP8_TILE / 32;
    const bool vec = (cols % 8) == 0 && (reinterpret_cast<size_t>(x) % 16) == 0 &&
                     (!DGELU || (reinterpret_cast<size_t>(pre) % 16) == 0);
#ifdef ACT_LOWP
    // Every pass's 16-byte loads issued before the first is used, held as loaded (4 registers each, not 8 floats):
    // more bytes in flight a thread at the same blocks an SM.
    uint4 raw[PASSES], raw_pre[PASSES];
#pragma unroll
    for (int pass = 0; pass < PASSES; ++pass) {
        const int r = r0 + pass * 32 + threadIdx.x / 8;
        if (vec && r < rows && c0 + cv + 8 <= cols) {
            const long long at = r * static_cast<long long>(cols) + c0 + cv;
            raw[pass] = *reinterpret_cast<const uint4*>(x + at);
            if (DGELU) raw_pre[pass] = *reinterpret_cast<const uint4*>(pre + at);
        }
    }
#endif
#pragma unroll
    for (int pass = 0; pass < PASSES; ++pass) {
        const int tr = pass * 32 + threadIdx.x / 8;
        const int r = r0 + tr;
        act_t* row = x + r * static_cast<long long>(cols);
        const bool whole = r < rows && c0 + cv + 8 <= cols;  // all 8 in bounds
        float v[8];
#ifdef ACT_LOWP
        if (whole && vec) unpack_vec(raw[pass], v);
        else
#endif
            load8(row, r, rows, c0 + cv, cols, whole, vec, v);
        if (DGELU) {
            float p[8];
#ifdef ACT_LOWP
            if (whole && vec) unpack_vec(raw_pre[pass], p);
            else
#endif
                load8(pre + (row - x), r, rows, c0 + cv, cols, whole, vec, p);
#pragma unroll
            for (int j = 0; j < 8; ++j) v[j] = as_stored(v[j] * gelu_grad(p[j]));
            if (store) {
#ifdef ACT_LOWP
                if (whole && vec) store_vec(row + c0 + cv, v);
                else
#endif
                    for (int j = 0; j < 8; ++j)
                        if (r < rows && c0 + cv + j < cols) ::store(row + c0 + cv + j, v[j]);
            }
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

// Cast x [batch, rows, cols] (row-major) to FP8 with the scale of *amax: q[z] (row-major, leading
// dimension ldq, batch z at q + z * q_batch) and/or its transpose qt[z] ([cols, rows], leading dimension
// ldqt, at qt + z * qt_batch); a null q or qt is not written. The block at (0, 0, 0) writes 1 / s to
// *descale. Grid: (ceil(cols / 64), ceil(rows / 64), batch).
extern "C" __global__ void __launch_bounds__(FP8_THREADS, FP8_CAST_BLOCKS)
k_fp8_cast(unsigned char* q, long long ldq, long long q_batch, unsigned char* qt, long long ldqt, long long qt_batch,
           float* descale, const unsigned int* amax, const act_t* __restrict__ x, int rows, int cols, int e5m2) {
    cast_tile<false>(q, ldq, q_batch, qt, ldqt, qt_batch, descale, fp8_scale_exponent(*amax, e5m2 ? 15 : 8),
                     const_cast<act_t*>(x), nullptr, rows, cols, e5m2, blockIdx.x, blockIdx.y, blockIdx.z);
}

// The MLP backward's gradient at pre under precision fp8 (andrea/ops/mlp.py): dpre [rows, cols] holds dout @ W_2^T;
// dpre * GELU'(pre) is cast to E5M2 into q and qt (leading dimensions cols and rows) and, where `store`, stored
// into dpre, all in one pass. Its amax is not known before the pass, so the scale is that of a bound of it
// instead, a function of the product's operands: |dout @ W_2^T| <= C * (57344 * dout's descale) * (448 * W_2's
// descale), and |GELU'| below 1.25; `factor` = C * 57344 * 448 * 1.25 in float (ops/fp8.py dgelu_amax, the
// reference). Writes 1 / s to *descale.
extern "C" __global__ void __launch_bounds__(FP8_THREADS, FP8_DGELU_BLOCKS)
k_fp8_cast_dgelu(unsigned char* q, unsigned char* qt, float* descale, act_t* dpre, const act_t* __restrict__ pre,
                 int rows, int cols, const float* dout_descale, const float* w_descale, float factor, int store) {
    const float bound = factor * *dout_descale * *w_descale;
    cast_tile<true>(q, cols, 0, qt, rows, 0, descale, fp8_scale_exponent(__float_as_uint(bound), 15), dpre, pre, rows,
                    cols, 1, blockIdx.x, blockIdx.y, 0, store != 0);
}

// ---- tensors under delayed scaling (andrea/ops/fp8.py: the histories) ----
// Inside a training pass the MLP's up product writes act = GELU(pre) in E4M3 itself, and the attention backward
// writes dqkv in E5M2 itself (kernels/attn_bf16.cu), each at a scale known before it runs: the largest power of two
// that fits the largest amax of the layer's last FP8_HIST_PASSES passes. A layer's row of FP8_HIST_ROW floats (one
// for act, one for dqkv) holds, at these offsets:
#define FP8_HIST_PASSES 16      // passes in the history
#define FP8_HIST_ROW 32         // floats of a layer's row (16-byte aligned fields: cuBLASLt's scale pointers)
#define FP8_HIST_SCALE 0        // s of the next pass (the producer's scale)
#define FP8_HIST_SCALE_NOW 4    // s of this pass (a recompute's D scale)
#define FP8_HIST_DESCALE_NOW 8  // 1 / s of this pass (the products that read the tensor)
#define FP8_HIST_AMAX 12        // this pass's amax (act's AMAX_D; dqkv's kernels' atomic max); 0 after a fold
#define FP8_HIST_AT 13          // where the history takes the next amax (a float, 0 .. FP8_HIST_PASSES - 1)
#define FP8_HIST_PAST 16        // the history: FP8_HIST_PASSES amaxes

// The pass's producer is done: its scale becomes this pass's, its amax goes into the history (the word back to 0 for
// the next pass's atomic max), and the next pass's scale is that of the history's largest for the format whose
// largest value is 1.75 * 2^emax (NaN passed over). One thread.
__device__ __forceinline__ void history_fold(float* row, int emax) {
    const float s = row[FP8_HIST_SCALE];
    const int e = static_cast<int>((__float_as_uint(s) >> 23) & 0xffu) - 127;
    row[FP8_HIST_SCALE_NOW] = s;
    row[FP8_HIST_DESCALE_NOW] = __int_as_float((127 - e) << 23);
    const int at = static_cast<int>(row[FP8_HIST_AT]);
    row[FP8_HIST_PAST + at] = row[FP8_HIST_AMAX];
    row[FP8_HIST_AMAX] = 0.0f;
    row[FP8_HIST_AT] = static_cast<float>((at + 1) % FP8_HIST_PASSES);
    float m = 0.0f;
    for (int k = 0; k < FP8_HIST_PASSES; ++k) m = fmaxf(m, row[FP8_HIST_PAST + k]);
    row[FP8_HIST_SCALE] = __int_as_float((fp8_scale_exponent(__float_as_uint(m), emax) + 127) << 23);
}

// FP8 bytes q [rows, cols] transposed into qt [cols, rows] (act's for dW_2 = act^T dY, dqkv's for dW_QKV: K-major),
// FP8_ACT_T_SUB tiles of 64 x 64 stacked along the rows a block, every tile's loads issued before the first is stored
// (a lone 4 KB tile a block left its SM waiting on launches and single loads); with `fold_emax` (the format's: 8
// E4M3, 15 E5M2; 0 none) the block (0, 0) folds the pass into its row (history_fold) first. A null qt: the fold alone
// (grid 1). Grid: (ceil(cols / 64), ceil(rows / (64 x FP8_ACT_T_SUB))).
#define FP8_ACT_T_SUB 4
extern "C" __global__ void __launch_bounds__(FP8_THREADS)
k_fp8_act_t(const unsigned char* __restrict__ q, unsigned char* __restrict__ qt, int rows, int cols, float* row,
            int fold_emax) {
    if (fold_emax && blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) history_fold(row, fold_emax);
    if (qt == nullptr) return;
    __shared__ unsigned tile[FP8_ACT_T_SUB * FP8_TILE][FP8_TILE / 4 + 1];  // [row][4 columns a word]; a word of pad
    const int r0 = blockIdx.y * FP8_ACT_T_SUB * FP8_TILE, c0 = blockIdx.x * FP8_TILE;
    const int part = threadIdx.x % 4, line = threadIdx.x / 4;  // 16 bytes a thread: a quarter of a tile line
    const int c = c0 + part * 16;
    const bool vec = c + 16 <= cols && (cols % 16) == 0 && (reinterpret_cast<size_t>(q) % 16) == 0;
    uint4 v[FP8_ACT_T_SUB];
#pragma unroll
    for (int k = 0; k < FP8_ACT_T_SUB; ++k) {
        const int r = r0 + k * FP8_TILE + line;
        if (vec && r < rows) v[k] = *reinterpret_cast<const uint4*>(q + static_cast<long long>(r) * cols + c);
    }
#pragma unroll
    for (int k = 0; k < FP8_ACT_T_SUB; ++k) {
        const int tr = k * FP8_TILE + line, r = r0 + tr;
        if (vec && r < rows) {
            tile[tr][part * 4] = v[k].x;
            tile[tr][part * 4 + 1] = v[k].y;
            tile[tr][part * 4 + 2] = v[k].z;
            tile[tr][part * 4 + 3] = v[k].w;
        } else {
            for (int w = 0; w < 4; ++w) {
                unsigned word = 0;
                for (int j = 0; j < 4; ++j) {
                    const int cj = c + 4 * w + j;
                    if (r < rows && cj < cols) word |= static_cast<unsigned>(q[static_cast<long long>(r) * cols + cj]) << (8 * j);
                }
                tile[tr][part * 4 + w] = word;
            }
        }
    }
    __syncthreads();
    // qt's row c0 + line, columns r0 + 64 k + part * 16 ..: the bytes of tile column `line`, rows 64 k + part * 16 ..
    const int out_row = c0 + line;
    if (out_row >= cols) return;
    const bool vec_out = (rows % 16) == 0 && (reinterpret_cast<size_t>(qt) % 16) == 0;
#pragma unroll
    for (int k = 0; k < FP8_ACT_T_SUB; ++k) {
        const int out_col = r0 + k * FP8_TILE + part * 16;
        if (out_col >= rows) break;
        unsigned words[4];
        for (int w = 0; w < 4; ++w) {
            unsigned word = 0;
            for (int j = 0; j < 4; ++j) {
                const unsigned b = (tile[k * FP8_TILE + part * 16 + 4 * w + j][line / 4] >> (8 * (line % 4))) & 0xffu;
                word |= b << (8 * j);
            }
            words[w] = word;
        }
        unsigned char* out = qt + static_cast<long long>(out_row) * rows + out_col;
        if (vec_out && out_col + 16 <= rows) {
            *reinterpret_cast<uint4*>(out) = make_uint4(words[0], words[1], words[2], words[3]);
        } else {
            for (int j = 0; j < 16; ++j)
                if (out_col + j < rows) out[j] = static_cast<unsigned char>((words[j / 4] >> (8 * (j % 4))) & 0xffu);
        }
    }
}

// ---- many matrices in one launch (the model's weight copies, andrea/ops/fp8.py prepare_fp8_weights) ----
// A table of n matrices, FP8_TABLE_WORDS int64 words each: x, rows, cols, batch, q, ldq, q_batch, qt, ldqt, qt_batch,
// slot (4 floats: the descale first, then the fields below), the matrix's first amax chunk, its first cast tile, then
// the amax ranges k_adamw reads (kernels/adamw.cu; ops/fp8.py writes them). A block finds its matrix by those firsts
// (ascending).
#define FP8_TABLE_WORDS 16
#define FP8_SLOT_AMAX 1   // a slot's amax word (float bits)
#define FP8_SLOT_TAKEN 2  // its flag, the float after the amax word: k_adamw took the amax (1), or not (0)
#define FP8_MANY_CHUNK 8192  // activations of one amax chunk (32 a thread)

__device__ __forceinline__ int table_find(const long long* table, int n, int column, long long b) {
    int lo = 0, hi = n - 1;  // the last entry whose first block (chunk, tile) is <= b
    while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (table[mid * FP8_TABLE_WORDS + column] <= b) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}

// Each matrix's amax into its slot's amax word (zero before the launch): a block per FP8_AMAX_MANY_CHUNKS chunks of
// FP8_MANY_CHUNK activations, `chunks` in all. A matrix whose slot flag is set (the float after the amax word) already
// has it: AdamW took it as it wrote x (every step but the first after a load), so a block mostly reads flags; a
// chunk's flag is read by the whole block, so its loop and block_amax's barriers stay uniform.
#define FP8_AMAX_MANY_CHUNKS 16
extern "C" __global__ void __launch_bounds__(FP8_AMAX_THREADS) k_fp8_amax_many(const long long* __restrict__ table, int n,
                                                                            long long chunks) {
    const long long first = blockIdx.x * static_cast<long long>(FP8_AMAX_MANY_CHUNKS);
    for (long long c = first; c < min(chunks, first + FP8_AMAX_MANY_CHUNKS); c++) {
        const int i = table_find(table, n, 11, c);
        const long long* t = table + i * FP8_TABLE_WORDS;
        if (reinterpret_cast<const float*>(t[10])[FP8_SLOT_TAKEN] != 0.0f) continue;
        const act_t* x = reinterpret_cast<const act_t*>(t[0]);
        const long long size = t[1] * t[2] * t[3];
        const long long begin = (c - t[11]) * static_cast<long long>(FP8_MANY_CHUNK);
        const long long end = min(size, begin + FP8_MANY_CHUNK);
        block_amax(reinterpret_cast<unsigned*>(reinterpret_cast<float*>(t[10]) + FP8_SLOT_AMAX),
                   amax_span(x, begin, end, threadIdx.x, blockDim.x));
    }
}

// Each matrix cast with its slot's amax: a block per 64 x 64 tile of each batch of each matrix.
extern "C" __global__ void __launch_bounds__(FP8_THREADS) k_fp8_cast_many(const long long* __restrict__ table, int n) {
    const int i = table_find(table, n, 12, blockIdx.x);
    const long long* t = table + i * FP8_TABLE_WORDS;
    const int rows = static_cast<int>(t[1]), cols = static_cast<int>(t[2]);
    const long long tiles_x = (cols + FP8_TILE - 1) / FP8_TILE, tiles_y = (rows + FP8_TILE - 1) / FP8_TILE;
    const long long local = blockIdx.x - t[12];
    float* slot = reinterpret_cast<float*>(t[10]);
    cast_tile<false>(reinterpret_cast<unsigned char*>(t[4]), t[5], t[6], reinterpret_cast<unsigned char*>(t[7]), t[8], t[9],
                     slot, fp8_scale_exponent(*reinterpret_cast<const unsigned*>(slot + FP8_SLOT_AMAX), 8),
                     reinterpret_cast<act_t*>(t[0]), nullptr, rows, cols, 0, static_cast<int>(local % tiles_x),
                     static_cast<int>(local / tiles_x % tiles_y), local / (tiles_x * tiles_y));
}
