#pragma once

// CPU side of ggml_ext: called from ggml-cpu.c for every op in ggml-ext-ops.def.

#include "ggml.h"

#ifdef __cplusplus
extern "C" {
#endif

struct ggml_compute_params;

void   ggml_ext_cpu_compute_forward(const struct ggml_compute_params * params, struct ggml_tensor * dst);
int    ggml_ext_cpu_n_tasks(const struct ggml_tensor * node, int n_threads);
size_t ggml_ext_cpu_work_size(const struct ggml_tensor * node, int n_tasks);

// one function per op
void ggml_ext_cpu_ssm_conv_tree(const struct ggml_compute_params * params, struct ggml_tensor * dst);
void ggml_ext_cpu_gated_delta_net_tree(const struct ggml_compute_params * params, struct ggml_tensor * dst);
void ggml_ext_cpu_gated_delta_net_tree_persist(const struct ggml_compute_params * params, struct ggml_tensor * dst);
size_t ggml_ext_cpu_gated_delta_net_tree_work_size(const struct ggml_tensor * node, int n_tasks);

#ifdef __cplusplus
}
#endif
