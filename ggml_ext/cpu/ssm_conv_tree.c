// ggml_ssm_conv_tree (and its split form, ggml_ssm_conv_tree_split, and ggml_gdn_conv_tree) on the CPU: threads
// split d_inner. With silu the threads then split the finished output rows and run ggml's own vector silu over each,
// as ggml_silu does; ggml_gdn_conv_tree's norm then splits the groups, each normed with the arithmetic of ggml's CPU
// rms_norm and scale (a double sum of the float squares, in order; y * (1 / sqrtf(mean + eps)), then * scale).

#include "ggml-ext-cpu.h"
#include "ggml-cpu-impl.h"
#include "ggml-impl.h"
#include "../src/tree-walk.h"
#include "vec.h"

#define GGML_EXT_MAX_CONV 16

// One output: the window's d_conv values of x (at cols) dotted with the kernel row, in order. Not inlined, so that
// both forms of the op run the same machine code, contractions into FMAs included: bit-identical results.
__attribute__((noinline)) static float window_dot(const float * x, const int * cols, const float * w, int d_conv) {
    float sum = 0.0f;
    for (int j = 0; j < d_conv; ++j) {
        sum += x[cols[j]] * w[j];
    }
    return sum;
}

void ggml_ext_cpu_ssm_conv_tree(const struct ggml_compute_params * params, struct ggml_tensor * dst) {
    const struct ggml_tensor * sx     = dst->src[0];   // split form: the state columns only
    const struct ggml_tensor * c      = dst->src[1];
    const struct ggml_tensor * parent = dst->src[2];
    const struct ggml_tensor * xin    = dst->src[3];   // split form: the new inputs [d_inner, n_t, n_s]
    const struct ggml_tensor * copy   = dst->src[4];   // ggml_gdn_conv_tree: where x is copied, or NULL
    const struct ggml_tensor * beta   = dst->src[5];   // ggml_gdn_conv_tree's gates, or NULL

    const int d_conv  = (int) c->ne[0];
    const int d_inner = (int) c->ne[1];
    const int n_t     = (int) (xin != NULL ? xin->ne[1] : sx->ne[0] - (d_conv - 1));
    const int n_s     = (int) sx->ne[2];
    // the conv's values: [d_inner, n_t, n_s] contiguous at the start of dst (then the gates, with beta)
    const size_t out_nb1 = (size_t) d_inner * sizeof(float), out_nb2 = out_nb1 * n_t;
    GGML_ASSERT(d_conv <= GGML_EXT_MAX_CONV);
    GGML_ASSERT(sx->nb[0] == sizeof(float) && c->nb[0] == sizeof(float));

    int64_t r0, r1;   // this thread's channels
    ggml_ext_thread_rows(d_inner, params->ith, params->nth, &r0, &r1);

    int cols[GGML_EXT_MAX_CONV];
    int identity[GGML_EXT_MAX_CONV];
    for (int j = 0; j < GGML_EXT_MAX_CONV; ++j) {
        identity[j] = j;
    }
    for (int s = 0; s < n_s; ++s) {
        const int * par = (const int *) ((const char *) parent->data + s * parent->nb[1]);
        for (int t = 0; t < n_t; ++t) {
            ggml_ext_conv_tree_window(par, t, d_conv, cols);
            float * out = (float *) ((char *) dst->data + t * out_nb1 + s * out_nb2);
            for (int r = r0; r < r1; ++r) {
                const float * x = (const float *) ((const char *) sx->data + r * sx->nb[1] + s * sx->nb[2]);
                const float * w = (const float *) ((const char *) c->data + r * c->nb[1]);
                if (xin == NULL) {
                    out[r] = window_dot(x, cols, w, d_conv);
                } else {   // the window's values gathered, then the very same dot product
                    const char * xr = (const char *) xin->data + r * sizeof(float) + s * xin->nb[2];
                    float win[GGML_EXT_MAX_CONV];
                    for (int j = 0; j < d_conv; ++j) {
                        win[j] = cols[j] < d_conv - 1 ? x[cols[j]] :
                                 *(const float *) (xr + (cols[j] - (d_conv - 1)) * xin->nb[1]);
                    }
                    out[r] = window_dot(win, identity, w, d_conv);
                    if (copy != NULL) {
                        *(float *) ((char *) copy->data + r * sizeof(float) + t * copy->nb[1] + s * copy->nb[2]) =
                            *(const float *) (xr + t * xin->nb[1]);
                    }
                }
            }
        }
    }
    if (dst->op_params[0]) {   // silu: every channel of a row done, then whole rows (ggml_vec_silu_f32's SIMD split)
        ggml_barrier(params->threadpool);
        for (int i = params->ith; i < n_t * n_s; i += params->nth) {
            float * row = (float *) ((char *) dst->data + (i % n_t) * out_nb1 + (i / n_t) * out_nb2);
            ggml_vec_silu_f32(d_inner, row, row);
        }
    }
    if (beta != NULL) {   // the gates (ggml_gdn_gates' values and layout) after the conv's values
        ggml_ext_cpu_gdn_gates_into(params, beta, dst->src[6], (const float *) dst->src[7]->data,
                                    (const float *) dst->src[8]->data, (float *) dst->data + (int64_t) d_inner * n_t);
    }
    const int qk = ggml_get_op_params_i32(dst, 1);
    if (qk > 0) {   // ggml_gdn_conv_tree: the groups of the first qk channels of every column, normed
        const int group   = ggml_get_op_params_i32(dst, 2);
        const float eps   = ggml_get_op_params_f32(dst, 3);
        const float scale = ggml_get_op_params_f32(dst, 4);
        const int per_col = qk / group;
        ggml_barrier(params->threadpool);
        for (int i = params->ith; i < per_col * n_t * n_s; i += params->nth) {
            const int col = i / per_col;
            float * y = (float *) ((char *) dst->data + (col % n_t) * out_nb1 + (col / n_t) * out_nb2) +
                        (int64_t) (i % per_col) * group;
            ggml_float sum = 0.0;
            for (int j = 0; j < group; ++j) {
                sum += (ggml_float) (y[j] * y[j]);
            }
            const float mean = sum / group;
            const float inv  = 1.0f / sqrtf(mean + eps);
            for (int j = 0; j < group; ++j) {
                const float normed = y[j] * inv;   // (rms_norm's result, rounded, then scale's product)
                y[j] = normed * scale;
            }
        }
    }
}
