// ggml_flash_attn_ext on CUDA where ggml_ext has a kernel for it: the hook upstream's fattn.cu calls first
// (vendor/patches/0002-tq3_0-type.patch), and the f16 split-KV kernel of fattn_split.cuh for a tree verify's
// sizes (a few tokens times the GQA heads over an f16 cache of up to 4,096 cells). TQ3_0 caches go to
// tq3_0_fattn.cu.

#include "fattn_split.cuh"
#include "ggml-ext-cuda.cuh"

#include <cstdlib>
#include <cstring>

// The shape the f16 kernel runs: 3 m-tiles of 16 rows a block, 2 warps each (the scores' head dimensions split
// between them), 3 stages of 32 keys in flight; one block an SM's worth of slices (tools/fa_lab.cu compared these).
#define FA_F16_MT 3
#define FA_F16_DS 2
#define FA_F16_ST 3
#define FA_F16_MAX_ROWS 256  // query rows per KV head (tokens x GQA ratio) up to which the f16 kernel is used ...
#define FA_F16_MAX_KV   4096 // ... and cache cells: the 27B verify's attention per layer (Nsight Compute, H100) took
                             // 25 us against upstream's 35 at 768 cells, 48 against 48 at ~4,400, 123 against 85
                             // at ~16,400 (docs/benchmarks.md)

// PYDFLASH_FA_SPLIT=0 leaves every f16 attention to upstream's kernels (read at each call, so a benchmark can
// compare the two in one process).
static bool fa_split_f16_enabled() {
    return ggml_ext_env_switch("PYDFLASH_FA_SPLIT", true);
}

bool ggml_ext_cuda_fattn_f16_applies(const ggml_tensor * dst) {
    const ggml_tensor * Q = dst->src[0];
    const ggml_tensor * K = dst->src[1];
    const ggml_tensor * V = dst->src[2];
    const ggml_tensor * mask = dst->src[3];
    if (!fa_split_f16_enabled() || !ampere_mma_available(ggml_cuda_info().devices[ggml_cuda_get_device()].cc)) {
        return false;
    }
    if (K->type != GGML_TYPE_F16 || V->type != GGML_TYPE_F16 || Q->type != GGML_TYPE_F32 || dst->type != GGML_TYPE_F32) {
        return false;
    }
    const int64_t D = Q->ne[0];
    if (K->ne[0] != D || V->ne[0] != D || (D != 128 && D != 256) || !ggml_is_contiguous(dst)) {
        return false;
    }
    float max_bias = 0.0f, softcap = 0.0f;
    memcpy(&max_bias, (const float *) dst->op_params + 1, sizeof(float));
    memcpy(&softcap,  (const float *) dst->op_params + 2, sizeof(float));
    if (max_bias != 0.0f || softcap != 0.0f || dst->src[4] != nullptr) {
        return false; // ALiBi, softcap, sinks: upstream's kernels
    }
    if (K->ne[2] != V->ne[2] || Q->ne[2] % K->ne[2] != 0 || K->ne[3] != Q->ne[3] || V->ne[3] != Q->ne[3] ||
        V->ne[1] != K->ne[1]) {
        return false;
    }
    // 16-byte pieces: rows of K, V and the mask, and float4 reads of Q; a piece of 8 keys wholly in or out
    if (K->nb[0] != sizeof(half) || V->nb[0] != sizeof(half) || Q->nb[0] != sizeof(float) || K->ne[1] % 8 != 0 ||
        !aligned16(K->data) || !aligned16(V->data) || !aligned16(Q->data)) {
        return false;
    }
    for (int i = 1; i < 4; ++i) {
        if (K->nb[i] % 16 != 0 || V->nb[i] % 16 != 0 || Q->nb[i] % 16 != 0) {
            return false;
        }
    }
    if (mask && (mask->type != GGML_TYPE_F16 || mask->nb[0] != sizeof(half) || !aligned16(mask->data) ||
                 mask->nb[1] % 16 != 0 || mask->nb[2] % 16 != 0 || mask->nb[3] % 16 != 0)) {
        return false;
    }
    if (K->ne[1] > INT32_MAX || ggml_nrows(dst) > INT32_MAX) {
        return false;
    }
    // a decode (one token) stays with upstream's vector kernel; past 256 rows (prefill micro-batches) and past
    // 4,096 cells upstream's tensor-core tiles are the better fit
    const int64_t rows_per_kv_head = Q->ne[1] * (Q->ne[2] / K->ne[2]);
    return Q->ne[1] >= 2 && rows_per_kv_head <= FA_F16_MAX_ROWS && K->ne[1] <= FA_F16_MAX_KV;
}

template <int D>
static void fa_split_f16_launch(ggml_backend_cuda_context & ctx, fa_split_params p, float * dst, const int64_t out_rows) {
    constexpr int MT = FA_F16_MT, DS = FA_F16_DS, ST = FA_F16_ST;
    constexpr size_t smem = fa_split_f16_smem<D, MT, DS, ST, true>();
    ggml_ext_cuda_allow_smem<k_fa_split_f16<D, MT, DS, ST, true>>(smem, ctx.device);
    const dim3 grid = fa_split_f16_plan<MT>(p, ggml_cuda_info().devices[ctx.device].nsm, 1);

    ggml_cuda_pool_alloc<float> partial(ctx.pool(), out_rows * p.n_splits * (D + 2));
    p.partial = partial.get();
    cudaStream_t stream = ctx.stream();
    ggml_cuda_kernel_launch(k_fa_split_f16<D, MT, DS, ST, true>,
                            ggml_cuda_kernel_launch_params(grid, MT*DS*WARP_SIZE, smem, stream), p);
    ggml_cuda_kernel_launch(fa_split_merge<D>, ggml_cuda_kernel_launch_params(dim3(out_rows), D, 0, stream),
                            (const float *) p.partial, dst, p.n_splits);
}

void ggml_ext_cuda_fattn_f16(ggml_backend_cuda_context & ctx, ggml_tensor * dst) {
    const fa_split_params p = fa_split_params_of(dst); // (no softcap: ggml_ext_cuda_fattn_f16_applies)
    const int64_t out_rows = (int64_t) p.n_seq * p.n_q * p.n_head;
    if (dst->src[0]->ne[0] == 128) {
        fa_split_f16_launch<128>(ctx, p, (float *) dst->data, out_rows);
    } else {
        fa_split_f16_launch<256>(ctx, p, (float *) dst->data, out_rows);
    }
}

bool ggml_ext_cuda_fattn_applies(const ggml_tensor * dst) {
    return ggml_ext_cuda_fattn_tq3_0_applies(dst) || ggml_ext_cuda_fattn_f16_applies(dst);
}

void ggml_ext_cuda_fattn(ggml_backend_cuda_context & ctx, ggml_tensor * dst) {
    if (ggml_ext_cuda_fattn_tq3_0_applies(dst)) {
        ggml_ext_cuda_fattn_tq3_0(ctx, dst);
    } else {
        ggml_ext_cuda_fattn_f16(ctx, dst);
    }
}
