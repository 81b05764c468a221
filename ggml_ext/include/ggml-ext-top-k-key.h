// The total order of ggml_top_k_logp as one 64-bit key per logit, shared by its CPU and CUDA kernels so that
// both pick exactly the same ids: a larger key ranks first. High 32 bits: the float mapped to an unsigned
// integer of the same order (-0 and subnormals folded into +0, NaN to 0, below -inf); low 32 bits: ~id, so a
// lower id wins between equal logits. Key 0 belongs to no logit (ids are < 2^24) and marks an empty slot.
#pragma once

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#ifdef __CUDACC__
#define GGML_EXT_TOPK_FN static __host__ __device__ __forceinline__
#else
#define GGML_EXT_TOPK_FN static inline
#endif

GGML_EXT_TOPK_FN uint64_t ggml_ext_top_k_key(float v, uint32_t id) {
    uint32_t bits;
    if (fabsf(v) < FLT_MIN) {
        v = 0.0f;              // -0, +0 and subnormals: one key (CUDA's flush-to-zero compares subnormals as 0)
    }
    memcpy(&bits, &v, sizeof(bits));
    uint32_t ordered;
    if (v != v) {
        ordered = 0;           // NaN: below every number
    } else {
        ordered = (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
    }
    return ((uint64_t) ordered << 32) | (uint32_t) ~id;
}

GGML_EXT_TOPK_FN uint32_t ggml_ext_top_k_key_id(uint64_t key) {
    return ~(uint32_t) key;
}
