#pragma once

// A Gated DeltaNet head's gates, shared by ggml_gdn_gates and ggml_gdn_conv_tree on the CPU and on CUDA (host and
// device): the formulas of ggml's scalar softplus and sigmoid, in the order of the add, softplus, mul and sigmoid
// ops they replace, so that both ops give the same bits on a backend.
#include <math.h>

#if defined(__CUDACC__)
#define GGML_EXT_GATES_HD __host__ __device__ inline
#else
#define GGML_EXT_GATES_HD static inline
#endif

// The log-decay g = softplus(alpha + dt_bias) * a
GGML_EXT_GATES_HD float ggml_ext_gdn_decay(float alpha, float dt_bias, float a) {
    const float x  = alpha + dt_bias;
    const float sp = x > 20.0f ? x : logf(1.0f + expf(x));
    return sp * a;
}

// The write strength sigmoid(beta)
GGML_EXT_GATES_HD float ggml_ext_gdn_beta(float beta) {
    return 1.0f / (1.0f + expf(-beta));
}
