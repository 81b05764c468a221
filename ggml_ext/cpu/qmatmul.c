// ggml_qmatmul on the CPU: the reference. Threads split the weight rows; each row is dequantised to f32 once
// (ggml's own to_float of its type) and dotted with every column of x in float, in index order. With a norm
// (ggml_qmatmul_rms_norm) each column is first scaled as ggml's CPU rms_norm and mul would: squares summed in
// double, scale = 1 / sqrtf(mean + eps), value = x * scale * norm. With an added tensor (ggml_qmatmul_fused) each
// output is sum + add, ggml's CPU add.

#include "ggml-ext.h"
#include "ggml-ext-cpu.h"
#include "ggml-cpu-impl.h"
#include "ggml-impl.h"

#include <math.h>
#include <string.h>

size_t ggml_ext_cpu_qmatmul_work_size(const struct ggml_tensor * node, int n_tasks) {
    // one dequantised row per thread, padded to a cache line
    return (size_t) n_tasks * (node->src[0]->ne[0] + 16) * sizeof(float);
}

static float rms_norm_scale(const float * x, int64_t K, float eps) {
    double sum = 0.0;   // ggml_float
    for (int64_t k = 0; k < K; ++k) {
        sum += (double) (x[k] * x[k]);
    }
    const float mean = sum / K;
    return 1.0f / sqrtf(mean + eps);
}

void ggml_ext_cpu_qmatmul(const struct ggml_compute_params * params, struct ggml_tensor * dst) {
    const struct ggml_tensor * w    = dst->src[0];
    const struct ggml_tensor * x    = dst->src[1];
    const struct ggml_tensor * norm = dst->src[2];   // ggml_qmatmul_rms_norm, else NULL
    const struct ggml_tensor * add  = dst->src[3];   // ggml_qmatmul_fused's added tensor, else NULL

    const int64_t K = w->ne[0];
    const int64_t M = w->ne[1];
    const int64_t N = x->ne[1];
    const ggml_to_float_t to_float = ggml_get_type_traits(w->type)->to_float;

    float * row = (float *) params->wdata + params->ith * (K + 16);
    const int64_t per_thread = (M + params->nth - 1) / params->nth;
    const int64_t r0 = per_thread * params->ith;
    const int64_t r1 = MIN(r0 + per_thread, M);

    float scale[GGML_EXT_QMATMUL_MAX_COLS];   // each column's rms_norm factor (with a norm)
    if (norm != NULL) {
        float eps;
        memcpy(&eps, &dst->op_params[1], sizeof(float));
        for (int64_t j = 0; j < N; ++j) {
            scale[j] = rms_norm_scale((const float *) ((const char *) x->data + j * x->nb[1]), K, eps);
        }
    }

    for (int64_t r = r0; r < r1; ++r) {
        to_float((const char *) w->data + r * w->nb[1], row, K);
        for (int64_t j = 0; j < N; ++j) {
            const float * xj = (const float *) ((const char *) x->data + j * x->nb[1]);
            float sum = 0.0f;
            if (norm == NULL) {
                for (int64_t k = 0; k < K; ++k) {
                    sum += row[k] * xj[k];
                }
            } else {
                const float * g = (const float *) norm->data;
                for (int64_t k = 0; k < K; ++k) {
                    const float xn = xj[k] * scale[j] * g[k];
                    sum += row[k] * xn;
                }
            }
            if (add != NULL) {
                sum = sum + *(const float *) ((const char *) add->data + r * sizeof(float) + j * add->nb[1]);
            }
            *(float *) ((char *) dst->data + r * sizeof(float) + j * dst->nb[1]) = sum;
        }
    }
}
