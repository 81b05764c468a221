#pragma once

// CUDA side of ggml_ext: called from ggml-cuda.cu for every op in ggml-ext-ops.def.

#include "common.cuh"

void ggml_ext_cuda_compute_forward(ggml_backend_cuda_context & ctx, ggml_tensor * dst);
bool ggml_ext_cuda_supports_op(int device, const ggml_tensor * op);

// one function per op
void ggml_ext_cuda_ssm_conv_tree(ggml_backend_cuda_context & ctx, ggml_tensor * dst);
void ggml_ext_cuda_gated_delta_net_tree(ggml_backend_cuda_context & ctx, ggml_tensor * dst);
void ggml_ext_cuda_gated_delta_net_tree_persist(ggml_backend_cuda_context & ctx, ggml_tensor * dst);
bool ggml_ext_cuda_gated_delta_net_tree_supported(const ggml_tensor * op);
