// attn_out: the W_O projection of the attention output, one matrix product.
//   forward:  out = inp @ W_O
//   backward: dW_O += inp^T dout,  dinp += dout @ W_O^T
// Nothing here but products, so the op has no kernel of its own: cuBLAS runs all of it
// (CudaEngine.attn_out_fwd / attn_out_bwd).
