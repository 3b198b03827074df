// The MLP backward's DGELU product on CUTLASS 3's Hopper kernels, as an experiment against cuBLASLt's (an xmma
// kernel whose epilogue does not overlap the next tile's products: docs/PERFORMANCE.md).
//   dpre[N, F] = (dout[N, C] @ W_2[F, C]^T) * GELU'(pre[N, F]),  bf16 in and out, fp32 accumulation
// Both operands K-major (the "TN" layout TMA and wgmma take best); pre is the epilogue's aux input
// (LinCombDeEltAct with CUTLASS's dGELU, the tanh approximation). Built as a shared library by
// dev/cuda/cutlass_dgelu.py (nvcc, CUTLASS's headers from the nvidia-cutlass wheel); every configuration
// is a kernel schedule, CTA tile and cluster, chosen by `config`. Beside it, for reference: the plain product of
// the same operands, and the forward's GELU_AUX product (pre and act written).
#include <cuda_runtime.h>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/operations.hpp"
#include "cutlass/epilogue/thread/activation.h"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"

using namespace cute;

namespace {

using Bf16 = cutlass::bfloat16_t;
using RowMajor = cutlass::layout::RowMajor;
using ColumnMajor = cutlass::layout::ColumnMajor;
constexpr int kAlign = 8;  // bf16 elements in 16 bytes

// D [m, n] (row-major bf16) = Fusion(A [m, k] (row-major) @ B [k, n] (LayoutB)), fp32 accumulation, no C read.
template <class Tile, class Cluster, class MainloopSchedule, class EpilogueSchedule, class Fusion, class LayoutB>
struct Hopper {
    using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
        cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Tile, Cluster,
        cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, RowMajor, kAlign, Bf16, RowMajor, kAlign,
        EpilogueSchedule, Fusion>::CollectiveOp;
    using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
        cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Bf16, RowMajor, kAlign, Bf16, LayoutB, kAlign, float,
        Tile, Cluster,
        cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
        MainloopSchedule>::CollectiveOp;
    using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, Mainloop, Epilogue>;
    using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
    using StrideD = typename Kernel::StrideD;

    static typename Gemm::Arguments arguments(void* d, const void* a, const void* b, int m, int n, int k) {
        auto sa = cutlass::make_cute_packed_stride(typename Kernel::StrideA{}, make_shape(m, k, 1));
        auto sb = cutlass::make_cute_packed_stride(typename Kernel::StrideB{}, make_shape(n, k, 1));
        auto sd = cutlass::make_cute_packed_stride(StrideD{}, make_shape(m, n, 1));
        typename Gemm::Arguments args{
            cutlass::gemm::GemmUniversalMode::kGemm,
            {m, n, k, 1},
            {static_cast<const Bf16*>(a), sa, static_cast<const Bf16*>(b), sb},
            {{}, nullptr, sd, static_cast<Bf16*>(d), sd}};
        args.epilogue.thread.alpha = 1.0f;
        args.epilogue.thread.beta = 0.0f;
        return args;
    }

    // 0: ran; 1: CUTLASS cannot run this shape on it; 2: the workspace is too small; 3: launch failed
    static int run(const typename Gemm::Arguments& args, void* workspace, size_t workspace_bytes, cudaStream_t stream,
                   size_t* needed) {
        Gemm gemm;
        *needed = Gemm::get_workspace_size(args);
        if (gemm.can_implement(args) != cutlass::Status::kSuccess) return 1;
        if (*needed > workspace_bytes) return 2;
        if (gemm.initialize(args, workspace, stream) != cutlass::Status::kSuccess) return 3;
        return gemm.run(stream) == cutlass::Status::kSuccess ? 0 : 3;
    }
};

using Pingpong = cutlass::gemm::KernelTmaWarpSpecializedPingpong;
using Cooperative = cutlass::gemm::KernelTmaWarpSpecializedCooperative;
using EpiPingpong = cutlass::epilogue::TmaWarpSpecialized;
using EpiCooperative = cutlass::epilogue::TmaWarpSpecializedCooperative;
using Tile128 = Shape<_128, _128, _64>;
using Cluster21 = Shape<_2, _1, _1>;
using Cluster12 = Shape<_1, _2, _1>;
using Tile256x128 = Shape<_256, _128, _64>;
using Tile128x256 = Shape<_128, _256, _64>;

// the backward's DGELU product: D = acc * GELU'(aux), aux = pre read
using Dgelu = cutlass::epilogue::fusion::LinCombDeEltAct<RowMajor, cutlass::epilogue::thread::dGELU, Bf16, float, Bf16>;
// the plain product of the same operands (the mainloop's own rate, for reference)
using Plain = cutlass::epilogue::fusion::LinearCombination<Bf16, float>;
// the forward's GELU_AUX product: aux = acc + bias (pre, written), D = GELU(aux) (act); the bias is zeros here
using GeluAux = cutlass::epilogue::fusion::LinCombPerColBiasEltActAux<RowMajor, cutlass::epilogue::thread::GELU_taylor,
                                                                      Bf16, float, Bf16, Bf16>;

template <class P>
int dgelu(void* dpre, const void* dout, const void* w2, const void* pre, int n, int f, int c, void* ws, size_t wsb,
          cudaStream_t s, size_t* needed) {
    auto args = P::arguments(dpre, dout, w2, n, f, c);
    args.epilogue.thread.aux_ptr = static_cast<const Bf16*>(pre);
    args.epilogue.thread.dAux = cutlass::make_cute_packed_stride(typename P::StrideD{}, make_shape(n, f, 1));
    return P::run(args, ws, wsb, s, needed);
}

template <class P>
int plain(void* d, const void* a, const void* b, int m, int n, int k, void* ws, size_t wsb, cudaStream_t s,
          size_t* needed) {
    return P::run(P::arguments(d, a, b, m, n, k), ws, wsb, s, needed);
}

template <class P>
int gelu_aux(void* act, void* pre, const void* inp, const void* w1, const void* zeros, int n, int f, int c, void* ws,
             size_t wsb, cudaStream_t s, size_t* needed) {
    auto args = P::arguments(act, inp, w1, n, f, c);
    args.epilogue.thread.aux_ptr = static_cast<Bf16*>(pre);
    args.epilogue.thread.dAux = cutlass::make_cute_packed_stride(typename P::StrideD{}, make_shape(n, f, 1));
    args.epilogue.thread.bias_ptr = static_cast<const Bf16*>(zeros);
    return P::run(args, ws, wsb, s, needed);
}

}  // namespace

extern "C" int andrea_dgelu_configs() { return 4; }

extern "C" const char* andrea_dgelu_config_name(int config) {
    switch (config) {
        case 0: return "pingpong 128x128x64 cluster 2x1";
        case 1: return "pingpong 128x128x64 cluster 1x2";
        case 2: return "cooperative 256x128x64 cluster 2x1";
        case 3: return "cooperative 128x256x64 cluster 1x2";
        default: return "";
    }
}

// dpre [n, f] = (dout [n, c] @ w2 [f, c]^T) * GELU'(pre [n, f]) on stream; the return code as Hopper::run's, 4
// for an unknown config. `needed` gets the workspace bytes the configuration asks for.
extern "C" int andrea_dgelu(int config, void* dpre, const void* dout, const void* w2, const void* pre, int n, int f,
                            int c, void* workspace, size_t workspace_bytes, void* stream, size_t* needed) {
    auto s = static_cast<cudaStream_t>(stream);
    switch (config) {
        case 0: return dgelu<Hopper<Tile128, Cluster21, Pingpong, EpiPingpong, Dgelu, ColumnMajor>>(
            dpre, dout, w2, pre, n, f, c, workspace, workspace_bytes, s, needed);
        case 1: return dgelu<Hopper<Tile128, Cluster12, Pingpong, EpiPingpong, Dgelu, ColumnMajor>>(
            dpre, dout, w2, pre, n, f, c, workspace, workspace_bytes, s, needed);
        case 2: return dgelu<Hopper<Tile256x128, Cluster21, Cooperative, EpiCooperative, Dgelu, ColumnMajor>>(
            dpre, dout, w2, pre, n, f, c, workspace, workspace_bytes, s, needed);
        case 3: return dgelu<Hopper<Tile128x256, Cluster12, Cooperative, EpiCooperative, Dgelu, ColumnMajor>>(
            dpre, dout, w2, pre, n, f, c, workspace, workspace_bytes, s, needed);
        default: return 4;
    }
}

// The same operands' plain product, D [n, f] = dout @ w2^T (ping-pong 128x128x64, cluster 2x1): the mainloop's rate.
extern "C" int andrea_plain(void* d, const void* dout, const void* w2, int n, int f, int c, void* workspace,
                            size_t workspace_bytes, void* stream, size_t* needed) {
    return plain<Hopper<Tile128, Cluster21, Pingpong, EpiPingpong, Plain, ColumnMajor>>(
        d, dout, w2, n, f, c, workspace, workspace_bytes, static_cast<cudaStream_t>(stream), needed);
}

// The forward's pre [n, f] = inp [n, c] @ w1 [c, f] (+ zeros [f]) and act = GELU(pre) (ping-pong 128x128x64,
// cluster 2x1; w1 row-major, so B is N-major).
extern "C" int andrea_gelu_aux(void* act, void* pre, const void* inp, const void* w1, const void* zeros, int n, int f,
                               int c, void* workspace, size_t workspace_bytes, void* stream, size_t* needed) {
    return gelu_aux<Hopper<Tile128, Cluster21, Pingpong, EpiPingpong, GeluAux, RowMajor>>(
        act, pre, inp, w1, zeros, n, f, c, workspace, workspace_bytes, static_cast<cudaStream_t>(stream), needed);
}
