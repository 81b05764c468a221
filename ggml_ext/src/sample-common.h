#pragma once

// Shared by the CPU and CUDA kernels of ggml_sample_tokens / ggml_sample_probs. Host and device.

#include <stdint.h>
#include <string.h>

#if defined(__CUDACC__)
#define GGML_EXT_SAMPLE_HD __host__ __device__ inline
#else
#define GGML_EXT_SAMPLE_HD static inline
#endif

// An unsigned key that orders like the float (larger float, larger key), so thresholds can be found bit by bit.
GGML_EXT_SAMPLE_HD uint32_t ggml_ext_sample_key(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof(u));
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// The float of a key (ggml_ext_sample_key's inverse).
GGML_EXT_SAMPLE_HD float ggml_ext_sample_unkey(uint32_t k) {
    const uint32_t u = (k & 0x80000000u) ? (k & 0x7fffffffu) : ~k;
    float x;
    memcpy(&x, &u, sizeof(x));
    return x;
}

// The thresholds are the largest key T for which a monotone test holds (count or mass of the keys >= T is large
// enough). Given keys lo <= hi with the test true at every key <= lo and false at every key > hi (the row's
// smallest and largest keys, or a tighter pair), T lies in [lo, hi] and so starts with the bits lo and hi share:
// sets *T to them and returns the highest bit left to decide (-1: none). A bit by bit search from there gives the
// same T as one from bit 31, in fewer passes.
GGML_EXT_SAMPLE_HD int ggml_ext_sample_search_start(uint32_t lo, uint32_t hi, uint32_t * T) {
    const uint32_t diff = lo ^ hi;
    int b = 31;
    while (b >= 0 && !((diff >> b) & 1u)) {
        --b;
    }
    *T = b < 0 ? lo : lo & ~((2u << b) - 1u);   // b == 31: 2u << 31 wraps to 0, the mask to 0
    return b;
}

// A pass of a threshold search decides two bits of T, b and b - 1 (only bit 0 at b == 0), by testing the three
// candidates T | j << (b - 1), j = 1..3 (increasing: the test passes for a leading run of them, T becomes the last
// of that run). Writes them to c[0..2]; returns how many are real (1 at b == 0).
#define GGML_EXT_SAMPLE_TRIES 3
GGML_EXT_SAMPLE_HD int ggml_ext_sample_tries(uint32_t T, int b, uint32_t * c) {
    const int shift = b > 0 ? b - 1 : 0;
    for (int j = 0; j < GGML_EXT_SAMPLE_TRIES; ++j) {
        c[j] = T | ((uint32_t) (j + 1) << shift);
    }
    return b > 0 ? GGML_EXT_SAMPLE_TRIES : 1;
}

// The logit of a token seen `count` times in the history, after the penalties (llama.cpp's rule).
GGML_EXT_SAMPLE_HD float ggml_ext_sample_penalise(float logit, int count, float repeat, float presence,
                                                   float frequency) {
    if (count <= 0) {
        return logit;
    }
    logit = logit <= 0.0f ? logit * repeat : logit / repeat;
    return logit - (float) count * frequency - presence;
}

// How often hist[j] occurs in hist[0..n), or 0 when hist[j] is no token or also occurs before j (so each
// distinct token is penalised once).
GGML_EXT_SAMPLE_HD int ggml_ext_sample_count(const int32_t * hist, int n, int j, int n_vocab) {
    const int32_t tok = hist[j];
    if (tok < 0 || tok >= n_vocab) {
        return 0;
    }
    for (int i = 0; i < j; ++i) {
        if (hist[i] == tok) {
            return 0;
        }
    }
    int count = 0;
    for (int i = j; i < n; ++i) {
        count += hist[i] == tok;
    }
    return count;
}
