// ggml_top_k_logp on the CPU: threads split the rows. Each row is scanned once for its k best keys (the total
// order of ggml-ext-top-k-key.h, kept sorted by insertion) and its max, then once for the sum of exp(x - max)
// (float terms, a double sum).

#include "ggml-ext-cpu.h"
#include "ggml-ext-top-k-key.h"
#include "ggml-ext.h"
#include "ggml-cpu-impl.h"
#include "ggml-impl.h"

#include <math.h>

void ggml_ext_cpu_top_k_logp(const struct ggml_compute_params * params, struct ggml_tensor * dst) {
    const struct ggml_tensor * x = dst->src[0];
    const int64_t n = x->ne[0];
    const int k = dst->op_params[0];

    for (int64_t r = params->ith; r < x->ne[1]; r += params->nth) {
        const float * row = (const float *) ((const char *) x->data + r * x->nb[1]);
        uint64_t best[GGML_EXT_TOP_K_LOGP_MAX_K] = {0};     // descending; 0: an empty slot
        float max = -INFINITY;
        for (int64_t i = 0; i < n; ++i) {
            const float v = row[i];
            if (v > max) {
                max = v;
            }
            const uint64_t key = ggml_ext_top_k_key(v, (uint32_t) i);
            if (key > best[k - 1]) {
                int j = k - 1;
                for (; j > 0 && best[j - 1] < key; --j) {
                    best[j] = best[j - 1];
                }
                best[j] = key;
            }
        }
        double sum = 0.0;
        for (int64_t i = 0; i < n; ++i) {
            if (row[i] != -INFINITY) {      // also keeps a row of only -inf from computing -inf - -inf
                sum += expf(row[i] - max);      // each term within an ulp; the sum in double
            }
        }
        const double lse = (double) max + log(sum);  // -inf for a row of only -inf, NaN if the row has a NaN

        float * out = (float *) ((char *) dst->data + r * dst->nb[2]);
        for (int j = 0; j < k; ++j) {
            const uint32_t id = ggml_ext_top_k_key_id(best[j]);
            out[j]     = lse == -INFINITY ? -INFINITY : (float) ((double) row[id] - lse);
            out[k + j] = (float) id;
        }
    }
}
