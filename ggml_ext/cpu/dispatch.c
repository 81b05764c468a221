// Routes the ggml_ext ops to their CPU kernels.

#include "ggml-ext-cpu.h"
#include "ggml-ext.h"
#include "ggml-impl.h"

void ggml_ext_cpu_compute_forward(const struct ggml_compute_params * params, struct ggml_tensor * dst) {
    switch (dst->op) {
        case GGML_OP_SSM_CONV_TREE: ggml_ext_cpu_ssm_conv_tree(params, dst); break;
        case GGML_OP_GATED_DELTA_NET_TREE: ggml_ext_cpu_gated_delta_net_tree(params, dst); break;
        case GGML_OP_GATED_DELTA_NET_TREE_PERSIST: ggml_ext_cpu_gated_delta_net_tree_persist(params, dst); break;
        case GGML_OP_QMATMUL: ggml_ext_cpu_qmatmul(params, dst); break;
        case GGML_OP_SAMPLE_TOKENS: ggml_ext_cpu_sample_tokens(params, dst); break;
        case GGML_OP_FLASH_ATTN_ORDERED: ggml_ext_cpu_flash_attn_ordered(params, dst); break;
        case GGML_OP_ARGMAX_FIRST: ggml_ext_cpu_argmax_first(params, dst); break;
        case GGML_OP_TOP_K_LOGP: ggml_ext_cpu_top_k_logp(params, dst); break;
        case GGML_OP_GDN_GATES: ggml_ext_cpu_gdn_gates(params, dst); break;
        case GGML_OP_GATED_DELTA_NET_PATH: ggml_ext_cpu_gated_delta_net_path(params, dst); break;
        case GGML_OP_GATED_DELTA_NET_TREE_STEPS: ggml_ext_cpu_gated_delta_net_tree_steps(params, dst); break;
        case GGML_OP_QMATMUL_PREPARE: ggml_ext_cpu_qmatmul_prepare(params, dst); break;
        default: GGML_ABORT("ggml_ext: no CPU kernel for %s", ggml_op_name(dst->op));
    }
}

int ggml_ext_cpu_n_tasks(const struct ggml_tensor * node, int n_threads) {
    GGML_UNUSED(node);
    return n_threads;
}

size_t ggml_ext_cpu_work_size(const struct ggml_tensor * node, int n_tasks) {
    switch (node->op) {
        case GGML_OP_GATED_DELTA_NET_TREE:
        case GGML_OP_GATED_DELTA_NET_TREE_PERSIST:
        case GGML_OP_GATED_DELTA_NET_TREE_STEPS:
            return ggml_ext_cpu_gated_delta_net_tree_work_size(node, n_tasks);
        case GGML_OP_GATED_DELTA_NET_PATH:
            return ggml_ext_cpu_gated_delta_net_path_work_size(node, n_tasks);
        case GGML_OP_QMATMUL:
            return ggml_ext_cpu_qmatmul_work_size(node, n_tasks);
        case GGML_OP_QMATMUL_PREPARE:   // a normed column per thread
            return (size_t) n_tasks * (node->src[0]->ne[0] + 16) * sizeof(float);
        case GGML_OP_SAMPLE_TOKENS:
            return ggml_ext_cpu_sample_tokens_work_size(node, n_tasks);
        case GGML_OP_FLASH_ATTN_ORDERED:
            return ggml_ext_cpu_flash_attn_ordered_work_size(node, n_tasks);
        default:
            return 0;
    }
}
