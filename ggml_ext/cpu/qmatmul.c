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

static int qmatmul_form(const struct ggml_tensor * node) {
    return node->op_params[3];
}

// The columns a node multiplies (a prepared input's from op_params[4])
static int64_t qmatmul_cols(const struct ggml_tensor * node) {
    return qmatmul_form(node) == GGML_EXT_QMATMUL_FORM_PREPARED_IN ? node->op_params[4] : node->src[1]->ne[1];
}

// Floats of a thread's row buffer: a dequantised weight row, or a column's swiglu (F = M / 2 values)
static int64_t qmatmul_row_floats(const struct ggml_tensor * node) {
    const int64_t K = node->src[0]->ne[0], M = node->src[0]->ne[1];
    return (qmatmul_form(node) == GGML_EXT_QMATMUL_FORM_SWIGLU_PREPARED && M / 2 > K ? M / 2 : K) + 16;
}

size_t ggml_ext_cpu_qmatmul_work_size(const struct ggml_tensor * node, int n_tasks) {
    const int64_t K = node->src[0]->ne[0], M = node->src[0]->ne[1], N = qmatmul_cols(node);
    const int form = qmatmul_form(node);
    // per thread a row buffer (padded to a cache line); the columns as floats where they are computed first (up's
    // gated ones, a prepared input's); a swiglu node's f32 product
    const bool columns = node->src[4] != NULL || form == GGML_EXT_QMATMUL_FORM_PREPARED_IN;
    const size_t cols = columns ? (size_t) K * N : 0;
    const size_t product = form == GGML_EXT_QMATMUL_FORM_SWIGLU_PREPARED ? (size_t) M * N : 0;
    return ((size_t) n_tasks * qmatmul_row_floats(node) + cols + product) * sizeof(float);
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

// Column j of a prepared input (ggml-ext.h) as floats
static void prepared_column(const struct ggml_tensor * xp, int64_t j, int64_t K, float * out) {
    const int64_t npad = xp->ne[1];
    const ggml_fp16_t * units = (const ggml_fp16_t *) xp->data;
    for (int64_t k = 0; k < K; ++k) {
        out[k] = GGML_FP16_TO_FP32(units[(k / 256) * npad * GGML_EXT_QMATMUL_HALF_PITCH +
                                         GGML_EXT_QMATMUL_HALF_AT(k % 256, j, npad)]);
    }
}

// Column j of a prepared tensor from F values s (NULL: a padding column, zeros); without sums (a Q6_K reader) the run
// sums are zeros
static void prepare_column(const float * s, int64_t F, int64_t j, bool sums, struct ggml_tensor * dst) {
    const int64_t npad = dst->ne[1];
    for (int64_t u = 0; u < F / 256; ++u) {
        ggml_fp16_t * unit = (ggml_fp16_t *) dst->data + u * npad * GGML_EXT_QMATMUL_HALF_PITCH;
        for (int c = 0; c < GGML_EXT_QMATMUL_HALF_PITCH / 8; ++c) {   // every chunk's 8 halves of this column
            memset(unit + (c * npad + j) * 8, 0, 8 * sizeof(ggml_fp16_t));
        }
        if (s == NULL) {
            continue;
        }
        for (int r = 0; r < 8; ++r) {
            float sum = 0.0f;
            for (int i = 32 * r; i < 32 * r + 32; ++i) {
                const ggml_fp16_t h = GGML_FP32_TO_FP16(s[256 * u + i]);
                unit[GGML_EXT_QMATMUL_HALF_AT(i, j, npad)] = h;
                sum += GGML_FP16_TO_FP32(h);
            }
            unit[GGML_EXT_QMATMUL_HALF_AT(256 + r, j, npad)] = GGML_FP32_TO_FP16(sums ? sum : 0.0f);
        }
    }
}

// ggml_qmatmul_prepare: a column per thread, normed as the product above norms it
void ggml_ext_cpu_qmatmul_prepare(const struct ggml_compute_params * params, struct ggml_tensor * dst) {
    const struct ggml_tensor * x    = dst->src[0];
    const struct ggml_tensor * norm = dst->src[2];
    const int64_t K = x->ne[0], N = x->ne[1];
    float eps;
    memcpy(&eps, &dst->op_params[1], sizeof(float));
    float * col = (float *) params->wdata + params->ith * (K + 16);
    for (int64_t j = params->ith; j < dst->ne[1]; j += params->nth) {
        if (j < N && norm != NULL) {
            const float scale = rms_norm_scale(column(x, j), K, eps);
            const float * g = (const float *) norm->data;
            for (int64_t k = 0; k < K; ++k) {
                col[k] = column(x, j)[k] * scale * g[k];
            }
        }
        prepare_column(j >= N ? NULL : norm != NULL ? col : column(x, j), K, j, true, dst);
    }
}

void ggml_ext_cpu_qmatmul(const struct ggml_compute_params * params, struct ggml_tensor * dst) {
    const struct ggml_tensor * w    = dst->src[0];
    const struct ggml_tensor * x    = dst->src[1];
    const struct ggml_tensor * norm = dst->src[2];   // ggml_qmatmul_rms_norm, else NULL
    const struct ggml_tensor * add  = dst->src[3];   // ggml_qmatmul_fused's added tensor, else NULL
    const struct ggml_tensor * up   = dst->src[4];   // ggml_qmatmul_fused's up (gated columns), else NULL
    const int form = qmatmul_form(dst);

    const int64_t K = w->ne[0];
    const int64_t M = w->ne[1];
    const int64_t N = qmatmul_cols(dst);
    const ggml_to_float_t to_float = ggml_get_type_traits(w->type)->to_float;

    const int64_t row_floats = qmatmul_row_floats(dst);
    float * row = (float *) params->wdata + params->ith * row_floats;
    float * shared = (float *) params->wdata + params->nth * row_floats;   // the work buffer's shared part
    int64_t r0, r1;   // this thread's weight rows
    ggml_ext_thread_rows(M, params->ith, params->nth, &r0, &r1);

    float eps;
    memcpy(&eps, &dst->op_params[1], sizeof(float));
    float * cols = NULL;   // [N][K]: the columns as floats, where they are computed first
    if (form == GGML_EXT_QMATMUL_FORM_PREPARED_IN) {
        cols = shared;
        for (int64_t j = params->ith; j < N; j += params->nth) {
            prepared_column(x, j, K, cols + j * K);
        }
        ggml_barrier(params->threadpool);
    } else if (up != NULL) {
        cols = shared;
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
                    cols[j * K + k] = 1.f / (1.f + expf(-xj[k])) * u[k];
                }
            } else {
                ggml_vec_swiglu_f32((int) K, cols + j * K, column(x, j), u);
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
    // the f32 product: dst, or for a swiglu node its own buffer [N][M] after the columns
    const bool swiglu = form == GGML_EXT_QMATMUL_FORM_SWIGLU_PREPARED;
    float * product = swiglu ? shared : (float *) dst->data;
    const size_t product_col = swiglu ? (size_t) M : dst->nb[1] / sizeof(float);

    for (int64_t r = r0; r < r1; ++r) {
        to_float((const char *) w->data + r * w->nb[1], row, K);
        for (int64_t j = 0; j < N; ++j) {
            const float * xj = cols != NULL ? cols + j * K : column(x, j);
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
            product[r + j * product_col] = sum;
        }
    }
    if (swiglu) {   // each column's gate (rows 0..F-1) and up (F..2F-1), into the prepared layout
        ggml_barrier(params->threadpool);
        const int64_t F = M / 2;
        for (int64_t j = params->ith; j < dst->ne[1]; j += params->nth) {
            if (j < N) {
                ggml_vec_swiglu_f32((int) F, row, product + j * M, product + j * M + F);
            }
            prepare_column(j < N ? row : NULL, F, j, dst->op_params[4] != 0, dst);
        }
    }
}
