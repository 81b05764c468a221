// GGML_TYPE_TQ3_0 on the CPU: the from_float and vec_dot type traits (ggml-cpu.c routes here). Flash attention,
// set_rows, get_rows and cpy reach TQ3_0 through these traits and the ggml-base to_float.

#include "ggml-ext-cpu.h"
#include "ggml-ext.h"
#include "ggml-impl.h"

static const float tq3_0_levels_cpu[8] = TQ3_0_LEVELS_INIT;

void ggml_ext_cpu_quantize_row_tq3_0(const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t k) {
    ggml_ext_quantize_row_tq3_0_ref(x, y, k);
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

// The 8 levels fill one AVX register, so decoding is a permute: values 8q..8q+7 of a sub-block take their low
// bits from qs[0..7] >> 2q and their high bits from bits 0..7 of qh[q].
static inline __m256 tq3_0_levels_avx2(const __m256 lev, const __m256i qs32, const uint32_t qh_byte, const int q) {
    const __m256i low  = _mm256_and_si256(_mm256_srlv_epi32(qs32, _mm256_set1_epi32(2*q)), _mm256_set1_epi32(3));
    const __m256i high = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int) qh_byte),
                                                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)),
                                          _mm256_set1_epi32(1));
    return _mm256_permutevar8x32_ps(lev, _mm256_or_si256(low, _mm256_slli_epi32(high, 2)));
}
#endif

// s = sum over the n values of dequant(x) * y, y in f32 (the vec_dot_type; y is the rotated query).
void ggml_ext_cpu_vec_dot_tq3_0_f32(int n, float * GGML_RESTRICT s, size_t bs, const void * GGML_RESTRICT vx,
                                    size_t bx, const void * GGML_RESTRICT vy, size_t by, int nrc) {
    GGML_UNUSED(bs); GGML_UNUSED(bx); GGML_UNUSED(by);
    GGML_ASSERT(nrc == 1 && n % TQ3_0_QK == 0);
    const block_tq3_0 * x = (const block_tq3_0 *) vx;
    const float       * y = (const float *) vy;

#if defined(__AVX2__) && defined(__FMA__)
    const __m256 lev = _mm256_loadu_ps(tq3_0_levels_cpu);
    __m256 sumv = _mm256_setzero_ps();
    for (int i = 0; i < n / TQ3_0_QK; ++i) {
        const __m256i qs32 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *) x[i].qs));
        __m256 acc = _mm256_setzero_ps();
        for (int q = 0; q < 4; ++q) {
            acc = _mm256_fmadd_ps(tq3_0_levels_avx2(lev, qs32, x[i].qh[q], q),
                                  _mm256_loadu_ps(y + i*TQ3_0_QK + 8*q), acc);
        }
        sumv = _mm256_fmadd_ps(_mm256_set1_ps(GGML_FP16_TO_FP32(x[i].d)), acc, sumv);
    }
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(sumv), _mm256_extractf128_ps(sumv, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_movehdup_ps(h));
    *s = _mm_cvtss_f32(h);
#else
    float sum = 0.0f;
    for (int i = 0; i < n / TQ3_0_QK; ++i) {
        const uint32_t qh = (uint32_t) x[i].qh[0] | (uint32_t) x[i].qh[1] << 8 |
                            (uint32_t) x[i].qh[2] << 16 | (uint32_t) x[i].qh[3] << 24;
        // values j, j+8, j+16, j+24 share byte qs[j]: four independent accumulators
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
#endif
}

// Dequantise with the CPU's vector units (flash attention's V rows); same values as the ggml-base to_float.
void ggml_ext_cpu_dequantize_row_tq3_0(const void * GGML_RESTRICT vx, float * GGML_RESTRICT y, int64_t k) {
#if defined(__AVX2__) && defined(__FMA__)
    GGML_ASSERT(k % TQ3_0_QK == 0);
    const block_tq3_0 * x = (const block_tq3_0 *) vx;
    const __m256 lev = _mm256_loadu_ps(tq3_0_levels_cpu);
    for (int64_t i = 0; i < k / TQ3_0_QK; ++i) {
        const __m256i qs32 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *) x[i].qs));
        const __m256  d    = _mm256_set1_ps(GGML_FP16_TO_FP32(x[i].d));
        for (int q = 0; q < 4; ++q) {
            _mm256_storeu_ps(y + i*TQ3_0_QK + 8*q, _mm256_mul_ps(d, tq3_0_levels_avx2(lev, qs32, x[i].qh[q], q)));
        }
    }
#else
    ggml_ext_dequantize_row_tq3_0(vx, y, k);
#endif
}
