// Routes the ggml_ext ops to their CPU kernels.

#include "ggml-ext-cpu.h"
#include "ggml-ext.h"
#include "ggml-impl.h"

void ggml_ext_cpu_compute_forward(const struct ggml_compute_params * params, struct ggml_tensor * dst) {
    switch (dst->op) {
        case GGML_OP_SSM_CONV_TREE: ggml_ext_cpu_ssm_conv_tree(params, dst); break;
        default: GGML_ABORT("ggml_ext: no CPU kernel for %s", ggml_op_name(dst->op));
    }
}

int ggml_ext_cpu_n_tasks(const struct ggml_tensor * node, int n_threads) {
    GGML_UNUSED(node);
    return n_threads;
}

size_t ggml_ext_cpu_work_size(const struct ggml_tensor * node, int n_tasks) {
    GGML_UNUSED(node);
    GGML_UNUSED(n_tasks);
    return 0;
}
