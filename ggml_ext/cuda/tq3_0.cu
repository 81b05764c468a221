// GGML_TYPE_TQ3_0 on CUDA (format in ggml-ext.h): quantise on write (set_rows, cpy), dequantise (get_rows, cpy,
// the to_fp16/to_fp32 converters that the flash-attention prefill path uses for its f16 tiles) and a decode
// flash-attention kernel that reads the blocks directly.
//
// One warp quantises one 128-value group: lane l holds values l, l+32, l+64, l+96, so the FWHT stages of
// stride < 32 are warp shuffles and the two larger ones stay in registers, and sub-block r is exactly
// register r of the 32 lanes (its reductions are warp reductions, its high bits one ballot).

#include "ggml-ext-cuda.cuh"
#include "ggml-ext.h"

#include <cuda_fp16.h>

static __constant__ float    tq3_0_levels_dev[8] = TQ3_0_LEVELS_INIT;
static __constant__ uint32_t tq3_0_signs1_dev[4] = TQ3_0_SIGNS1_INIT;
static __constant__ uint32_t tq3_0_signs2_dev[4] = TQ3_0_SIGNS2_INIT;

#define TQ3_0_SUBS (TQ3_0_GROUP / TQ3_0_QK) // sub-blocks per group

static __device__ __forceinline__ int tq3_0_index(const block_tq3_0 & b, const int j) {
    return ((b.qs[j % 8] >> (2*(j / 8))) & 3) | (((b.qh[j / 8] >> (j % 8)) & 1) << 2);
}

// --- quantise ------------------------------------------------------------------------------------------------

template <typename src_t>
static __device__ __forceinline__ float tq3_0_load(const src_t * p) {
    if constexpr (std::is_same_v<src_t, half>) {
        return __half2float(*p);
    } else {
        return *p;
    }
}

// Quantise the 128 values at src (lane l passes its four) into the 4 sub-blocks at dst. Whole warp.
static __device__ void tq3_0_quantize_group_warp(float v[TQ3_0_SUBS], block_tq3_0 * dst, const int lane) {
    // sign flips, FWHT, sign flips, 1/sqrt(128)
#pragma unroll
    for (int r = 0; r < TQ3_0_SUBS; ++r) {
        const int i = lane + 32*r;
        if ((tq3_0_signs1_dev[i / 32] >> (i % 32)) & 1) {
            v[r] = -v[r];
        }
    }
#pragma unroll
    for (int len = 1; len < 32; len <<= 1) {
#pragma unroll
        for (int r = 0; r < TQ3_0_SUBS; ++r) {
            const float other = __shfl_xor_sync(0xffffffff, v[r], len);
            v[r] = (lane & len) ? other - v[r] : v[r] + other;
        }
    }
    {   // stride 32: registers (0,1), (2,3); stride 64: (0,2), (1,3)
        float a = v[0], b = v[1], c = v[2], d = v[3];
        v[0] = a + b; v[1] = a - b; v[2] = c + d; v[3] = c - d;
        a = v[0]; b = v[1]; c = v[2]; d = v[3];
        v[0] = a + c; v[2] = a - c; v[1] = b + d; v[3] = b - d;
    }
#pragma unroll
    for (int r = 0; r < TQ3_0_SUBS; ++r) {
        const int i = lane + 32*r;
        v[r] *= 0.08838834764831845f;
        if ((tq3_0_signs2_dev[i / 32] >> (i % 32)) & 1) {
            v[r] = -v[r];
        }
    }

#pragma unroll
    for (int r = 0; r < TQ3_0_SUBS; ++r) {
        const float sumsq = warp_reduce_sum(v[r]*v[r]);
        int idx = 0;
        float lev = 0.0f;
        if (sumsq > 0.0f) {
            const float u = v[r] * rsqrtf(sumsq / TQ3_0_QK);
#pragma unroll
            for (int k = 0; k < 7; ++k) {
                idx += u > 0.5f*(tq3_0_levels_dev[k] + tq3_0_levels_dev[k + 1]);
            }
            lev = tq3_0_levels_dev[idx];
        }
        const float levsq = warp_reduce_sum(lev*lev);
        // low bits: byte q of qs collects lanes q, q+8, q+16, q+24
        int low = (idx & 3) << (2*(lane / 8));
        low |= __shfl_xor_sync(0xffffffff, low, 8);
        low |= __shfl_xor_sync(0xffffffff, low, 16);
        const uint32_t high = __ballot_sync(0xffffffff, idx >> 2);
        block_tq3_0 & b = dst[r];
        if (lane < 8) {
            b.qs[lane] = (uint8_t) low;
        }
        if (lane < 4) {
            b.qh[lane] = (uint8_t) (high >> (8*lane));
        }
        if (lane == 0) {
            const float d = sumsq > 0.0f ? fminf(sqrtf(sumsq / levsq), 65504.0f) : 0.0f;
            b.d = __half_as_ushort(__float2half_rn(d));
        }
    }
}

// One warp per group. Source row (i1, i2, i3) of src goes to destination row idx[i1, i2 % ne11, i3 % ne12]
// (set_rows) or, without idx, to row (i1, i2, i3) of dst (cpy).
template <typename src_t, typename idx_t>
static __global__ void k_tq3_0_quantize(
        const src_t * __restrict__ src, const idx_t * __restrict__ idx, char * __restrict__ dst,
        const int64_t groups_per_row, const int64_t ne1, const int64_t ne2, const int64_t n_groups,
        const int64_t s01, const int64_t s02, const int64_t s03,     // src strides, elements
        const int64_t si0, const int64_t si1, const int64_t si2,     // idx strides, elements
        const int64_t ne11, const int64_t ne12,
        const size_t nb1, const size_t nb2, const size_t nb3) {      // dst strides, bytes
    const int lane = threadIdx.x % WARP_SIZE;
    const int64_t group = (int64_t) blockIdx.x * (blockDim.x / WARP_SIZE) + threadIdx.x / WARP_SIZE;
    if (group >= n_groups) {
        return;
    }
    const int64_t g  = group % groups_per_row;
    int64_t rest     = group / groups_per_row;
    const int64_t i1 = rest % ne1; rest /= ne1;
    const int64_t i2 = rest % ne2;
    const int64_t i3 = rest / ne2;

    const src_t * x = src + i1*s01 + i2*s02 + i3*s03 + g*TQ3_0_GROUP;
    int64_t row = i1;
    if (idx != nullptr) {
        row = (int64_t) idx[i1*si0 + (i2 % ne11)*si1 + (i3 % ne12)*si2];
    }
    block_tq3_0 * y = (block_tq3_0 *) (dst + row*nb1 + i2*nb2 + i3*nb3) + g*TQ3_0_SUBS;

    float v[TQ3_0_SUBS];
#pragma unroll
    for (int r = 0; r < TQ3_0_SUBS; ++r) {
        v[r] = tq3_0_load(x + lane + 32*r);
    }
    tq3_0_quantize_group_warp(v, y, lane);
}

template <typename src_t, typename idx_t>
static void tq3_0_quantize_cuda(const ggml_tensor * src, const ggml_tensor * idx, ggml_tensor * dst, cudaStream_t stream) {
    GGML_ASSERT(src->ne[0] % TQ3_0_GROUP == 0 && src->nb[0] == sizeof(src_t));
    const int64_t groups_per_row = src->ne[0] / TQ3_0_GROUP;
    const int64_t n_groups = groups_per_row * src->ne[1] * src->ne[2] * src->ne[3];
    if (n_groups == 0) {
        return;
    }
    const int warps = 4;
    const int64_t n_blocks = (n_groups + warps - 1) / warps;
    const idx_t * idx_d = idx ? (const idx_t *) idx->data : nullptr;
    const int64_t si0 = idx ? idx->nb[0] / sizeof(idx_t) : 0;
    const int64_t si1 = idx ? idx->nb[1] / sizeof(idx_t) : 0;
    const int64_t si2 = idx ? idx->nb[2] / sizeof(idx_t) : 0;
    const int64_t ne11 = idx ? idx->ne[1] : 1;
    const int64_t ne12 = idx ? idx->ne[2] : 1;
    k_tq3_0_quantize<src_t, idx_t><<<n_blocks, warps*WARP_SIZE, 0, stream>>>(
        (const src_t *) src->data, idx_d, (char *) dst->data, groups_per_row, src->ne[1], src->ne[2], n_groups,
        src->nb[1] / sizeof(src_t), src->nb[2] / sizeof(src_t), src->nb[3] / sizeof(src_t),
        si0, si1, si2, ne11, ne12, dst->nb[1], dst->nb[2], dst->nb[3]);
    CUDA_CHECK(cudaGetLastError());
}

void ggml_ext_cuda_tq3_0_set_rows(ggml_backend_cuda_context & ctx, const ggml_tensor * src0, const ggml_tensor * src1,
                                  ggml_tensor * dst) {
    cudaStream_t stream = ctx.stream();
    if (src0->type == GGML_TYPE_F32) {
        if (src1->type == GGML_TYPE_I64) tq3_0_quantize_cuda<float, int64_t>(src0, src1, dst, stream);
        else                             tq3_0_quantize_cuda<float, int32_t>(src0, src1, dst, stream);
    } else {
        if (src1->type == GGML_TYPE_I64) tq3_0_quantize_cuda<half, int64_t>(src0, src1, dst, stream);
        else                             tq3_0_quantize_cuda<half, int32_t>(src0, src1, dst, stream);
    }
}

// --- dequantise ----------------------------------------------------------------------------------------------

template <typename dst_t>
static __device__ __forceinline__ dst_t tq3_0_store(const float x) {
    if constexpr (std::is_same_v<dst_t, half>) {
        return __float2half(x);
    } else {
        return x;
    }
}

// One thread per value. Row (i1, i2, i3) of the source starts at block offset i1*s01 + i2*s02 + i3*s03 (in
// 56-byte groups), or at the row named by idx (get_rows: src row idx[i1, i2, i3], broadcast as ggml does).
template <typename dst_t>
static __global__ void k_tq3_0_dequantize(
        const char * __restrict__ src, const int32_t * __restrict__ idx, dst_t * __restrict__ dst,
        const int64_t ne0, const int64_t ne1, const int64_t ne2, const int64_t n,
        const size_t sb1, const size_t sb2, const size_t sb3,            // src strides, bytes
        const int64_t si0, const int64_t si1, const int64_t si2,         // idx strides, elements
        const int64_t d1, const int64_t d2, const int64_t d3) {          // dst strides, elements
    const int64_t i = (int64_t) blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) {
        return;
    }
    const int64_t i0 = i % ne0;
    int64_t rest     = i / ne0;
    const int64_t i1 = rest % ne1; rest /= ne1;
    const int64_t i2 = rest % ne2;
    const int64_t i3 = rest / ne2;
    const char * row;
    if (idx != nullptr) {
        row = src + (int64_t) idx[i1*si0 + i2*si1 + i3*si2]*sb1 + i2*sb2 + i3*sb3;
    } else {
        row = src + i1*sb1 + i2*sb2 + i3*sb3;
    }
    const block_tq3_0 & b = ((const block_tq3_0 *) row)[i0 / TQ3_0_QK];
    const float d = __half2float(__ushort_as_half(b.d));
    dst[i0 + i1*d1 + i2*d2 + i3*d3] = tq3_0_store<dst_t>(d * tq3_0_levels_dev[tq3_0_index(b, i0 % TQ3_0_QK)]);
}

template <typename dst_t>
static void tq3_0_dequantize_cuda(const void * x, const int32_t * idx, dst_t * y,
                                  const int64_t ne0, const int64_t ne1, const int64_t ne2, const int64_t ne3,
                                  const size_t sb1, const size_t sb2, const size_t sb3,
                                  const int64_t si0, const int64_t si1, const int64_t si2,
                                  const int64_t d1, const int64_t d2, const int64_t d3, cudaStream_t stream) {
    const int64_t n = ne0*ne1*ne2*ne3;
    if (n == 0) {
        return;
    }
    const int threads = 256;
    k_tq3_0_dequantize<dst_t><<<(n + threads - 1) / threads, threads, 0, stream>>>(
        (const char *) x, idx, y, ne0, ne1, ne2, n, sb1, sb2, sb3, si0, si1, si2, d1, d2, d3);
    CUDA_CHECK(cudaGetLastError());
}

void ggml_ext_cuda_tq3_0_get_rows(ggml_backend_cuda_context & ctx, const ggml_tensor * src0, const ggml_tensor * src1,
                                  ggml_tensor * dst) {
    GGML_ASSERT(src1->type == GGML_TYPE_I32 && dst->type == GGML_TYPE_F32);
    // dst [ne00, ne10, ne11, ne12]: row (i1, i2, i3) is src0 row idx[i1, i2, i3] of src0 matrix (i2, i3)
    tq3_0_dequantize_cuda<float>(src0->data, (const int32_t *) src1->data, (float *) dst->data,
        dst->ne[0], dst->ne[1], dst->ne[2], dst->ne[3], src0->nb[1], src0->nb[2], src0->nb[3],
        src1->nb[0] / sizeof(int32_t), src1->nb[1] / sizeof(int32_t), src1->nb[2] / sizeof(int32_t),
        dst->nb[1] / sizeof(float), dst->nb[2] / sizeof(float), dst->nb[3] / sizeof(float), ctx.stream());
}

void ggml_ext_cuda_tq3_0_to_fp32(const void * x, float * y, int64_t k, cudaStream_t stream) {
    tq3_0_dequantize_cuda<float>(x, nullptr, y, k, 1, 1, 1, 0, 0, 0, 0, 0, 0, k, k, k, stream);
}

void ggml_ext_cuda_tq3_0_to_fp16(const void * x, half * y, int64_t k, cudaStream_t stream) {
    tq3_0_dequantize_cuda<half>(x, nullptr, y, k, 1, 1, 1, 0, 0, 0, 0, 0, 0, k, k, k, stream);
}

// Non-contiguous source, contiguous destination; s01..s03 are source strides in ggml blocks (56 bytes).
void ggml_ext_cuda_tq3_0_to_fp32_nc(const void * x, float * y, int64_t ne00, int64_t ne01, int64_t ne02,
                                    int64_t ne03, int64_t s01, int64_t s02, int64_t s03, cudaStream_t stream) {
    const size_t bs = TQ3_0_SUBS*sizeof(block_tq3_0);
    tq3_0_dequantize_cuda<float>(x, nullptr, y, ne00, ne01, ne02, ne03, s01*bs, s02*bs, s03*bs, 0, 0, 0,
                                 ne00, ne00*ne01, ne00*ne01*ne02, stream);
}

void ggml_ext_cuda_tq3_0_to_fp16_nc(const void * x, half * y, int64_t ne00, int64_t ne01, int64_t ne02,
                                    int64_t ne03, int64_t s01, int64_t s02, int64_t s03, cudaStream_t stream) {
    const size_t bs = TQ3_0_SUBS*sizeof(block_tq3_0);
    tq3_0_dequantize_cuda<half>(x, nullptr, y, ne00, ne01, ne02, ne03, s01*bs, s02*bs, s03*bs, 0, 0, 0,
                                ne00, ne00*ne01, ne00*ne01*ne02, stream);
}

// --- cpy -----------------------------------------------------------------------------------------------------

bool ggml_ext_cuda_tq3_0_supports_op(const ggml_tensor * op) {
    const ggml_tensor * src0 = op->src[0];
    switch (op->op) {
        case GGML_OP_SET_ROWS:
            return (src0->type == GGML_TYPE_F32 || src0->type == GGML_TYPE_F16) &&
                   (op->src[1]->type == GGML_TYPE_I32 || op->src[1]->type == GGML_TYPE_I64) &&
                   src0->nb[0] == ggml_type_size(src0->type) && op->ne[0] % TQ3_0_GROUP == 0;
        case GGML_OP_GET_ROWS:
            return op->type == GGML_TYPE_F32 && op->src[1]->type == GGML_TYPE_I32;
        case GGML_OP_CPY: {
            const ggml_tensor * src1 = op->src[1];
            const bool to_q   = src1->type == GGML_TYPE_TQ3_0 && (src0->type == GGML_TYPE_F32 || src0->type == GGML_TYPE_F16);
            const bool from_q = src0->type == GGML_TYPE_TQ3_0 && (src1->type == GGML_TYPE_F32 || src1->type == GGML_TYPE_F16);
            // same shape, rows read/written whole
            return (to_q || from_q) && ggml_are_same_shape(src0, src1) &&
                   src0->nb[0] == ggml_type_size(src0->type) && src1->nb[0] == ggml_type_size(src1->type) &&
                   (from_q ? ggml_is_contiguous(src1) : true);
        }
        default:
            return false;
    }
}

void ggml_ext_cuda_tq3_0_cpy(ggml_backend_cuda_context & ctx, const ggml_tensor * src0, ggml_tensor * src1) {
    GGML_ASSERT(ggml_are_same_shape(src0, src1));
    cudaStream_t stream = ctx.stream();
    if (src1->type == GGML_TYPE_TQ3_0) {
        if (src0->type == GGML_TYPE_F32) tq3_0_quantize_cuda<float, int32_t>(src0, nullptr, src1, stream);
        else                             tq3_0_quantize_cuda<half,  int32_t>(src0, nullptr, src1, stream);
        return;
    }
    GGML_ASSERT(src0->type == GGML_TYPE_TQ3_0 && ggml_is_contiguous(src1));
    const int64_t ne0 = src0->ne[0], ne1 = src0->ne[1], ne2 = src0->ne[2], ne3 = src0->ne[3];
    if (src1->type == GGML_TYPE_F32) {
        tq3_0_dequantize_cuda<float>(src0->data, nullptr, (float *) src1->data, ne0, ne1, ne2, ne3,
            src0->nb[1], src0->nb[2], src0->nb[3], 0, 0, 0, ne0, ne0*ne1, ne0*ne1*ne2, stream);
    } else {
        tq3_0_dequantize_cuda<half>(src0->data, nullptr, (half *) src1->data, ne0, ne1, ne2, ne3,
            src0->nb[1], src0->nb[2], src0->nb[3], 0, 0, 0, ne0, ne0*ne1, ne0*ne1*ne2, stream);
    }
}
