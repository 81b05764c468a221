// GGML_TYPE_TQ3_0 in ggml-base: the rotation, the reference quantiser and the dequantiser (format in ggml-ext.h).

#include "ggml-ext.h"
#include "ggml-impl.h"

#include <math.h>
#include <string.h>

static_assert(sizeof(block_tq3_0) == 14, "block_tq3_0 must be 14 bytes (3.5 bits per value)");

static const float    tq3_0_levels[8] = TQ3_0_LEVELS_INIT;
static const uint32_t tq3_0_signs1[4] = TQ3_0_SIGNS1_INIT;
static const uint32_t tq3_0_signs2[4] = TQ3_0_SIGNS2_INIT;

static inline void tq3_0_flip(float * v, const uint32_t * signs) {
    for (int i = 0; i < TQ3_0_GROUP; ++i) {
        if ((signs[i / 32] >> (i % 32)) & 1) {
            v[i] = -v[i];
        }
    }
}

// In-place unnormalised 128-point Walsh-Hadamard transform (Sylvester order).
static inline void tq3_0_fwht(float * v) {
    for (int len = 1; len < TQ3_0_GROUP; len <<= 1) {
        for (int i = 0; i < TQ3_0_GROUP; i += 2*len) {
            for (int j = i; j < i + len; ++j) {
                const float a = v[j];
                const float b = v[j + len];
                v[j]       = a + b;
                v[j + len] = a - b;
            }
        }
    }
}

static void tq3_0_rotate_group(const float * x, float * y, bool inverse) {
    const float norm = 0.08838834764831845f; // 1/sqrt(128)
    for (int i = 0; i < TQ3_0_GROUP; ++i) {
        y[i] = x[i] * norm;
    }
    tq3_0_flip(y, inverse ? tq3_0_signs2 : tq3_0_signs1);
    tq3_0_fwht(y);
    tq3_0_flip(y, inverse ? tq3_0_signs1 : tq3_0_signs2);
}

void ggml_ext_tq3_0_rotate(const float * x, float * y, int64_t n, bool inverse) {
    GGML_ASSERT(n % TQ3_0_GROUP == 0 && "TQ3_0 rows must be a multiple of 128 values");
    float tmp[TQ3_0_GROUP]; // x and y may be the same buffer
    for (int64_t g = 0; g < n; g += TQ3_0_GROUP) {
        tq3_0_rotate_group(x + g, tmp, inverse);
        memcpy(y + g, tmp, sizeof(tmp));
    }
}

// Index of the nearest level: the levels are sorted, so count the midpoints below u.
static inline int tq3_0_nearest(float u) {
    int idx = 0;
    for (int i = 0; i < 7; ++i) {
        idx += u > 0.5f*(tq3_0_levels[i] + tq3_0_levels[i + 1]);
    }
    return idx;
}

// One 32-value sub-block of already rotated values.
static void tq3_0_quantize_block(const float * y, block_tq3_0 * b) {
    float sumsq = 0.0f;
    for (int j = 0; j < TQ3_0_QK; ++j) {
        sumsq += y[j]*y[j];
    }
    memset(b, 0, sizeof(*b));
    if (!(sumsq > 0.0f)) {
        return; // all zero (or NaN): d = 0 dequantises to zeros
    }
    const float inv_rms = 1.0f / sqrtf(sumsq / TQ3_0_QK);
    float levsq = 0.0f;
    for (int j = 0; j < TQ3_0_QK; ++j) {
        const int idx = tq3_0_nearest(y[j] * inv_rms);
        levsq += tq3_0_levels[idx]*tq3_0_levels[idx];
        b->qs[j % 8] |= (uint8_t) ((idx & 3) << (2*(j / 8)));
        b->qh[j / 8] |= (uint8_t) ((idx >> 2) << (j % 8));
    }
    // norm-preserving scale; clamp to f16's largest finite value
    const float d = fminf(sqrtf(sumsq / levsq), 65504.0f);
    b->d = GGML_FP32_TO_FP16(d);
}

void ggml_ext_quantize_row_tq3_0_ref(const float * x, void * vy, int64_t k) {
    GGML_ASSERT(k % TQ3_0_GROUP == 0 && "TQ3_0 rows must be a multiple of 128 values");
    block_tq3_0 * y = (block_tq3_0 *) vy;
    float rot[TQ3_0_GROUP];
    for (int64_t g = 0; g < k / TQ3_0_GROUP; ++g) {
        tq3_0_rotate_group(x + g*TQ3_0_GROUP, rot, false);
        for (int b = 0; b < TQ3_0_GROUP / TQ3_0_QK; ++b) {
            tq3_0_quantize_block(rot + b*TQ3_0_QK, y + g*(TQ3_0_GROUP / TQ3_0_QK) + b);
        }
    }
}

void ggml_ext_dequantize_row_tq3_0(const void * vx, float * y, int64_t k) {
    GGML_ASSERT(k % TQ3_0_QK == 0);
    const block_tq3_0 * x = (const block_tq3_0 *) vx;
    for (int64_t i = 0; i < k / TQ3_0_QK; ++i) {
        const float d = GGML_FP16_TO_FP32(x[i].d);
        for (int j = 0; j < TQ3_0_QK; ++j) {
            const int idx = ((x[i].qs[j % 8] >> (2*(j / 8))) & 3) | (((x[i].qh[j / 8] >> (j % 8)) & 1) << 2);
            y[i*TQ3_0_QK + j] = d * tq3_0_levels[idx];
        }
    }
}

size_t ggml_ext_quantize_tq3_0(const float * src, void * dst, int64_t nrows, int64_t n_per_row,
                               const float * imatrix) {
    GGML_UNUSED(imatrix); // the codebook is fixed: an importance matrix has nothing to weigh
    const size_t row_size = ggml_row_size(GGML_TYPE_TQ3_0, n_per_row);
    for (int64_t r = 0; r < nrows; ++r) {
        ggml_ext_quantize_row_tq3_0_ref(src + r*n_per_row, (char *) dst + r*row_size, n_per_row);
    }
    return nrows * row_size;
}
