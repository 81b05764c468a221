// ggml_gdn_gates on CUDA: one thread per (head, token); the formulas of ggml-cuda's unary softplus and sigmoid, in
// the order of the add, softplus, mul and sigmoid kernels it replaces (src/gdn-gates.h).

#include "ggml-ext-cuda.cuh"
#include "../src/gdn-gates.h"

static __global__ void gdn_gates_kernel(const float * __restrict__ beta, const float * __restrict__ alpha,
                                        const float * __restrict__ dt_bias, const float * __restrict__ a,
                                        float * __restrict__ out, int H, int n, int64_t s_beta, int64_t s_alpha) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    ggml_cuda_pdl_sync();   // beta and alpha are the previous kernel's output
    if (i >= H * n) {
        return;
    }
    const int h = i % H;
    const int t = i / H;
    out[i]         = ggml_ext_gdn_decay(alpha[t * s_alpha + h], dt_bias[h], a[h]);
    out[H * n + i] = ggml_ext_gdn_beta(beta[t * s_beta + h]);
}

void ggml_ext_cuda_gdn_gates(ggml_backend_cuda_context & ctx, ggml_tensor * dst) {
    const ggml_tensor * beta  = dst->src[0];
    const ggml_tensor * alpha = dst->src[1];
    const int H = (int) beta->ne[0];
    const int n = (int) beta->ne[1];
    const int threads = 256;
    ggml_cuda_kernel_launch(gdn_gates_kernel,
                            ggml_cuda_kernel_launch_params(dim3((H * n + threads - 1) / threads), dim3(threads), 0, ctx.stream()),
                            (const float *) beta->data, (const float *) alpha->data, (const float *) dst->src[2]->data,
                            (const float *) dst->src[3]->data, (float *) dst->data, H, n,
                            (int64_t) (beta->nb[1] / sizeof(float)), (int64_t) (alpha->nb[1] / sizeof(float)));
}
