// loss: tied output projection + softmax cross-entropy, one row of V logits per position.
//   forward:  logits = inp @ wte^T (cuBLAS, written into probs),  probs = softmax(logits),
//             losses[n] = -log(probs[n, targets[n]])
//   backward: dlogits = scale * (probs - onehot(targets)),  dwte += dlogits^T inp,  dinp += dlogits wte
// One block per row; the row's max and sum are block reductions in a fixed order.
#include "common.cuh"

#define LOSS_THREADS 1024

extern "C" __global__ void __launch_bounds__(LOSS_THREADS)
k_loss_fwd(float* losses, float* probs, const int* targets, long long n_rows, int V) {
    __shared__ float scratch[WARP_SIZE];
    const long long row = blockIdx.x;
    float* x = probs + row * V;
    // One pass for max and sum: each thread keeps a running max and a sum rescaled to it.
    float m = NEG_INF, sum = 0.0f;
    for (int j = threadIdx.x; j < V; j += blockDim.x) {
        const float v = x[j];
        if (v > m) {
            sum = sum * expf(m - v) + 1.0f;
            m = v;
        } else {
            sum += expf(v - m);
        }
    }
    const float row_max = block_max(m, scratch);
    const float row_sum = block_sum(sum * expf(m - row_max), scratch);
    const int target = targets[row];
    for (int j = threadIdx.x; j < V; j += blockDim.x) {
        const float p = expf(x[j] - row_max) / row_sum;
        x[j] = p;
        if (j == target) losses[row] = -logf(p);
    }
}

extern "C" __global__ void __launch_bounds__(LOSS_THREADS)
k_loss_bwd(float* dlogits, const float* probs, const int* targets, long long n_rows, int V, float scale) {
    const long long row = blockIdx.x;
    const int target = targets[row];
    const float* p = probs + row * V;
    float* d = dlogits + row * V;
    for (int j = threadIdx.x; j < V; j += blockDim.x) d[j] = (j == target ? p[j] - 1.0f : p[j]) * scale;
}
