// ggml_argmax_first on the CPU: threads split the rows; a strict > keeps the lowest index among equal maxima.

#include "ggml-ext-cpu.h"
#include "ggml-cpu-impl.h"
#include "ggml-impl.h"

void ggml_ext_cpu_argmax_first(const struct ggml_compute_params * params, struct ggml_tensor * dst) {
    const struct ggml_tensor * x = dst->src[0];
    const int64_t n = x->ne[0];
    int32_t * out = (int32_t *) dst->data;

    for (int64_t r = params->ith; r < x->ne[1]; r += params->nth) {
        const float * row = (const float *) ((const char *) x->data + r * x->nb[1]);
        float best = -INFINITY;
        int32_t idx = -1;
        for (int64_t i = 0; i < n; ++i) {
            if (row[i] > best || (idx < 0 && row[i] == best)) {   // the second test: a row of -inf gives 0
                best = row[i];
                idx = (int32_t) i;
            }
        }
        out[r] = idx < 0 ? 0 : idx;
    }
}
