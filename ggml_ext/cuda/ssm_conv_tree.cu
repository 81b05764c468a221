// ggml_ssm_conv_tree on CUDA. A block takes 128 channels of one sequence over SSM_CONV_TREE_TOKENS tokens: its
// first threads walk the tree once for each token (the window's sx columns, into shared memory), then each
// thread convolves its channel for every token, the kernel row in registers; the output stores are coalesced
// over channels. d_conv is a template parameter. SPLIT (ggml_ssm_conv_tree_split): sx holds only the state
// columns and the token columns are read from x [d_inner, n_t, n_s] (loads coalesced over channels). SILU: each
// output through ggml-cuda's own silu (the bits of its silu kernel).
//
// ggml_gdn_conv_tree's gates (conv_tree_gates): one more column of blocks computes them.
// NORM_G (ggml_gdn_conv_tree): the first qk channels normed in groups of NORM_G (a power of two, at most the
// block's 128 channels, so a group never straddles blocks) with the bits of ggml-cuda's rms_norm + scale (its
// 256-thread kernel for rows under 1,024 values, one value a thread): each warp sums its squares by an xor
// butterfly (offsets 16 .. 1; lanes past the row add zeros, which change nothing), then the warps' sums are added
// by a butterfly over them (offsets down to 1), and y becomes scale * (rsqrtf(sum / G + eps) * y). Here a group's
// squares take the same steps: its lanes' butterfly from offset min(G, 32) / 2, then its warps' sums in the same
// order.
#include "ggml-ext-cuda.cuh"
#include "unary.cuh"
#include "../src/gdn-gates.h"
#include "../src/tree-walk.h"

#define SSM_CONV_TREE_THREADS 128
#define SSM_CONV_TREE_TOKENS  8

// The sums of squares of this thread's group for every token (v: this thread's own squares) in ggml-cuda's
// rms_norm order (above), all tokens at once (one block barrier for them all); every thread of the block calls it
template <int G>
static __device__ __forceinline__ void conv_tree_group_sums(float (&v)[SSM_CONV_TREE_TOKENS],
        float (&warp_sums)[SSM_CONV_TREE_TOKENS][SSM_CONV_TREE_THREADS / WARP_SIZE]) {
#pragma unroll
    for (int offset = (G < WARP_SIZE ? G : WARP_SIZE) / 2; offset > 0; offset >>= 1) {
#pragma unroll
        for (int tt = 0; tt < SSM_CONV_TREE_TOKENS; ++tt) {
            v[tt] += __shfl_xor_sync(0xFFFFFFFFu, v[tt], offset);
        }
    }
    if constexpr (G > WARP_SIZE) {
        constexpr int M = G / WARP_SIZE;   // warps of a group
        const int warp = threadIdx.x / WARP_SIZE, first = warp - warp % M;
        if (threadIdx.x % WARP_SIZE == 0) {
#pragma unroll
            for (int tt = 0; tt < SSM_CONV_TREE_TOKENS; ++tt) {
                warp_sums[tt][warp] = v[tt];
            }
        }
        __syncthreads();
#pragma unroll
        for (int tt = 0; tt < SSM_CONV_TREE_TOKENS; ++tt) {
            float p[M];
#pragma unroll
            for (int j = 0; j < M; ++j) {
                p[j] = warp_sums[tt][first + j];
            }
#pragma unroll
            for (int offset = M / 2; offset > 0; offset >>= 1) {   // lane j: p[j] + p[j ^ offset]; lane 0's is the sum
#pragma unroll
                for (int j = 0; j < offset; ++j) {
                    p[j] = p[j] + p[j ^ offset];
                }
            }
            v[tt] = p[0];
        }
    }
}

// ggml_gdn_conv_tree's gates (beta null: none), computed by one more column of blocks: ggml_gdn_gates' values and
// layout, g [H, n_t] then sigmoid(beta) [H, n_t] at out
struct conv_tree_gates {
    const float * beta, * alpha, * dt_bias, * a;
    float * out;
    int H;
    int64_t s_beta, s_alpha;   // (floats between tokens)
};

template <int D_CONV, bool SPLIT, bool SILU, int NORM_G>
static __global__ void __launch_bounds__(SSM_CONV_TREE_THREADS)
ssm_conv_tree_kernel(const char * sx, const char * xin, const float * c, const int * parent, float * dst,
                     int d_inner, int n_t, size_t sx_nb1, size_t sx_nb2, size_t x_nb1, size_t x_nb2, size_t c_nb1,
                     size_t par_nb1, size_t dst_nb1, size_t dst_nb2, int qk, float eps, float scale, char * copy,
                     size_t copy_nb1, size_t copy_nb2, const conv_tree_gates gates) {
    __shared__ int cols[SSM_CONV_TREE_TOKENS][D_CONV];
    __shared__ float warp_sums[SSM_CONV_TREE_TOKENS][SSM_CONV_TREE_THREADS / WARP_SIZE];

    const int r  = blockIdx.x * SSM_CONV_TREE_THREADS + threadIdx.x;
    const int t0 = blockIdx.y * SSM_CONV_TREE_TOKENS;
    const int s  = blockIdx.z;
    const int tc = min(SSM_CONV_TREE_TOKENS, n_t - t0);

    ggml_cuda_pdl_sync();
    if (gates.beta != nullptr && blockIdx.x == gridDim.x - 1) {   // (the whole block)
        for (int i = threadIdx.x; i < gates.H * tc; i += SSM_CONV_TREE_THREADS) {
            const int h = i % gates.H, t = t0 + i / gates.H;
            const float alpha = gates.alpha[t * gates.s_alpha + h];
            gates.out[t * gates.H + h] = ggml_ext_gdn_decay(alpha, gates.dt_bias[h], gates.a[h]);
            gates.out[(n_t + t) * gates.H + h] = ggml_ext_gdn_beta(gates.beta[t * gates.s_beta + h]);
        }
        return;
    }
    if (threadIdx.x < tc) {
        ggml_ext_conv_tree_window((const int *) ((const char *) parent + s * par_nb1), t0 + threadIdx.x, D_CONV,
                                  cols[threadIdx.x]);
    }
    __syncthreads();
    // (no early exit past d_inner: the norm's block barriers need every thread)
    const bool live = r < d_inner;
    float w[D_CONV];
#pragma unroll
    for (int j = 0; j < D_CONV; ++j) {
        w[j] = live ? ((const float *) ((const char *) c + r * c_nb1))[j] : 0.0f;
    }
    const float * x = (const float *) (sx + (live ? r : 0) * sx_nb1 + s * sx_nb2);
    const char  * xr = SPLIT ? xin + (live ? r : 0) * sizeof(float) + s * x_nb2 : nullptr;
    float y[SSM_CONV_TREE_TOKENS];
#pragma unroll
    for (int tt = 0; tt < SSM_CONV_TREE_TOKENS; ++tt) {
        y[tt] = 0.0f;
        if (tt >= tc || !live) {
            continue;
        }
        float sum = 0.0f;
#pragma unroll
        for (int j = 0; j < D_CONV; ++j) {
            const int col = cols[tt][j];
            const float v = !SPLIT || col < D_CONV - 1 ? x[col] : *(const float *) (xr + (col - (D_CONV - 1)) * x_nb1);
            sum += v * w[j];
        }
        y[tt] = SILU ? ggml_cuda_op_silu_single(sum) : sum;
        if (SPLIT && copy != nullptr) {   // the token's own input
            *(float *) (copy + r * sizeof(float) + (t0 + tt) * copy_nb1 + s * copy_nb2) =
                *(const float *) (xr + (t0 + tt) * x_nb1);
        }
    }
    if constexpr (NORM_G > 0) {
        if (blockIdx.x * SSM_CONV_TREE_THREADS < qk) {   // (block-uniform: a barrier inside)
            float sums[SSM_CONV_TREE_TOKENS];
#pragma unroll
            for (int tt = 0; tt < SSM_CONV_TREE_TOKENS; ++tt) {
                sums[tt] = y[tt] * y[tt];   // (tokens past tc: zeros, unused)
            }
            conv_tree_group_sums<NORM_G>(sums, warp_sums);
            if (r < qk) {
#pragma unroll
                for (int tt = 0; tt < SSM_CONV_TREE_TOKENS; ++tt) {
                    y[tt] = scale * (rsqrtf(sums[tt] / NORM_G + eps) * y[tt]);
                }
            }
        }
    }
    if (!live) {
        return;
    }
    for (int tt = 0; tt < tc; ++tt) {
        *(float *) ((char *) dst + r * sizeof(float) + (t0 + tt) * dst_nb1 + s * dst_nb2) = y[tt];
    }
}

// NORM_G for a group of g channels (0: no norm); ggml_ext_cuda_ssm_conv_tree_supported refuses the others
template <bool SPLIT, bool SILU>
static auto ssm_conv_tree_kernel_for(int g) {
    switch (g) {
        case 1:   return ssm_conv_tree_kernel<4, SPLIT, SILU, 1>;
        case 2:   return ssm_conv_tree_kernel<4, SPLIT, SILU, 2>;
        case 4:   return ssm_conv_tree_kernel<4, SPLIT, SILU, 4>;
        case 8:   return ssm_conv_tree_kernel<4, SPLIT, SILU, 8>;
        case 16:  return ssm_conv_tree_kernel<4, SPLIT, SILU, 16>;
        case 32:  return ssm_conv_tree_kernel<4, SPLIT, SILU, 32>;
        case 64:  return ssm_conv_tree_kernel<4, SPLIT, SILU, 64>;
        case 128: return ssm_conv_tree_kernel<4, SPLIT, SILU, 128>;
        default:  return ssm_conv_tree_kernel<4, SPLIT, SILU, 0>;
    }
}

bool ggml_ext_cuda_ssm_conv_tree_supported(const ggml_tensor * op) {
    const int qk = ggml_get_op_params_i32(op, 1), g = ggml_get_op_params_i32(op, 2);
    const bool norm_ok = qk == 0 || (g >= 1 && g <= SSM_CONV_TREE_THREADS && (g & (g - 1)) == 0);
    // (src[3]: the split form's inputs, rows contiguous by construction)
    return op->src[1]->ne[0] == 4 && op->src[0]->nb[0] == sizeof(float) && op->src[1]->nb[0] == sizeof(float) &&
           norm_ok;
}

void ggml_ext_cuda_ssm_conv_tree(ggml_backend_cuda_context & ctx, ggml_tensor * dst) {
    const ggml_tensor * sx     = dst->src[0];
    const ggml_tensor * c      = dst->src[1];
    const ggml_tensor * parent = dst->src[2];
    const ggml_tensor * xin    = dst->src[3];   // ggml_ssm_conv_tree_split, else NULL
    GGML_ASSERT(c->ne[0] == 4);  // ggml_ext_cuda_supports_op refuses other kernel sizes

    const int d_inner = (int) c->ne[1];
    const int n_t     = (int) (xin ? xin->ne[1] : sx->ne[0] - 3);
    const int n_s     = (int) sx->ne[2];
    const size_t dst_nb1 = (size_t) d_inner * sizeof(float), dst_nb2 = dst_nb1 * n_t;   // (then the gates)
    const ggml_tensor * beta = dst->src[5];   // ggml_gdn_conv_tree's gates, or NULL
    conv_tree_gates gates = {};
    if (beta != nullptr) {
        const ggml_tensor * alpha = dst->src[6];
        gates = {(const float *) beta->data, (const float *) alpha->data, (const float *) dst->src[7]->data,
                 (const float *) dst->src[8]->data, (float *) dst->data + (int64_t) d_inner * n_t, (int) beta->ne[0],
                 (int64_t) (beta->nb[1] / sizeof(float)), (int64_t) (alpha->nb[1] / sizeof(float))};
    }
    const dim3 grid((d_inner + SSM_CONV_TREE_THREADS - 1) / SSM_CONV_TREE_THREADS + (beta != nullptr),
                    (n_t + SSM_CONV_TREE_TOKENS - 1) / SSM_CONV_TREE_TOKENS, n_s);
    const ggml_cuda_kernel_launch_params params(grid, SSM_CONV_TREE_THREADS, 0, ctx.stream());
    const char * x  = xin ? (const char *) xin->data : nullptr;
    const size_t x_nb1 = xin ? xin->nb[1] : 0, x_nb2 = xin ? xin->nb[2] : 0;
    const bool silu = dst->op_params[0] != 0;
    const int qk = ggml_get_op_params_i32(dst, 1);
    const int g  = qk > 0 ? ggml_get_op_params_i32(dst, 2) : 0;
    const ggml_tensor * copy = dst->src[4];   // ggml_gdn_conv_tree's copy of x, or NULL
    const auto kernel = xin ? (silu ? ssm_conv_tree_kernel_for<true, true>(g)
                                    : ssm_conv_tree_kernel_for<true, false>(g))
                            : (silu ? ssm_conv_tree_kernel_for<false, true>(g)
                                    : ssm_conv_tree_kernel_for<false, false>(g));
    ggml_cuda_kernel_launch(kernel, params,
        (const char *) sx->data, x, (const float *) c->data, (const int *) parent->data, (float *) dst->data,
        d_inner, n_t, sx->nb[1], sx->nb[2], x_nb1, x_nb2, c->nb[1], parent->nb[1], dst_nb1, dst_nb2, qk,
        ggml_get_op_params_f32(dst, 3), ggml_get_op_params_f32(dst, 4), copy ? (char *) copy->data : nullptr,
        copy ? copy->nb[1] : 0, copy ? copy->nb[2] : 0, gates);
}
