// ggml_ssm_conv_tree on CUDA. A block takes 128 channels of one sequence over SSM_CONV_TREE_TOKENS tokens: its
// first threads walk the tree once for each token (the window's sx columns, into shared memory), then each
// thread convolves its channel for every token, the kernel row in registers; the output stores are coalesced
// over channels. d_conv is a template parameter. SPLIT (ggml_ssm_conv_tree_split): sx holds only the state
// columns and the token columns are read from x [d_inner, n_t, n_s] (loads coalesced over channels). SILU: each
// output through ggml-cuda's own silu (the bits of its silu kernel).

#include "ggml-ext-cuda.cuh"
#include "unary.cuh"
#include "../src/tree-walk.h"

#define SSM_CONV_TREE_THREADS 128
#define SSM_CONV_TREE_TOKENS  8

template <int D_CONV, bool SPLIT, bool SILU>
static __global__ void __launch_bounds__(SSM_CONV_TREE_THREADS)
ssm_conv_tree_kernel(const char * sx, const char * xin, const float * c, const int * parent, float * dst,
                     int d_inner, int n_t, size_t sx_nb1, size_t sx_nb2, size_t x_nb1, size_t x_nb2, size_t c_nb1,
                     size_t par_nb1, size_t dst_nb1, size_t dst_nb2) {
    __shared__ int cols[SSM_CONV_TREE_TOKENS][D_CONV];

    const int r  = blockIdx.x * SSM_CONV_TREE_THREADS + threadIdx.x;
    const int t0 = blockIdx.y * SSM_CONV_TREE_TOKENS;
    const int s  = blockIdx.z;
    const int tc = min(SSM_CONV_TREE_TOKENS, n_t - t0);

    ggml_cuda_pdl_sync();
    if (threadIdx.x < tc) {
        ggml_ext_conv_tree_window((const int *) ((const char *) parent + s * par_nb1), t0 + threadIdx.x, D_CONV,
                                  cols[threadIdx.x]);
    }
    __syncthreads();
    if (r >= d_inner) {
        return;
    }

    float w[D_CONV];
#pragma unroll
    for (int j = 0; j < D_CONV; ++j) {
        w[j] = ((const float *) ((const char *) c + r * c_nb1))[j];
    }
    const float * x = (const float *) (sx + r * sx_nb1 + s * sx_nb2);
    const char  * xr = SPLIT ? xin + r * sizeof(float) + s * x_nb2 : nullptr;
    for (int tt = 0; tt < tc; ++tt) {
        float sum = 0.0f;
#pragma unroll
        for (int j = 0; j < D_CONV; ++j) {
            const int col = cols[tt][j];
            const float v = !SPLIT || col < D_CONV - 1 ? x[col] : *(const float *) (xr + (col - (D_CONV - 1)) * x_nb1);
            sum += v * w[j];
        }
        *(float *) ((char *) dst + r * sizeof(float) + (t0 + tt) * dst_nb1 + s * dst_nb2) =
            SILU ? ggml_cuda_op_silu_single(sum) : sum;
    }
}

void ggml_ext_cuda_ssm_conv_tree(ggml_backend_cuda_context & ctx, ggml_tensor * dst) {
    const ggml_tensor * sx     = dst->src[0];
    const ggml_tensor * c      = dst->src[1];
    const ggml_tensor * parent = dst->src[2];
    const ggml_tensor * xin    = dst->src[3];   // ggml_ssm_conv_tree_split, else NULL
    GGML_ASSERT(c->ne[0] == 4);  // ggml_ext_cuda_supports_op refuses other kernel sizes

    const int d_inner = (int) c->ne[1];
    const int n_t     = (int) dst->ne[1];
    const int n_s     = (int) dst->ne[2];
    const dim3 grid((d_inner + SSM_CONV_TREE_THREADS - 1) / SSM_CONV_TREE_THREADS,
                    (n_t + SSM_CONV_TREE_TOKENS - 1) / SSM_CONV_TREE_TOKENS, n_s);
    const ggml_cuda_kernel_launch_params params(grid, SSM_CONV_TREE_THREADS, 0, ctx.stream());
    const char * x  = xin ? (const char *) xin->data : nullptr;
    const size_t x_nb1 = xin ? xin->nb[1] : 0, x_nb2 = xin ? xin->nb[2] : 0;
    const bool silu = dst->op_params[0] != 0;
    const auto kernel = xin ? (silu ? ssm_conv_tree_kernel<4, true, true> : ssm_conv_tree_kernel<4, true, false>)
                            : (silu ? ssm_conv_tree_kernel<4, false, true> : ssm_conv_tree_kernel<4, false, false>);
    ggml_cuda_kernel_launch(kernel, params,
        (const char *) sx->data, x, (const float *) c->data, (const int *) parent->data, (float *) dst->data,
        d_inner, n_t, sx->nb[1], sx->nb[2], x_nb1, x_nb2, c->nb[1], parent->nb[1], dst->nb[1], dst->nb[2]);
}
