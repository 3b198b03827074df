// The MLP backward's DGELU product on CUTLASS 3's Hopper kernels, as an experiment against cuBLASLt's (an xmma
// kernel whose epilogue does not overlap the next tile's products: docs/PERFORMANCE.md).
//   dpre[N, F] = (dout[N, C] @ W_2[F, C]^T) * GELU'(pre[N, F]),  bf16 in and out, fp32 accumulation
// Both operands K-major (the "TN" layout TMA and wgmma take best); pre is the epilogue's aux input
// (LinCombDeEltAct with CUTLASS's dGELU, the tanh approximation). Built as a shared library by
// dev/cuda/cutlass_dgelu.py (nvcc, CUTLASS's headers from the nvidia-cutlass wheel); every configuration
// is a kernel schedule, CTA tile and cluster, chosen by `config`.
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

template <class Tile, class Cluster, class MainloopSchedule, class EpilogueSchedule>
struct DgeluGemm {
    using Fusion = cutlass::epilogue::fusion::LinCombDeEltAct<RowMajor, cutlass::epilogue::thread::dGELU, Bf16, float,
                                                              Bf16>;
    using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
        cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Tile, Cluster,
        cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, RowMajor, kAlign, Bf16, RowMajor, kAlign,
        EpilogueSchedule, Fusion>::CollectiveOp;
    using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
        cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Bf16, RowMajor, kAlign, Bf16, ColumnMajor, kAlign, float,
        Tile, Cluster,
        cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
        MainloopSchedule>::CollectiveOp;
    using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, Mainloop, Epilogue>;
    using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

    static typename Gemm::Arguments arguments(void* dpre, const void* dout, const void* w2, const void* pre, int n,
                                              int f, int c) {
        using K = typename Gemm::GemmKernel;
        auto sa = cutlass::make_cute_packed_stride(typename K::StrideA{}, make_shape(n, c, 1));
        auto sb = cutlass::make_cute_packed_stride(typename K::StrideB{}, make_shape(f, c, 1));
        auto sd = cutlass::make_cute_packed_stride(typename K::StrideD{}, make_shape(n, f, 1));
        typename Gemm::Arguments args{
            cutlass::gemm::GemmUniversalMode::kGemm,
            {n, f, c, 1},
            {static_cast<const Bf16*>(dout), sa, static_cast<const Bf16*>(w2), sb},
            {{}, nullptr, sd, static_cast<Bf16*>(dpre), sd}};
        args.epilogue.thread.alpha = 1.0f;
        args.epilogue.thread.beta = 0.0f;
        args.epilogue.thread.aux_ptr = static_cast<const Bf16*>(pre);
        args.epilogue.thread.dAux = sd;
        return args;
    }

    // 0: ran; 1: CUTLASS cannot run this shape on it; 2: the workspace is too small; 3: launch failed
    static int run(void* dpre, const void* dout, const void* w2, const void* pre, int n, int f, int c, void* workspace,
                   size_t workspace_bytes, cudaStream_t stream, size_t* needed) {
        auto args = arguments(dpre, dout, w2, pre, n, f, c);
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

using Config0 = DgeluGemm<Shape<_128, _128, _64>, Shape<_2, _1, _1>, Pingpong, EpiPingpong>;
using Config1 = DgeluGemm<Shape<_128, _128, _64>, Shape<_1, _2, _1>, Pingpong, EpiPingpong>;
using Config2 = DgeluGemm<Shape<_256, _128, _64>, Shape<_2, _1, _1>, Cooperative, EpiCooperative>;
using Config3 = DgeluGemm<Shape<_128, _256, _64>, Shape<_1, _2, _1>, Cooperative, EpiCooperative>;

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

// dpre [n, f] = (dout [n, c] @ w2 [f, c]^T) * GELU'(pre [n, f]) on stream; the return code as DgeluGemm::run's, 4
// for an unknown config. `needed` gets the workspace bytes the configuration asks for.
extern "C" int andrea_dgelu(int config, void* dpre, const void* dout, const void* w2, const void* pre, int n, int f,
                            int c, void* workspace, size_t workspace_bytes, void* stream, size_t* needed) {
    auto s = static_cast<cudaStream_t>(stream);
    switch (config) {
        case 0: return Config0::run(dpre, dout, w2, pre, n, f, c, workspace, workspace_bytes, s, needed);
        case 1: return Config1::run(dpre, dout, w2, pre, n, f, c, workspace, workspace_bytes, s, needed);
        case 2: return Config2::run(dpre, dout, w2, pre, n, f, c, workspace, workspace_bytes, s, needed);
        case 3: return Config3::run(dpre, dout, w2, pre, n, f, c, workspace, workspace_bytes, s, needed);
        default: return 4;
    }
}
