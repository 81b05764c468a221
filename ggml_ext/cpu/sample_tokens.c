// ggml_sample_tokens / ggml_sample_probs on the CPU: threads split the rows; each thread penalises its row in a
// scratch copy, finds the top-k and top-p thresholds on the float keys two bits per pass (from the highest bit
// that the row's smallest and largest keys do not share; the top-p passes over a second scratch row of
// exp(x - max), computed once), then draws (sums in double). The CUDA kernel runs the same searches.

#include "ggml-ext-cpu.h"
#include "ggml-cpu-impl.h"
#include "ggml-ext.h"
#include "ggml-impl.h"
#include "../src/sample-common.h"

#include <math.h>

#define GGML_EXT_LINE_F32 16

size_t ggml_ext_cpu_sample_tokens_work_size(const struct ggml_tensor * node, int n_tasks) {
    return (size_t) ((2 * node->src[0]->ne[0] + GGML_EXT_LINE_F32) * n_tasks) * sizeof(float);
}

// The largest key T with count(key >= T) >= k: the key of the k-th largest logit (lo, hi: the row's smallest and
// largest keys).
static uint32_t top_k_key(const float * x, int64_t n, int64_t k, uint32_t lo, uint32_t hi) {
    uint32_t T;
    for (int b = ggml_ext_sample_search_start(lo, hi, &T); b >= 0; b -= 2) {
        uint32_t c[GGML_EXT_SAMPLE_TRIES];
        const int n_tries = ggml_ext_sample_tries(T, b, c);
        int64_t count[GGML_EXT_SAMPLE_TRIES] = { 0 };
        for (int64_t i = 0; i < n; ++i) {
            const uint32_t key = ggml_ext_sample_key(x[i]);
            for (int j = 0; j < GGML_EXT_SAMPLE_TRIES; ++j) {
                count[j] += key >= c[j];
            }
        }
        for (int j = 0; j < n_tries && count[j] >= k; ++j) {
            T = c[j];
        }
    }
    return T;
}

static void sample_row(const float * logits, const int32_t * hist, int n_hist, const float * par, float u,
                       int64_t n, float * x, float * e, int32_t * token, float * probs) {
    memcpy(x, logits, n * sizeof(float));
    const float repeat = par[GGML_EXT_SAMPLE_REPEAT_PENALTY];
    const float presence = par[GGML_EXT_SAMPLE_PRESENCE_PENALTY];
    const float frequency = par[GGML_EXT_SAMPLE_FREQUENCY_PENALTY];
    if (repeat != 1.0f || presence != 0.0f || frequency != 0.0f) {
        for (int j = 0; j < n_hist; ++j) {
            const int count = ggml_ext_sample_count(hist, n_hist, j, (int) n);
            if (count > 0) {
                x[hist[j]] = ggml_ext_sample_penalise(x[hist[j]], count, repeat, presence, frequency);
            }
        }
    }
    int64_t best = 0;
    uint32_t lo = ggml_ext_sample_key(x[0]);
    for (int64_t i = 1; i < n; ++i) {
        if (x[i] > x[best]) {
            best = i;
        }
        const uint32_t key = ggml_ext_sample_key(x[i]);
        lo = key < lo ? key : lo;
    }
    const uint32_t hi = ggml_ext_sample_key(x[best]);
    const float m = x[best];
    const float temperature = par[GGML_EXT_SAMPLE_TEMPERATURE];
    if (!(temperature > 0.0f)) {
        if (token) {
            *token = (int32_t) best;
        } else {
            memset(probs, 0, n * sizeof(float));
            probs[best] = 1.0f;
        }
        return;
    }
    uint32_t floor_key = 0;
    const int64_t k = (int64_t) par[GGML_EXT_SAMPLE_TOP_K];
    if (k > 0 && k < n) {
        floor_key = top_k_key(x, n, k, lo, hi);
    }
    const float top_p = par[GGML_EXT_SAMPLE_TOP_P];
    if (top_p < 1.0f) {
        for (int64_t i = 0; i < n; ++i) {
            e[i] = (float) exp((double) x[i] - m);
        }
        double kept = 0.0;
        for (int64_t i = 0; i < n; ++i) {
            kept += ggml_ext_sample_key(x[i]) >= floor_key ? e[i] : 0.0;
        }
        const double want = (double) top_p * kept;
        // the test holds up to the top-k floor (and the smallest key), and fails above the largest (no mass there)
        uint32_t T;
        for (int b = ggml_ext_sample_search_start(floor_key > lo ? floor_key : lo, hi, &T); b >= 0; b -= 2) {
            uint32_t c[GGML_EXT_SAMPLE_TRIES];
            const int n_tries = ggml_ext_sample_tries(T, b, c);
            uint32_t from[GGML_EXT_SAMPLE_TRIES];     // the mass tested is that of the kept tokens at or above c
            double mass[GGML_EXT_SAMPLE_TRIES] = { 0.0 };
            for (int j = 0; j < GGML_EXT_SAMPLE_TRIES; ++j) {
                from[j] = c[j] > floor_key ? c[j] : floor_key;
            }
            for (int64_t i = 0; i < n; ++i) {
                const uint32_t key = ggml_ext_sample_key(x[i]);
                for (int j = 0; j < GGML_EXT_SAMPLE_TRIES; ++j) {
                    mass[j] += key >= from[j] ? e[i] : 0.0;
                }
            }
            for (int j = 0; j < n_tries && mass[j] >= want; ++j) {
                T = c[j];
            }
        }
        floor_key = T > floor_key ? T : floor_key;
    }
    const float min_p = par[GGML_EXT_SAMPLE_MIN_P];
    double total = 0.0;
    for (int64_t i = 0; i < n; ++i) {
        const int kept = ggml_ext_sample_key(x[i]) >= floor_key && (min_p <= 0.0f || expf(x[i] - m) >= min_p);
        // x now holds each token's unnormalised probability (0: filtered out)
        x[i] = kept ? (float) exp(((double) x[i] - m) / temperature) : 0.0f;
        total += x[i];
    }
    if (probs) {
        for (int64_t i = 0; i < n; ++i) {
            probs[i] = (float) (x[i] / total);
        }
        return;
    }
    const double target = (double) u * total;
    double cum = 0.0;
    int64_t last = best;
    for (int64_t i = 0; i < n; ++i) {
        if (x[i] > 0.0f) {
            cum += x[i];
            last = i;
            if (cum > target) {
                break;
            }
        }
    }
    *token = (int32_t) last;
}

void ggml_ext_cpu_sample_tokens(const struct ggml_compute_params * params, struct ggml_tensor * dst) {
    const struct ggml_tensor * logits = dst->src[0];
    const struct ggml_tensor * hist   = dst->src[1];
    const struct ggml_tensor * par    = dst->src[2];
    const struct ggml_tensor * rand   = dst->src[3];
    const int want_probs = dst->op_params[0];

    const int64_t n_vocab = logits->ne[0];
    const int64_t n_rows  = logits->ne[1];
    float * x = (float *) params->wdata + params->ith * (2 * n_vocab + GGML_EXT_LINE_F32);
    float * e = x + n_vocab;

    for (int64_t r = params->ith; r < n_rows; r += params->nth) {
        const float * row = (const float *) ((const char *) logits->data + r * logits->nb[1]);
        const int32_t * h = (const int32_t *) ((const char *) hist->data + r * hist->nb[1]);
        if (want_probs) {
            float * out = (float *) ((char *) dst->data + r * dst->nb[1]);
            sample_row(row, h, (int) hist->ne[0], (const float *) par->data, 0.0f, n_vocab, x, e, NULL, out);
        } else {
            const float u = ((const float *) rand->data)[r];
            sample_row(row, h, (int) hist->ne[0], (const float *) par->data, u, n_vocab, x, e,
                       (int32_t *) dst->data + r, NULL);
        }
    }
}
