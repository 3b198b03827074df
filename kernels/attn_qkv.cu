// attn_qkv: the Q, K, V projections, three matrix products over one input.
//   forward:  Q = inp @ W_Q,  K = inp @ W_K,  V = inp @ W_V   (qkv is [3, B, T, C])
//   backward: dW_X += inp^T dX,  dinp += dX @ W_X^T   for X in Q, K, V
// Nothing here but products, so the op has no kernel of its own: cuBLAS runs all of it
// (CudaEngine.attn_qkv_fwd / attn_qkv_bwd).
