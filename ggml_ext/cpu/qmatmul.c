// ggml_qmatmul on the CPU: the reference. Threads split the weight rows; each row is dequantised to f32 once
// (ggml's own to_float of its type) and dotted with every column of x in float, in index order. With a norm
// (ggml_qmatmul_rms_norm) each column is first scaled as ggml's CPU rms_norm and mul would: squares summed in
// double, scale = 1 / sqrtf(mean + eps), value = x * scale * norm. ggml_qmatmul_fused: with up, the columns are
// ggml's CPU swiglu of x and up (its own vector function, computed once into the work buffer, a column per thread)
// or its sigmoid of x times up (ggml_qmatmul_sigmoid_gated), with a norm of up's groups first (ggml's rms_norm and
// mul of each group, as above); with an added tensor each output is sum + add, ggml's CPU add.

#include "ggml-ext.h"
#include "ggml-ext-cpu.h"
#include "ggml-cpu-impl.h"
#include "ggml-impl.h"
#include "vec.h"

#include <math.h>
#include <string.h>

size_t ggml_ext_cpu_qmatmul_work_size(const struct ggml_tensor * node, int n_tasks) {
    const int64_t K = node->src[0]->ne[0];
    // one dequantised row per thread, padded to a cache line; with up, the gated columns
    const size_t gated = node->src[4] != NULL ? (size_t) K * node->src[1]->ne[1] : 0;
    return ((size_t) n_tasks * (K + 16) + gated) * sizeof(float);
}

static float rms_norm_scale(const float * x, int64_t K, float eps) {
    double sum = 0.0;   // ggml_float
    for (int64_t k = 0; k < K; ++k) {
        sum += (double) (x[k] * x[k]);
    }
    const float mean = sum / K;
    return 1.0f / sqrtf(mean + eps);
}

static const float * column(const struct ggml_tensor * t, int64_t j) {
    return (const float *) ((const char *) t->data + j * t->nb[1]);
}

void ggml_ext_cpu_qmatmul(const struct ggml_compute_params * params, struct ggml_tensor * dst) {
    const struct ggml_tensor * w    = dst->src[0];
    const struct ggml_tensor * x    = dst->src[1];
    const struct ggml_tensor * norm = dst->src[2];   // ggml_qmatmul_rms_norm, else NULL
    const struct ggml_tensor * add  = dst->src[3];   // ggml_qmatmul_fused's added tensor, else NULL
    const struct ggml_tensor * up   = dst->src[4];   // ggml_qmatmul_fused's up (gated columns), else NULL

    const int64_t K = w->ne[0];
    const int64_t M = w->ne[1];
    const int64_t N = x->ne[1];
    const ggml_to_float_t to_float = ggml_get_type_traits(w->type)->to_float;

    float * row = (float *) params->wdata + params->ith * (K + 16);
    int64_t r0, r1;   // this thread's weight rows
    ggml_ext_thread_rows(M, params->ith, params->nth, &r0, &r1);

    float eps;
    memcpy(&eps, &dst->op_params[1], sizeof(float));
    float * gated = up != NULL ? (float *) params->wdata + params->nth * (K + 16) : NULL;   // [N][K]
    if (up != NULL) {
        for (int64_t j = params->ith; j < N; j += params->nth) {
            const float * u = column(up, j);
            if (norm != NULL) {   // up's groups normed first, into this thread's row buffer (free until below)
                const int64_t G = ggml_nelements(norm);
                const float * g = (const float *) norm->data;
                for (int64_t k0 = 0; k0 < K; k0 += G) {
                    const float s = rms_norm_scale(u + k0, G, eps);
                    for (int64_t k = 0; k < G; ++k) {
                        row[k0 + k] = u[k0 + k] * s * g[k];
                    }
                }
                u = row;
            }
            if (dst->op_params[2] == GGML_EXT_QMATMUL_GATE_SIGMOID) {   // ggml's CPU sigmoid, then its mul
                const float * xj = column(x, j);
                for (int64_t k = 0; k < K; ++k) {
                    gated[j * K + k] = 1.f / (1.f + expf(-xj[k])) * u[k];
                }
            } else {
                ggml_vec_swiglu_f32((int) K, gated + j * K, column(x, j), u);
            }
        }
        ggml_barrier(params->threadpool);
    }
    const struct ggml_tensor * col_norm = up == NULL ? norm : NULL;   // a norm of the columns (else of up's groups)
    float scale[GGML_EXT_QMATMUL_MAX_COLS];   // each column's rms_norm factor
    if (col_norm != NULL) {
        for (int64_t j = 0; j < N; ++j) {
            scale[j] = rms_norm_scale(column(x, j), K, eps);
        }
    }

    for (int64_t r = r0; r < r1; ++r) {
        to_float((const char *) w->data + r * w->nb[1], row, K);
        for (int64_t j = 0; j < N; ++j) {
            const float * xj = up != NULL ? gated + j * K : column(x, j);
            float sum = 0.0f;
            if (col_norm == NULL) {
                for (int64_t k = 0; k < K; ++k) {
                    sum += row[k] * xj[k];
                }
            } else {
                const float * g = (const float *) col_norm->data;
                for (int64_t k = 0; k < K; ++k) {
                    const float xn = xj[k] * scale[j] * g[k];
                    sum += row[k] * xn;
                }
            }
            if (add != NULL) {
                sum = sum + column(add, j)[r];
            }
            *(float *) ((char *) dst->data + r * sizeof(float) + j * dst->nb[1]) = sum;
        }
    }
}
