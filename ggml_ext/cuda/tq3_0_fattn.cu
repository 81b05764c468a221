// Decode flash attention over a TQ3_0 K/V cache, reading the 3.5-bit blocks directly (no f16 copy of the cache).
//
// The query arrives rotated (pydflash/tq3.py), so scores are plain dot products with the dequantised rotated
// keys, and the output stays rotated until the graph un-rotates it. Work split ("flash decoding"): a CUDA block
// takes one KV head, up to NC query rows that share it (the GQA heads times the query tokens) and one slice of
// the keys; its 4 warps take every 4th key of the slice, each lane dequantising the D/32 values j = lane + 32 b.
// Each block leaves (max, sum, unnormalised output) per row; a second kernel merges the slices.
// Larger batches (prefill) go to upstream's kernels, which read TQ3_0 through the f16 converters.

#include "ggml-ext-cuda.cuh"
#include "ggml-ext.h"

#include <cuda_fp16.h>

static __constant__ float tq3_0_fa_levels[8] = TQ3_0_LEVELS_INIT;

#define TQ3_0_FA_WARPS    4
#define TQ3_0_FA_NC       8    // query rows per CUDA block
#define TQ3_0_FA_MAX_ROWS 32   // query rows per KV head up to which this kernel is used

struct tq3_0_fattn_params {
    const char * q; const char * k; const char * v; const char * mask;
    float * partial;
    int64_t nbq1, nbq2, nbq3;       // bytes
    int64_t nbk1, nbk2, nbk3;
    int64_t nbv1, nbv2, nbv3;
    int64_t nbm1, nbm2, nbm3;
    int n_q, n_head, n_head_kv, n_kv, n_seq, mask_ne2, mask_ne3;
    int n_tiles, n_splits, keys_per_split;
    float scale, softcap;
};

// The D/32 values of key/value row `row` that lane `lane` owns (j = lane + 32 b), dequantised.
template <int VPL>
static __device__ __forceinline__ void tq3_0_fa_load_row(const char * row, const int lane, float out[VPL]) {
    const block_tq3_0 * blocks = (const block_tq3_0 *) row;
#pragma unroll
    for (int b = 0; b < VPL; ++b) {
        const block_tq3_0 & blk = blocks[b];
        const int idx = ((blk.qs[lane % 8] >> (2*(lane / 8))) & 3) | (((blk.qh[lane / 8] >> (lane % 8)) & 1) << 2);
        out[b] = __half2float(__ushort_as_half(blk.d)) * tq3_0_fa_levels[idx];
    }
}

template <int D>
static __global__ void __launch_bounds__(TQ3_0_FA_WARPS*WARP_SIZE)
k_tq3_0_fattn_decode(const tq3_0_fattn_params p) {
    constexpr int VPL = D / WARP_SIZE;
    constexpr int NC  = TQ3_0_FA_NC;
    const int lane = threadIdx.x % WARP_SIZE;
    const int warp = threadIdx.x / WARP_SIZE;

    const int tile  = blockIdx.x % p.n_tiles;
    const int hk    = (blockIdx.x / p.n_tiles) % p.n_head_kv;
    const int seq   = blockIdx.x / (p.n_tiles * p.n_head_kv);
    const int split = blockIdx.y;
    const int group = p.n_head / p.n_head_kv;
    const int n_rows = group * p.n_q;

    // query rows of this block: row r -> head hk*group + r % group, token r / group
    float q[NC][VPL];
    int   head[NC], tok[NC];
    bool  valid[NC];
#pragma unroll
    for (int c = 0; c < NC; ++c) {
        const int r = tile*NC + c;
        valid[c] = r < n_rows;
        head[c]  = hk*group + (valid[c] ? r % group : 0);
        tok[c]   = valid[c] ? r / group : 0;
        const float * qrow = (const float *) (p.q + tok[c]*p.nbq1 + head[c]*p.nbq2 + seq*p.nbq3);
#pragma unroll
        for (int b = 0; b < VPL; ++b) {
            q[c][b] = valid[c] ? qrow[lane + WARP_SIZE*b] * p.scale : 0.0f;
        }
    }

    float M[NC], S[NC], acc[NC][VPL];
#pragma unroll
    for (int c = 0; c < NC; ++c) {
        M[c] = -INFINITY;
        S[c] = 0.0f;
#pragma unroll
        for (int b = 0; b < VPL; ++b) {
            acc[c][b] = 0.0f;
        }
    }

    const int k_begin = split * p.keys_per_split;
    const int k_end   = min(k_begin + p.keys_per_split, p.n_kv);
    const char * kbase = p.k + hk*p.nbk2 + seq*p.nbk3;
    const char * vbase = p.v + hk*p.nbv2 + seq*p.nbv3;

    for (int key = k_begin + warp; key < k_end; key += TQ3_0_FA_WARPS) {
        float kv[VPL];
        tq3_0_fa_load_row<VPL>(kbase + key*p.nbk1, lane, kv);
        float s[NC];
        bool any = false;
#pragma unroll
        for (int c = 0; c < NC; ++c) {
            if (!valid[c]) { // uniform across the warp, so skipping the reduction is safe
                s[c] = -INFINITY;
                continue;
            }
            float dot = 0.0f;
#pragma unroll
            for (int b = 0; b < VPL; ++b) {
                dot += q[c][b] * kv[b];
            }
            dot = warp_reduce_sum(dot); // identical in every lane
            if (p.softcap != 0.0f) {
                dot = p.softcap * tanhf(dot);
            }
            if (p.mask) {
                const half * mrow = (const half *) (p.mask + tok[c]*p.nbm1 + (head[c] % p.mask_ne2)*p.nbm2 +
                                                    (seq % p.mask_ne3)*p.nbm3);
                dot += __half2float(mrow[key]);
            }
            s[c] = dot;
            any |= s[c] != -INFINITY;
        }
        if (!any) {
            continue;
        }
        float vv[VPL];
        tq3_0_fa_load_row<VPL>(vbase + key*p.nbv1, lane, vv);
#pragma unroll
        for (int c = 0; c < NC; ++c) {
            if (s[c] == -INFINITY) {
                continue;
            }
            if (s[c] > M[c]) {
                const float ms = expf(M[c] - s[c]); // 0 on the first key
                M[c] = s[c];
                S[c] = S[c]*ms + 1.0f;
#pragma unroll
                for (int b = 0; b < VPL; ++b) {
                    acc[c][b] = acc[c][b]*ms + vv[b];
                }
            } else {
                const float ps = expf(s[c] - M[c]);
                S[c] += ps;
#pragma unroll
                for (int b = 0; b < VPL; ++b) {
                    acc[c][b] += ps*vv[b];
                }
            }
        }
    }

    // merge the warps of the block, then write this slice's partial result per row
    __shared__ float sm_ms[TQ3_0_FA_WARPS][NC][2];
    __shared__ float sm_acc[TQ3_0_FA_WARPS][NC][D];
#pragma unroll
    for (int c = 0; c < NC; ++c) {
        if (lane == 0) {
            sm_ms[warp][c][0] = M[c];
            sm_ms[warp][c][1] = S[c];
        }
#pragma unroll
        for (int b = 0; b < VPL; ++b) {
            sm_acc[warp][c][lane + WARP_SIZE*b] = acc[c][b];
        }
    }
    __syncthreads();

    for (int c = warp; c < NC; c += TQ3_0_FA_WARPS) {
        const int r = tile*NC + c;
        if (r >= n_rows) {
            continue;
        }
        float m = -INFINITY;
        for (int w = 0; w < TQ3_0_FA_WARPS; ++w) {
            m = fmaxf(m, sm_ms[w][c][0]);
        }
        float f[TQ3_0_FA_WARPS];
        float sum = 0.0f;
        for (int w = 0; w < TQ3_0_FA_WARPS; ++w) {
            f[w] = sm_ms[w][c][0] == -INFINITY ? 0.0f : expf(sm_ms[w][c][0] - m);
            sum += f[w]*sm_ms[w][c][1];
        }
        const int h = hk*group + r % group;
        const int t = r / group;
        const int64_t row_out = ((int64_t) seq*p.n_q + t)*p.n_head + h;
        float * out = p.partial + (row_out*p.n_splits + split)*(D + 2);
        if (lane == 0) {
            out[0] = m;
            out[1] = sum;
        }
        for (int d = lane; d < D; d += WARP_SIZE) {
            float a = 0.0f;
            for (int w = 0; w < TQ3_0_FA_WARPS; ++w) {
                a += f[w]*sm_acc[w][c][d];
            }
            out[2 + d] = a;
        }
    }
}

// One CUDA block per output row: merge the slices (max, sum, output) into softmax(...) V.
template <int D>
static __global__ void k_tq3_0_fattn_merge(const float * __restrict__ partial, float * __restrict__ dst, const int n_splits) {
    const int64_t row = blockIdx.x;
    const float * part = partial + row*n_splits*(D + 2);
    float m = -INFINITY;
    for (int i = 0; i < n_splits; ++i) {
        m = fmaxf(m, part[i*(D + 2)]);
    }
    float sum = 0.0f;
    for (int i = 0; i < n_splits; ++i) {
        const float mi = part[i*(D + 2)];
        sum += mi == -INFINITY ? 0.0f : expf(mi - m)*part[i*(D + 2) + 1];
    }
    const float inv = sum == 0.0f ? 0.0f : 1.0f/sum; // a fully masked row gives 0, as on the CPU
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        float a = 0.0f;
        for (int i = 0; i < n_splits; ++i) {
            const float mi = part[i*(D + 2)];
            if (mi != -INFINITY) {
                a += expf(mi - m)*part[i*(D + 2) + 2 + d];
            }
        }
        dst[row*D + d] = a*inv;
    }
}

bool ggml_ext_cuda_fattn_tq3_0_applies(const ggml_tensor * dst) {
    const ggml_tensor * Q = dst->src[0];
    const ggml_tensor * K = dst->src[1];
    const ggml_tensor * V = dst->src[2];
    const ggml_tensor * mask = dst->src[3];
    if (K->type != GGML_TYPE_TQ3_0 || V->type != GGML_TYPE_TQ3_0 || Q->type != GGML_TYPE_F32) {
        return false;
    }
    if (K->ne[0] != V->ne[0] || Q->ne[0] != K->ne[0] || (K->ne[0] != 128 && K->ne[0] != 256)) {
        return false;
    }
    if (K->nb[0] != ggml_type_size(K->type) || V->nb[0] != ggml_type_size(V->type)) {
        return false; // rows are read whole
    }
    float max_bias = 0.0f;
    memcpy(&max_bias, (const float *) dst->op_params + 1, sizeof(float));
    if (max_bias != 0.0f || dst->src[4] != nullptr) {
        return false; // ALiBi and sinks: upstream's kernels
    }
    if (mask && (mask->type != GGML_TYPE_F16 || mask->nb[0] != sizeof(half))) {
        return false;
    }
    if (Q->ne[2] % K->ne[2] != 0 || Q->nb[0] != sizeof(float) || dst->type != GGML_TYPE_F32 || !ggml_is_contiguous(dst)) {
        return false;
    }
    const int64_t rows_per_kv_head = Q->ne[1] * (Q->ne[2] / K->ne[2]);
    return rows_per_kv_head <= TQ3_0_FA_MAX_ROWS;
}

void ggml_ext_cuda_fattn_tq3_0(ggml_backend_cuda_context & ctx, ggml_tensor * dst) {
    const ggml_tensor * Q = dst->src[0];
    const ggml_tensor * K = dst->src[1];
    const ggml_tensor * V = dst->src[2];
    const ggml_tensor * mask = dst->src[3];
    const int D = (int) K->ne[0];

    tq3_0_fattn_params p = {};
    p.q = (const char *) Q->data; p.k = (const char *) K->data; p.v = (const char *) V->data;
    p.mask = mask ? (const char *) mask->data : nullptr;
    p.nbq1 = Q->nb[1]; p.nbq2 = Q->nb[2]; p.nbq3 = Q->nb[3];
    p.nbk1 = K->nb[1]; p.nbk2 = K->nb[2]; p.nbk3 = K->nb[3];
    p.nbv1 = V->nb[1]; p.nbv2 = V->nb[2]; p.nbv3 = V->nb[3];
    if (mask) {
        p.nbm1 = mask->nb[1]; p.nbm2 = mask->nb[2]; p.nbm3 = mask->nb[3];
        p.mask_ne2 = (int) mask->ne[2]; p.mask_ne3 = (int) mask->ne[3];
    } else {
        p.mask_ne2 = 1; p.mask_ne3 = 1;
    }
    p.n_q = (int) Q->ne[1]; p.n_head = (int) Q->ne[2]; p.n_head_kv = (int) K->ne[2];
    p.n_kv = (int) K->ne[1]; p.n_seq = (int) Q->ne[3];

    float scale = 1.0f, softcap = 0.0f;
    memcpy(&scale,   (const float *) dst->op_params + 0, sizeof(float));
    memcpy(&softcap, (const float *) dst->op_params + 2, sizeof(float));
    if (softcap != 0.0f) {
        scale /= softcap; // as upstream: softcap * tanh(scale/softcap * q.k)
    }
    p.scale = scale; p.softcap = softcap;

    const int n_rows = (p.n_head / p.n_head_kv) * p.n_q;
    p.n_tiles = (n_rows + TQ3_0_FA_NC - 1) / TQ3_0_FA_NC;
    const int blocks_x = p.n_tiles * p.n_head_kv * p.n_seq;
    // enough slices to fill the GPU twice over, each at least 64 keys long
    const int nsm = ggml_cuda_info().devices[ctx.device].nsm;
    int n_splits = std::max(1, std::min((2*nsm + blocks_x - 1) / blocks_x, (p.n_kv + 63) / 64));
    p.keys_per_split = (p.n_kv + n_splits - 1) / n_splits;
    p.n_splits = n_splits = (p.n_kv + p.keys_per_split - 1) / p.keys_per_split;

    const int64_t out_rows = (int64_t) p.n_seq * p.n_q * p.n_head;
    ggml_cuda_pool_alloc<float> partial(ctx.pool(), out_rows * n_splits * (D + 2));
    p.partial = partial.get();

    cudaStream_t stream = ctx.stream();
    const dim3 grid(blocks_x, n_splits);
    if (D == 128) {
        k_tq3_0_fattn_decode<128><<<grid, TQ3_0_FA_WARPS*WARP_SIZE, 0, stream>>>(p);
        k_tq3_0_fattn_merge<128><<<out_rows, 128, 0, stream>>>(p.partial, (float *) dst->data, n_splits);
    } else {
        k_tq3_0_fattn_decode<256><<<grid, TQ3_0_FA_WARPS*WARP_SIZE, 0, stream>>>(p);
        k_tq3_0_fattn_merge<256><<<out_rows, 256, 0, stream>>>(p.partial, (float *) dst->data, n_splits);
    }
    CUDA_CHECK(cudaGetLastError());
}
