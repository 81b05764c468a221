// ggml_gdn_gates on the CPU: threads split the tokens; each value is ggml's own scalar formula (unary-ops.cpp's
// softplus and sigmoid), in the order of the ops it replaces.

#include "ggml-ext-cpu.h"
#include "ggml-cpu-impl.h"
#include "ggml-impl.h"
#include "../src/gdn-gates.h"

void ggml_ext_cpu_gdn_gates_into(const struct ggml_compute_params * params, const struct ggml_tensor * beta,
                                 const struct ggml_tensor * alpha, const float * dt_bias, const float * a,
                                 float * out) {
    const int64_t H = beta->ne[0];
    const int64_t n = beta->ne[1];
    float * g_out    = out;
    float * beta_out = out + H * n;

    for (int64_t t = params->ith; t < n; t += params->nth) {
        const float * b  = (const float *) ((const char *) beta->data + t * beta->nb[1]);
        const float * al = (const float *) ((const char *) alpha->data + t * alpha->nb[1]);
        for (int64_t h = 0; h < H; ++h) {
            g_out[t * H + h]    = ggml_ext_gdn_decay(al[h], dt_bias[h], a[h]);
            beta_out[t * H + h] = ggml_ext_gdn_beta(b[h]);
        }
    }
}

void ggml_ext_cpu_gdn_gates(const struct ggml_compute_params * params, struct ggml_tensor * dst) {
    ggml_ext_cpu_gdn_gates_into(params, dst->src[0], dst->src[1], (const float *) dst->src[2]->data,
                                (const float *) dst->src[3]->data, (float *) dst->data);
}
