#pragma once

// CUDA side of ggml_ext: called from ggml-cuda.cu for every op in ggml-ext-ops.def.

#include "common.cuh"

#include <cstdlib>

void ggml_ext_cuda_compute_forward(ggml_backend_cuda_context & ctx, ggml_tensor * dst);
bool ggml_ext_cuda_supports_op(int device, const ggml_tensor * op);

// Lets kernel KERNEL take `smem` bytes of dynamic shared memory on `device`: the attribute is set once per kernel,
// device and larger size (each call is a driver round trip, and launchers run for every product without CUDA graphs)
template <auto KERNEL> static void ggml_ext_cuda_allow_smem(size_t smem, int device) {
    static size_t allowed[GGML_CUDA_MAX_DEVICES] = {};
    if (smem > allowed[device]) {
        CUDA_CHECK(cudaFuncSetAttribute(KERNEL, cudaFuncAttributeMaxDynamicSharedMemorySize, (int) smem));
        allowed[device] = smem;
    }
}

// An on/off switch from the environment (PYDFLASH_*, for A/B runs): `name` unset is `dflt`, else on unless it reads
// as 0
static inline bool ggml_ext_env_switch(const char * name, bool dflt) {
    const char * e = getenv(name);
    return e == nullptr ? dflt : atoi(e) != 0;
}

// whether a pointer allows 16-byte loads and stores
static inline bool aligned16(const void * p) {
    return ((uintptr_t) p) % 16 == 0;
}

// one function per op
void ggml_ext_cuda_ssm_conv_tree(ggml_backend_cuda_context & ctx, ggml_tensor * dst);
bool ggml_ext_cuda_ssm_conv_tree_supported(const ggml_tensor * op);

// GGML_TYPE_TQ3_0 (tq3_0.cu): called from upstream's set_rows, get_rows, cpy, converters and supports_op
bool ggml_ext_cuda_tq3_0_supports_op(const ggml_tensor * op); // SET_ROWS, GET_ROWS, CPY with a TQ3_0 side
void ggml_ext_cuda_tq3_0_set_rows(ggml_backend_cuda_context & ctx, const ggml_tensor * src0, const ggml_tensor * src1,
                                  ggml_tensor * dst);
void ggml_ext_cuda_tq3_0_get_rows(ggml_backend_cuda_context & ctx, const ggml_tensor * src0, const ggml_tensor * src1,
                                  ggml_tensor * dst);
void ggml_ext_cuda_tq3_0_cpy(ggml_backend_cuda_context & ctx, const ggml_tensor * src0, ggml_tensor * src1);
void ggml_ext_cuda_tq3_0_to_fp32(const void * x, float * y, int64_t k, cudaStream_t stream);
void ggml_ext_cuda_tq3_0_to_fp16(const void * x, half * y, int64_t k, cudaStream_t stream);
void ggml_ext_cuda_tq3_0_to_fp32_nc(const void * x, float * y, int64_t ne00, int64_t ne01, int64_t ne02,
                                    int64_t ne03, int64_t s01, int64_t s02, int64_t s03, cudaStream_t stream);
void ggml_ext_cuda_tq3_0_to_fp16_nc(const void * x, half * y, int64_t ne00, int64_t ne01, int64_t ne02,
                                    int64_t ne03, int64_t s01, int64_t s02, int64_t s03, cudaStream_t stream);

// flash attention where ggml_ext has a kernel (fattn_split.cu): upstream's fattn.cu asks first
bool ggml_ext_cuda_fattn_applies(const ggml_tensor * dst);
void ggml_ext_cuda_fattn(ggml_backend_cuda_context & ctx, ggml_tensor * dst);
// ... over TQ3_0 K and V (tq3_0_fattn.cu), and over f16 K and V at a tree verify's sizes (fattn_split.cu)
bool ggml_ext_cuda_fattn_tq3_0_applies(const ggml_tensor * dst);
void ggml_ext_cuda_fattn_tq3_0(ggml_backend_cuda_context & ctx, ggml_tensor * dst);
bool ggml_ext_cuda_fattn_f16_applies(const ggml_tensor * dst);
void ggml_ext_cuda_fattn_f16(ggml_backend_cuda_context & ctx, ggml_tensor * dst);

void ggml_ext_cuda_gated_delta_net_tree(ggml_backend_cuda_context & ctx, ggml_tensor * dst);
void ggml_ext_cuda_gated_delta_net_tree_persist(ggml_backend_cuda_context & ctx, ggml_tensor * dst);
void ggml_ext_cuda_gated_delta_net_tree_steps(ggml_backend_cuda_context & ctx, ggml_tensor * dst);
bool ggml_ext_cuda_gated_delta_net_tree_supported(const ggml_tensor * op);
void ggml_ext_cuda_gated_delta_net_path(ggml_backend_cuda_context & ctx, ggml_tensor * dst);

// ggml_gdn_gates (gdn_gates.cu)
void ggml_ext_cuda_gdn_gates(ggml_backend_cuda_context & ctx, ggml_tensor * dst);

// ggml_qmatmul (qmatmul.cu)
void ggml_ext_cuda_qmatmul(ggml_backend_cuda_context & ctx, ggml_tensor * dst);
bool ggml_ext_cuda_qmatmul_supported(int device, const ggml_tensor * op);
void ggml_ext_cuda_qmatmul_prepare(ggml_backend_cuda_context & ctx, ggml_tensor * dst);
// whether one-column products take the streaming kernel (qmatmul_stream.cuh: Hopper, built for sm_90 or later);
// Python asks through the CUDA registry's proc address "ggml_ext_qmatmul_streams"
bool ggml_ext_cuda_qmatmul_streams(int device);
void ggml_ext_cuda_sample_tokens(ggml_backend_cuda_context & ctx, ggml_tensor * dst);

// ggml_flash_attn_ordered (flash_attn_ordered.cu)
void ggml_ext_cuda_flash_attn_ordered(ggml_backend_cuda_context & ctx, ggml_tensor * dst);
bool ggml_ext_cuda_flash_attn_ordered_supported(const ggml_tensor * op);

// ggml_argmax_first (argmax_first.cu)
void ggml_ext_cuda_argmax_first(ggml_backend_cuda_context & ctx, ggml_tensor * dst);

// ggml_top_k_logp (top_k_logp.cu)
void ggml_ext_cuda_top_k_logp(ggml_backend_cuda_context & ctx, ggml_tensor * dst);
