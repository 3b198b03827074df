// grad_norm: the global L2 norm of the flat gradient, for clipping; grad_scale multiplies in place.
//   partial: partials[i] = sum of g^2 over chunk i (chunk = ceil(n / n_partials)), one block per chunk
//   final:   norm = sqrt(sum of partials), one block
// Both sums run in a fixed order, so the norm has the same bits on every run.
#include "common.cuh"

extern "C" __global__ void k_grad_norm_partial(float* partials, const float* grads, long long n, long long chunk) {
    __shared__ float scratch[WARP_SIZE];
    const long long start = blockIdx.x * chunk;
    const long long end = min(start + chunk, n);
    float sum = 0.0f;
    for (long long i = start + threadIdx.x; i < end; i += blockDim.x) sum += grads[i] * grads[i];
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

extern "C" __global__ void k_grad_scale(float* grads, float scale, long long n) {
    GRID_STRIDE_LOOP(i, n) grads[i] *= scale;
}
