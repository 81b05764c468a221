// GGML_TYPE_TQ3_0 on the CPU: the from_float and vec_dot type traits (ggml-cpu.c routes here). Flash attention,
// set_rows, get_rows and cpy reach TQ3_0 through these traits and the ggml-base to_float.

#include "ggml-ext-cpu.h"
#include "ggml-ext.h"
#include "ggml-impl.h"

static const float tq3_0_levels_cpu[8] = TQ3_0_LEVELS_INIT;

void ggml_ext_cpu_quantize_row_tq3_0(const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t k) {
    ggml_ext_quantize_row_tq3_0_ref(x, y, k);
}

// s = sum over the n values of dequant(x) * y, y in f32 (the vec_dot_type; y is the rotated query).
void ggml_ext_cpu_vec_dot_tq3_0_f32(int n, float * GGML_RESTRICT s, size_t bs, const void * GGML_RESTRICT vx,
                                    size_t bx, const void * GGML_RESTRICT vy, size_t by, int nrc) {
    GGML_UNUSED(bs); GGML_UNUSED(bx); GGML_UNUSED(by);
    GGML_ASSERT(nrc == 1 && n % TQ3_0_QK == 0);
    const block_tq3_0 * x = (const block_tq3_0 *) vx;
    const float       * y = (const float *) vy;

    float sum = 0.0f;
    for (int i = 0; i < n / TQ3_0_QK; ++i) {
        const uint32_t qh = (uint32_t) x[i].qh[0] | (uint32_t) x[i].qh[1] << 8 |
                            (uint32_t) x[i].qh[2] << 16 | (uint32_t) x[i].qh[3] << 24;
        // values j, j+8, j+16, j+24 share byte qs[j]: four independent accumulators vectorise well
        float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        for (int q = 0; q < 4; ++q) {
            for (int j = 0; j < 8; ++j) {
                const int v   = 8*q + j;
                const int idx = ((x[i].qs[j] >> (2*q)) & 3) | (((qh >> v) & 1) << 2);
                acc[q] += tq3_0_levels_cpu[idx] * y[i*TQ3_0_QK + v];
            }
        }
        sum += GGML_FP16_TO_FP32(x[i].d) * ((acc[0] + acc[1]) + (acc[2] + acc[3]));
    }
    *s = sum;
}
