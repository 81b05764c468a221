// ggml_ssm_conv_tree on CUDA: one thread per (channel, token, sequence); d_conv is a template parameter.

#include "ggml-ext-cuda.cuh"
#include "../src/tree-walk.h"

template <int D_CONV>
static __global__ void ssm_conv_tree_kernel(
        const char * sx, const float * c, const int * parent, float * dst,
        int d_inner, int n_t, size_t sx_nb1, size_t sx_nb2, size_t c_nb1, size_t par_nb1,
        size_t dst_nb1, size_t dst_nb2) {
    const int r = blockIdx.x * blockDim.x + threadIdx.x;
    const int t = blockIdx.y;
    const int s = blockIdx.z;
    if (r >= d_inner) {
        return;
    }
    int cols[D_CONV];
    ggml_ext_conv_tree_window((const int *) ((const char *) parent + s * par_nb1), t, D_CONV, cols);

    const float * x = (const float *) (sx + r * sx_nb1 + s * sx_nb2);
    const float * w = (const float *) ((const char *) c + r * c_nb1);
    float sum = 0.0f;
#pragma unroll
    for (int j = 0; j < D_CONV; ++j) {
        sum += x[cols[j]] * w[j];
    }
    *(float *) ((char *) dst + r * sizeof(float) + t * dst_nb1 + s * dst_nb2) = sum;
}

void ggml_ext_cuda_ssm_conv_tree(ggml_backend_cuda_context & ctx, ggml_tensor * dst) {
    const ggml_tensor * sx     = dst->src[0];
    const ggml_tensor * c      = dst->src[1];
    const ggml_tensor * parent = dst->src[2];
    GGML_ASSERT(c->ne[0] == 4);  // ggml_ext_cuda_supports_op refuses other kernel sizes

    const int d_inner = (int) c->ne[1];
    const int n_t     = (int) dst->ne[1];
    const int n_s     = (int) dst->ne[2];
    const int threads = 128;
    const dim3 grid((d_inner + threads - 1) / threads, n_t, n_s);
    ssm_conv_tree_kernel<4><<<grid, threads, 0, ctx.stream()>>>(
        (const char *) sx->data, (const float *) c->data, (const int *) parent->data, (float *) dst->data,
        d_inner, n_t, sx->nb[1], sx->nb[2], c->nb[1], parent->nb[1], dst->nb[1], dst->nb[2]);
}
