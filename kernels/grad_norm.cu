// grad_norm: the global L2 norm of the flat gradient (times `scale`), for clipping.
//   partial: partials[i] = sum of (scale g)^2 over chunk i (chunk = ceil(n / n_partials)), one block per chunk;
//            scale g rounded to float32 first, as a pass scaling g in place would store it
//   final:   norm = sqrt(sum of partials), one block
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
