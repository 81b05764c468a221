// ggml_flash_attn_ordered on the CPU: threads split the (query, head) pairs; each pair folds its unmasked cells
// one at a time in ascending order, by the rule in ggml-ext.h (the same rule as the CUDA kernel; the two are not
// bit-identical to each other, but each is to itself for any number of queries).

#include "ggml-ext-cpu.h"
#include "ggml-cpu-impl.h"
#include "ggml-impl.h"

#include <math.h>

size_t ggml_ext_cpu_flash_attn_ordered_work_size(const struct ggml_tensor * node, int n_tasks) {
    // one output-row accumulator per thread, padded to a cache line
    return (size_t) n_tasks * (node->src[0]->ne[0] + 16) * sizeof(float);
}

// q.k over D values: 4 partial sums (d mod 4), each in ascending d, then (s0 + s1) + (s2 + s3)
static float dot_q_k(const float * q, const ggml_fp16_t * k, int64_t D) {
    float part[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int64_t d = 0; d < D; ++d) {
        part[d & 3] += q[d] * GGML_FP16_TO_FP32(k[d]);
    }
    return (part[0] + part[1]) + (part[2] + part[3]);
}

void ggml_ext_cpu_flash_attn_ordered(const struct ggml_compute_params * params, struct ggml_tensor * dst) {
    const struct ggml_tensor * q    = dst->src[0];
    const struct ggml_tensor * k    = dst->src[1];
    const struct ggml_tensor * v    = dst->src[2];
    const struct ggml_tensor * mask = dst->src[3];

    const int64_t D     = q->ne[0];
    const int64_t n_q   = q->ne[1];
    const int64_t H_q   = q->ne[2];
    const int64_t n_kv  = k->ne[1];
    const int64_t ratio = H_q / k->ne[2];
    const float   scale = ggml_get_op_params_f32(dst, 0);

    float * acc = (float *) params->wdata + params->ith * (D + 16);

    for (int64_t pair = params->ith; pair < n_q * H_q; pair += params->nth) {
        const int64_t i  = pair / H_q;
        const int64_t h  = pair % H_q;
        const int64_t hk = h / ratio;
        const float * qr = (const float *) ((const char *) q->data + i * q->nb[1] + h * q->nb[2]);
        const ggml_fp16_t * mrow = (const ggml_fp16_t *) ((const char *) mask->data + i * mask->nb[1]);

        float m = -INFINITY;
        float l = 0.0f;
        for (int64_t d = 0; d < D; ++d) {
            acc[d] = 0.0f;
        }
        for (int64_t j = 0; j < n_kv; ++j) {
            const float mk = GGML_FP16_TO_FP32(mrow[j]);
            if (mk == -INFINITY) {
                continue;   // a removed cell is never read: its K/V may be anything
            }
            const ggml_fp16_t * kr = (const ggml_fp16_t *) ((const char *) k->data + j * k->nb[1] + hk * k->nb[2]);
            const ggml_fp16_t * vr = (const ggml_fp16_t *) ((const char *) v->data + j * v->nb[1] + hk * v->nb[2]);
            const float s = scale * dot_q_k(qr, kr, D) + mk;
            if (s > m) {
                const float r = expf(m - s);
                l *= r;
                for (int64_t d = 0; d < D; ++d) {
                    acc[d] *= r;
                }
                m = s;
            }
            const float p = expf(s - m);
            l += p;
            for (int64_t d = 0; d < D; ++d) {
                acc[d] += p * GGML_FP16_TO_FP32(vr[d]);
            }
        }
        float * out = (float *) ((char *) dst->data + h * dst->nb[1] + i * dst->nb[2]);
        for (int64_t d = 0; d < D; ++d) {
            out[d] = l > 0.0f ? acc[d] / l : 0.0f;
        }
    }
}
