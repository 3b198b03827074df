// grad_norm: the global L2 norm of the flat gradient (times `scale`), for clipping.
//   partial: partials[i] = sum of (scale g)^2 over chunk i (chunk = ceil(n / n_partials)), one block per chunk;
//            scale g rounded to float32 first, as a pass scaling g in place would store it
//   final:   norm = sqrt(sum of partials), one block
//   gate:    the step's clipping scale and whether the step updates, from the norm and the micro-batches' loss
//            sums, on the device: AdamW reads them there, so the host waits for nothing before it launches the update
// Both sums run in a fixed order, so the norm has the same bits on every run.
#include "common.cuh"

extern "C" __global__ void k_grad_norm_partial(float* partials, const float* grads, float scale, long long n,
                                               long long chunk) {
    __shared__ float scratch[WARP_SIZE];
    const long long start = blockIdx.x * chunk;
    const long long end = min(start + chunk, n);
    float sum = 0.0f;
    for (long long i = start + threadIdx.x; i < end; i += blockDim.x) {
        const float g = __fmul_rn(grads[i], scale);  // not contracted into the sum: the value a scaling pass stores
        sum += g * g;
    }
    sum = block_sum(sum, scratch);
    if (threadIdx.x == 0) partials[blockIdx.x] = sum;
}

extern "C" __global__ void k_grad_norm_final(float* norm, const float* partials, int n_partials) {
    __shared__ float scratch[WARP_SIZE];
    float sum = 0.0f;
    for (int i = threadIdx.x; i < n_partials; i += blockDim.x) sum += partials[i];
    sum = block_sum(sum, scratch);
    if (threadIdx.x == 0) norm[0] = sqrtf(sum);
}

// gate[0] = clip / (norm + 1e-6) where clip > 0 and norm > clip, else 1 (in double, rounded once: the host's
// arithmetic on the float norm); gate[1] = 1 where the norm and every micro-batch's loss sum (sums[2 i]) are
// finite, else 0: AdamW then leaves the weights and moments as they are (a non-finite step makes no update).
extern "C" __global__ void k_grad_gate(float* gate, const float* norm, const double* sums, int n_sums, double clip) {
    int finite = 1;
    for (int i = threadIdx.x; i < n_sums; i += blockDim.x) finite &= isfinite(sums[2 * i]) ? 1 : 0;
    finite = __syncthreads_and(finite);
    if (threadIdx.x == 0) {
        const double g = static_cast<double>(norm[0]);
        gate[0] = clip > 0.0 && g > clip ? __double2float_rn(clip / (g + 1e-6)) : 1.0f;
        gate[1] = finite && isfinite(g) ? 1.0f : 0.0f;
    }
}
