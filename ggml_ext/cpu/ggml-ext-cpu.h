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

// Thread ith of nth's share of n rows, [*r0, *r1): contiguous runs of ceil(n / nth) (empty for the last threads
// when n is small)
static inline void ggml_ext_thread_rows(int64_t n, int ith, int nth, int64_t * r0, int64_t * r1) {
    const int64_t per_thread = (n + nth - 1) / nth;
    *r0 = per_thread * ith;
    *r1 = *r0 + per_thread < n ? *r0 + per_thread : n;
}

// one function per op
void ggml_ext_cpu_ssm_conv_tree(const struct ggml_compute_params * params, struct ggml_tensor * dst);
void ggml_ext_cpu_gated_delta_net_tree(const struct ggml_compute_params * params, struct ggml_tensor * dst);
void ggml_ext_cpu_gated_delta_net_tree_persist(const struct ggml_compute_params * params, struct ggml_tensor * dst);
void ggml_ext_cpu_gated_delta_net_tree_steps(const struct ggml_compute_params * params, struct ggml_tensor * dst);
size_t ggml_ext_cpu_gated_delta_net_tree_work_size(const struct ggml_tensor * node, int n_tasks);
void ggml_ext_cpu_gated_delta_net_path(const struct ggml_compute_params * params, struct ggml_tensor * dst);
size_t ggml_ext_cpu_gated_delta_net_path_work_size(const struct ggml_tensor * node, int n_tasks);
void ggml_ext_cpu_qmatmul(const struct ggml_compute_params * params, struct ggml_tensor * dst);
void ggml_ext_cpu_qmatmul_prepare(const struct ggml_compute_params * params, struct ggml_tensor * dst);
size_t ggml_ext_cpu_qmatmul_work_size(const struct ggml_tensor * node, int n_tasks);
void ggml_ext_cpu_sample_tokens(const struct ggml_compute_params * params, struct ggml_tensor * dst);
size_t ggml_ext_cpu_sample_tokens_work_size(const struct ggml_tensor * node, int n_tasks);
void ggml_ext_cpu_flash_attn_ordered(const struct ggml_compute_params * params, struct ggml_tensor * dst);
size_t ggml_ext_cpu_flash_attn_ordered_work_size(const struct ggml_tensor * node, int n_tasks);
void ggml_ext_cpu_argmax_first(const struct ggml_compute_params * params, struct ggml_tensor * dst);
void ggml_ext_cpu_top_k_logp(const struct ggml_compute_params * params, struct ggml_tensor * dst);
void ggml_ext_cpu_gdn_gates(const struct ggml_compute_params * params, struct ggml_tensor * dst);
// The gates of beta, alpha [H, n] (rows contiguous) into out: g [H, n] then sigmoid(beta) [H, n] (threads split the
// tokens; ggml_gdn_gates, and ggml_gdn_conv_tree after its conv's values)
void ggml_ext_cpu_gdn_gates_into(const struct ggml_compute_params * params, const struct ggml_tensor * beta,
                                 const struct ggml_tensor * alpha, const float * dt_bias, const float * a, float * out);

// CPU type traits of GGML_TYPE_TQ3_0 (vec_dot_type F32: the rotated query stays in full precision)
void ggml_ext_cpu_quantize_row_tq3_0(const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t k);
void ggml_ext_cpu_vec_dot_tq3_0_f32(int n, float * GGML_RESTRICT s, size_t bs, const void * GGML_RESTRICT vx,
                                    size_t bx, const void * GGML_RESTRICT vy, size_t by, int nrc);
void ggml_ext_cpu_dequantize_row_tq3_0(const void * GGML_RESTRICT x, float * GGML_RESTRICT y, int64_t k);

#ifdef __cplusplus
}
#endif
