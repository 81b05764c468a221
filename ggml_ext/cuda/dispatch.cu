// Routes the ggml_ext ops to their CUDA kernels and says which shapes those kernels take.

#include "ggml-ext-cuda.cuh"
#include "ggml-ext.h"

void ggml_ext_cuda_compute_forward(ggml_backend_cuda_context & ctx, ggml_tensor * dst) {
    switch (dst->op) {
        case GGML_OP_SSM_CONV_TREE: ggml_ext_cuda_ssm_conv_tree(ctx, dst); break;
        case GGML_OP_GATED_DELTA_NET_TREE: ggml_ext_cuda_gated_delta_net_tree(ctx, dst); break;
        case GGML_OP_GATED_DELTA_NET_TREE_PERSIST: ggml_ext_cuda_gated_delta_net_tree_persist(ctx, dst); break;
        case GGML_OP_QMATMUL: ggml_ext_cuda_qmatmul(ctx, dst); break;
        case GGML_OP_SAMPLE_TOKENS: ggml_ext_cuda_sample_tokens(ctx, dst); break;
        case GGML_OP_FLASH_ATTN_ORDERED: ggml_ext_cuda_flash_attn_ordered(ctx, dst); break;
        case GGML_OP_ARGMAX_FIRST: ggml_ext_cuda_argmax_first(ctx, dst); break;
        case GGML_OP_TOP_K_LOGP: ggml_ext_cuda_top_k_logp(ctx, dst); break;
        case GGML_OP_GDN_GATES: ggml_ext_cuda_gdn_gates(ctx, dst); break;
        case GGML_OP_GATED_DELTA_NET_PATH: ggml_ext_cuda_gated_delta_net_path(ctx, dst); break;
        case GGML_OP_GATED_DELTA_NET_TREE_STEPS: ggml_ext_cuda_gated_delta_net_tree_steps(ctx, dst); break;
        case GGML_OP_QMATMUL_PREPARE: ggml_ext_cuda_qmatmul_prepare(ctx, dst); break;
        default: GGML_ABORT("ggml_ext: no CUDA kernel for %s", ggml_op_name(dst->op));
    }
}

bool ggml_ext_cuda_supports_op(int device, const ggml_tensor * op) {
    switch (op->op) {
        case GGML_OP_SSM_CONV_TREE:
            return ggml_ext_cuda_ssm_conv_tree_supported(op);
        case GGML_OP_GATED_DELTA_NET_TREE:
        case GGML_OP_GATED_DELTA_NET_TREE_PERSIST:
        case GGML_OP_GATED_DELTA_NET_TREE_STEPS:
            return ggml_ext_cuda_gated_delta_net_tree_supported(op);
        case GGML_OP_QMATMUL:
            return ggml_ext_cuda_qmatmul_supported(device, op);
        case GGML_OP_QMATMUL_PREPARE:
            return true;
        case GGML_OP_SAMPLE_TOKENS:
            return op->src[0]->ne[0] <= INT32_MAX / 2;
        case GGML_OP_FLASH_ATTN_ORDERED:
            return ggml_ext_cuda_flash_attn_ordered_supported(op);
        case GGML_OP_ARGMAX_FIRST:
            return true;
        case GGML_OP_TOP_K_LOGP:
            return op->src[0]->ne[1] <= 65535;    // rows are the y dimension of its first kernel's grid
        case GGML_OP_GDN_GATES:
            return op->src[0]->ne[0] * op->src[0]->ne[1] <= INT32_MAX / 2;   // the kernel indexes values with int
        case GGML_OP_GATED_DELTA_NET_PATH:
            return op->ne[0] * op->ne[0] <= INT32_MAX && op->ne[2] <= 65535 && op->ne[3] <= 65535;   // grid y, z
        default:
            return false;
    }
}
