// ggml_qmatmul's f16 arithmetic (Q4_K, Q6_K; BF16 alike in bf16; the shared-stage kernel of qmatmul_shared.cuh):
// the weights of a K unit dequantised to f16 once for all columns, f16 activations, f16 MMAs (m16n8k16)
// accumulating in f32 across the whole of K. What it saves against the int8 path of qmatmul_mma.cuh: there every 32-value group ends in float
// work per output (scale, convert, accumulate: ~16 float instructions per MMA, so the cost grows with the column
// count); here the per-column work is the MMA alone, and the weight work (a few half2 instructions per value pair)
// is paid once whatever the column count.
//
// Numbers: a weight is round_f16(round_f16(d * sc) * q) (Q4_K's dmin * m term likewise, as round_f16(dmin * m);
// Q6_K's q is its 6-bit value minus 32, its sc the 16-value group's signed 8-bit scale), an activation
// round_f16(x) (BF16: the weight as stored, an activation round_bf16(x)); the products are exact in the MMA and
// summed in f32. Q4_K's minimum: sum over a
// sub-block of -dmin*m * x = -dmin*m * (sum of its x): the 8 sub-block sums of a column (f32 sums of the f16 values,
// rounded to f16) sit after its 256 values, and one more MMA per unit takes them (k slots 0-7; 8-15 zero).
//
// Activations: ggml-ext.h's prepared layout (per K unit, npad QMH_HALF_PITCH halves: chunks of npad x 8). Within a
// 32-value sub-block thread t4 of a quad holds values 8 t4 .. 8 t4 + 7, the first four for the first k16 MMA, the
// rest for the second (k slots 2 t4, 2 t4 + 1 and 2 t4 + 8, 2 t4 + 9); A and B use the same permutation of K, so
// the products are unchanged, and the layout's chunks are that permutation's 8 x 8 tiles of B.

#pragma once

#include "qmatmul_mma.cuh"

#define QMH_HALF_PITCH GGML_EXT_QMATMUL_HALF_PITCH   // halves per column and K unit (36 chunks of 8)

// c += A B over one m16n8k16 tile, f32 sums; A and B f16 pairs (BF16: bf16 pairs)
#define QMH_MMA_K16(AB)                                                                                            \
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." AB "." AB ".f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "  \
                 "{%8, %9}, {%0, %1, %2, %3};"                                                                     \
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])                                                  \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1))

template <bool BF16 = false>
static __device__ __forceinline__ void mma_f16_k16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#if __CUDA_ARCH__ >= 800
    if constexpr (BF16) {
        QMH_MMA_K16("bf16");
    } else {
        QMH_MMA_K16("f16");
    }
#else
    GGML_UNUSED_VARS(c, a, b0, b1);
    NO_DEVICE_CODE;
#endif
}

static __device__ __forceinline__ uint32_t qmh_h2u(half2 h) {
    return *(const uint32_t *) &h;
}

static __device__ __forceinline__ half2 qmh_u2h(uint32_t u) {
    return *(const half2 *) &u;
}

// (a & b) | c in one LOP3 (written out: the compiler makes two of it when b and c are both constants)
static __device__ __forceinline__ uint32_t qmh_and_or(uint32_t a, uint32_t b, uint32_t c) {
    uint32_t d;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

// bytes 0, 1 (hi: 2, 3) of w, each below 1024, as the half2 (b0, b1) exactly: 1024 + b by its bits, minus 1024
static __device__ __forceinline__ half2 qmh_byte_pair(uint32_t w, bool hi) {
    const uint32_t p = __byte_perm(w, 0x64646464u, hi ? 0x4342 : 0x4140);   // (the 0x64 bytes from the second word)
    return __hsub2(qmh_u2h(p), __float2half2_rn(1024.0f));
}

// The stage's activations (one K unit, 8 NT columns): ggml-ext.h's prepared layout, chunks of 8 NT x 8 halves
template <int NT> struct qmh_cols_half {
    const half * q;

    // column 8t + g's values 32 s + 8 t4 .. + 7 (both k16 steps of sub-block s) as {.x, .y} (step 0: k slots 2 t4,
    // 2 t4 + 1 and 2 t4 + 8, + 9) and {.z, .w} (step 1): chunks 4 s .. 4 s + 3 of column tile t, one 8 x 8 tile each,
    // by one ldmatrix (lanes 8 m .. 8 m + 7 give the rows of chunk 4 s + m)
    __device__ __forceinline__ uint4 b16(int t, int s) const {
        const int lane = threadIdx.x;
        const half * row = q + ((4 * s + lane / 8) * 8 * NT + 8 * t + lane % 8) * 8;
        uint4 b;
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                     : "=r"(b.x), "=r"(b.y), "=r"(b.z), "=r"(b.w) : "r"((uint32_t) __cvta_generic_to_shared(row)));
        return b;
    }

    // column 8t + g's sums of sub-blocks 2 t4, 2 t4 + 1
    __device__ __forceinline__ uint32_t bmin(int t) const {
        const int g = threadIdx.x / 4, t4 = threadIdx.x % 4;
        return *(const uint32_t *) (q + GGML_EXT_QMATMUL_HALF_AT(QMM_UNIT + 2 * t4, 8 * t + g, 8 * NT));
    }
};

// One k16 step of a sub-block: each row tile's A against every column tile's B (step 0: values 8 t4 .. + 3 of the
// sub-block, b.x/b.y; step 1: the next four, b.z/b.w)
template <bool BF16 = false, int NT, int RT>
static __device__ __forceinline__ void qmh_mma_step(float (&acc)[RT][NT][4], const uint32_t (&a)[RT][4],
                                                    const uint4 (&b)[NT], int step) {
#pragma unroll
    for (int t = 0; t < NT; ++t) {
        const uint32_t b0 = step ? b[t].z : b[t].x, b1 = step ? b[t].w : b[t].y;
#pragma unroll
        for (int r = 0; r < RT; ++r) {
            mma_f16_k16<BF16>(acc[r][t], a[r], b0, b1);
        }
    }
}

// The A registers of one row (h: g or g + 8) for a k16 step of a Q4_K sub-block: w, the qs word of its 4 values (low
// nibbles for e = 0, high for e = 1), dsc2 the d * sc pair of sub-blocks (2j, 2j + 1), FOLD's nms2 the -M * s pair;
// lo: k slots 2 t4, 2 t4 + 1, hi: 2 t4 + 8, + 9 (qmh_q4_k_weights says how)
template <bool FOLD>
static __device__ __forceinline__ void qmh_q4_k_a(uint32_t w, int e, uint32_t dsc2, uint32_t nms2_pair, uint32_t & lo,
                                                  uint32_t & hi) {
    const half2 sc2   = e ? __high2half2(qmh_u2h(dsc2)) : __low2half2(qmh_u2h(dsc2));
    const uint32_t mask = e ? 0x00F000F0u : 0x000F000Fu;
    const uint32_t magic = FOLD && e ? 0x54005400u : 0x64006400u;   // 64 or 1024 by its bits
    const uint32_t p01 = qmh_and_or(__byte_perm(w, 0, 0x4140), mask, magic);
    const uint32_t p23 = qmh_and_or(__byte_perm(w, 0, 0x4342), mask, magic);
    if constexpr (FOLD) {
        const half2 nms2 = e ? __high2half2(qmh_u2h(nms2_pair)) : __low2half2(qmh_u2h(nms2_pair));
        lo = qmh_h2u(__hfma2(qmh_u2h(p01), sc2, nms2));
        hi = qmh_h2u(__hfma2(qmh_u2h(p23), sc2, nms2));
    } else {
        // the exact nibbles: 1024 + v - 1024, or (1024 + 16 v) / 16 - 64
        const half2 k1024 = __float2half2_rn(1024.0f), k16th = __float2half2_rn(1.0f / 16.0f);
        const half2 km64 = __float2half2_rn(-64.0f);
        const half2 v01 = e ? __hfma2(qmh_u2h(p01), k16th, km64) : __hsub2(qmh_u2h(p01), k1024);
        const half2 v23 = e ? __hfma2(qmh_u2h(p23), k16th, km64) : __hsub2(qmh_u2h(p23), k1024);
        lo = qmh_h2u(__hmul2(v01, sc2));
        hi = qmh_h2u(__hmul2(v23, sc2));
    }
}

// The -M * s pair of FOLD for a d * sc pair (sub-blocks 2j, 2j + 1; else unused)
template <bool FOLD> static __device__ __forceinline__ uint32_t qmh_q4_k_nms(uint32_t dsc2) {
    const half2 fold_m = __halves2half2(__float2half_rn(-1024.0f), __float2half_rn(-64.0f));   // -M, sub-blocks 2j, 2j+1
    return FOLD ? qmh_h2u(__hmul2(qmh_u2h(dsc2), fold_m)) : 0u;
}

// The Q4_K weights of a unit into acc (the minimum's MMA apart): dsc[r][h][j] holds d * sc of sub-blocks 2j, 2j + 1
// as a half2. FOLD: a nibble q becomes the half M + q by its bits alone (low nibbles at bits 0-3: M = 1024; high ones
// at bits 4-7: M = 64), and the weight is one FMA, (M + q) * s - M * s: exact before its one rounding, so the same
// round_f16(q * s) as q's exact half times s, while M * s is finite (|s| < 64: the caller's check). Otherwise q's
// half is (M + q) - M and the weight a product: two instructions a pair.
template <bool FOLD, int NT, int RT>
static __device__ __forceinline__ void qmh_q4_k_weights(const char * const (&rows)[RT][2], const qmh_cols_half<NT> & x,
                                                        int t4, const uint32_t (&dsc)[RT][2][4], float (&acc)[RT][NT][4]) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {   // sub-blocks 2j (low nibbles of qs bytes 32j..32j+31) and 2j + 1 (high)
        uint2 qs[RT][2];
        uint32_t nms[RT][2];   // FOLD: -M * s of sub-blocks 2j, 2j + 1
#pragma unroll
        for (int r = 0; r < RT; ++r) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                qs[r][h]  = *(const uint2 *) (rows[r][h] + 16 + 32 * j + 8 * t4);
                nms[r][h] = qmh_q4_k_nms<FOLD>(dsc[r][h][j]);
            }
        }
#pragma unroll
        for (int e = 0; e < 2; ++e) {   // sub-block 2j + e
            uint4 b[NT];
#pragma unroll
            for (int t = 0; t < NT; ++t) {
                b[t] = x.b16(t, 2 * j + e);
            }
#pragma unroll
            for (int step = 0; step < 2; ++step) {   // values 8 t4 + 4 step .. + 3: word .x (step 0) or .y of qs
                uint32_t a[RT][4];
#pragma unroll
                for (int r = 0; r < RT; ++r) {
#pragma unroll
                    for (int h = 0; h < 2; ++h) {   // a0/a1: rows g/g+8, k slots 2t4, 2t4+1; a2/a3: 2t4+8, 2t4+9
                        qmh_q4_k_a<FOLD>(step ? qs[r][h].y : qs[r][h].x, e, dsc[r][h][j], nms[r][h], a[r][h], a[r][h + 2]);
                    }
                }
                qmh_mma_step(acc, a, b, step);
            }
        }
    }
}

// A row's Q4_K unit header: d * sc of sub-blocks (0, 1), (2, 3), (4, 5), (6, 7) as half2, and -dmin * m of sub-blocks
// 2 t4, 2 t4 + 1 (the minimum MMA's A); returns (d, dmin)
static __device__ __forceinline__ half2 qmh_q4_k_scales(const char * unit, int t4, uint32_t (&dsc)[4], uint32_t & amin) {
    const uint4 hd = *(const uint4 *) unit;
    const qmm_k4_scales k4 = qmm_k4_unpack(hd);   // (its float d, dmin unused: the f16 ones are hd.x)
    const half2 dm = qmh_u2h(hd.x);
    const half2 d2 = __low2half2(dm), nmin2 = __hneg2(__high2half2(dm));
#pragma unroll
    for (int q = 0; q < 4; ++q) {
        dsc[q] = qmh_h2u(__hmul2(qmh_byte_pair(q < 2 ? k4.sc_lo : k4.sc_hi, q % 2), d2));
    }
    amin = qmh_h2u(__hmul2(qmh_byte_pair(t4 < 2 ? k4.m_lo : k4.m_hi, t4 % 2), nmin2));
    return dm;
}

// One Q4_K unit (super-block) of this thread's rows (rows[r][h]: row 16 r + 8 h + g's unit), into acc
template <int NT, int RT>
static __device__ __forceinline__ void qmh_unit_q4_k(const char * const (&rows)[RT][2], const qmh_cols_half<NT> & x,
                                                     int t4, float (&acc)[RT][NT][4]) {
    uint32_t dsc[RT][2][4];   // d * sc of sub-blocks (0, 1), (2, 3), (4, 5), (6, 7) as half2
    uint32_t amin[RT][2];     // -dmin * m of sub-blocks 2 t4, 2 t4 + 1: the minimum MMA's A
    bool small = true;        // |d| < 1: every d * sc below 64, so 1024 d * sc finite (the folded weights)
#pragma unroll
    for (int r = 0; r < RT; ++r) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const half2 dm = qmh_q4_k_scales(rows[r][h], t4, dsc[r][h], amin[r][h]);
            small = small && fabsf(__low2float(dm)) < 1.0f;   // (false for NaN)
        }
    }
    if (__all_sync(0xFFFFFFFFu, small)) {   // the warp's 16 RT rows: one path for all
        qmh_q4_k_weights<true>(rows, x, t4, dsc, acc);
    } else {
        qmh_q4_k_weights<false>(rows, x, t4, dsc, acc);
    }
    // the minimum: -dmin*m (k slots 2 t4, 2 t4 + 1) times the sub-block sums
#pragma unroll
    for (int t = 0; t < NT; ++t) {
        const uint32_t bm = x.bmin(t);
#pragma unroll
        for (int r = 0; r < RT; ++r) {
            const uint32_t a[4] = {amin[r][0], amin[r][1], 0u, 0u};
            mma_f16_k16(acc[r][t], a, bm, 0u);
        }
    }
}

// One Q6_K unit of this thread's rows (rows[r][h]: row 16 r + 8 h + g's unit, at an even shared-memory address), into
// acc. The unit is ql[128] (low nibbles), qh[64] (2 high bits), scales[16] (int8, one per 16 values), d (f16); the
// 32 values 128 hh + 32 c + l (l < 32) are (ql[64 hh + 32 (c % 2) + l] >> 4 (c / 2)) & 15, plus qh[32 hh + l]'s bits
// 2c, 2c + 1 as 16, 32, minus 32, scaled by scales[8 hh + 2 c + l / 16]. Thread t4 of a quad holds l = 8 t4 .. + 7 of
// each such run, as in the Q4_K unit (one scale for all 8).
template <int NT, int RT>
static __device__ __forceinline__ void qmh_unit_q6_k(const char * const (&rows)[RT][2], const qmh_cols_half<NT> & x,
                                                     int t4, float (&acc)[RT][NT][4]) {
    static_assert(sizeof(block_q6_K) == 210, "unexpected Q6_K block layout");   // ql[128], qh[64], scales[16], d
    // a unit's aligned words, and the byte permute that realigns a word pair starting 2 bytes in (units start at
    // even bytes: every field read below is at a multiple of 4 from the unit's start)
    const uint32_t * base[RT][2];
    uint32_t sel[RT][2];
#pragma unroll
    for (int r = 0; r < RT; ++r) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int mis = (int) ((uintptr_t) rows[r][h] & 3);
            base[r][h] = (const uint32_t *) (rows[r][h] - mis);
            sel[r][h]  = mis ? 0x5432 : 0x3210;
        }
    }
    auto word = [&](int r, int h, int byte) {   // the unit's 4 bytes at `byte` (a multiple of 4)
        const uint32_t * w = base[r][h] + byte / 4;
        return __byte_perm(w[0], w[1], sel[r][h]);
    };
    auto words = [&](int r, int h, int byte) {   // 8 bytes
        const uint32_t * w = base[r][h] + byte / 4;
        const uint32_t w1 = w[1];
        return make_uint2(__byte_perm(w[0], w1, sel[r][h]), __byte_perm(w1, w[2], sel[r][h]));
    };
    // d * sc of groups 8 hh + 2 c + t4 / 2 as half2 pairs: dsc[.][.][2 hh + c / 2] holds c = 2 (c / 2) and the next;
    // an int8 scale is exact in f16 as (1024 + 128 + sc) - 1152
    uint32_t dsc[RT][2][4];
    const uint32_t pick = 0x4040u | (t4 / 2) | ((2 + t4 / 2) << 8);   // bytes t4 / 2 and 2 + t4 / 2, then 0x64
    const half2 k1152 = __float2half2_rn(1152.0f);
#pragma unroll
    for (int r = 0; r < RT; ++r) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const half2 d2 = __low2half2(qmh_u2h(word(r, h, 208)));
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                const uint32_t sc = __byte_perm(word(r, h, 192 + 4 * q) ^ 0x80808080u, 0x64, pick);
                dsc[r][h][q] = qmh_h2u(__hmul2(__hsub2(qmh_u2h(sc), k1152), d2));
            }
        }
    }
    const half2 k1056 = __float2half2_rn(1056.0f);
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
        uint2 ql[RT][2][2], qh[RT][2];   // ql bytes 64 hh + 32 i + 8 t4 .. + 7, qh bytes 32 hh + 8 t4 .. + 7
#pragma unroll
        for (int r = 0; r < RT; ++r) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                ql[r][h][0] = words(r, h, 64 * hh + 8 * t4);
                ql[r][h][1] = words(r, h, 64 * hh + 32 + 8 * t4);
                qh[r][h]    = words(r, h, 128 + 32 * hh + 8 * t4);
            }
        }
#pragma unroll
        for (int c = 0; c < 4; ++c) {   // values 128 hh + 32 c + 8 t4 .. + 7: the activations' sub-block 4 hh + c
            uint4 b[NT];
#pragma unroll
            for (int t = 0; t < NT; ++t) {
                b[t] = x.b16(t, 4 * hh + c);
            }
#pragma unroll
            for (int step = 0; step < 2; ++step) {   // values 8 t4 + 4 step .. + 3
                uint32_t a[RT][4];
#pragma unroll
                for (int r = 0; r < RT; ++r) {
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        const uint32_t wl = step ? ql[r][h][c % 2].y : ql[r][h][c % 2].x;
                        const uint32_t wh = step ? qh[r][h].y : qh[r][h].x;
                        const uint32_t lo = c < 2 ? wl : wl >> 4;
                        const uint32_t hi = c == 0 ? wh << 4 : c == 1 ? wh << 2 : c == 2 ? wh : wh >> 2;
                        const uint32_t v  = (lo & 0x0F0F0F0Fu) | (hi & 0x30303030u);   // four 6-bit values
                        const half2 sc2 = c % 2 ? __high2half2(qmh_u2h(dsc[r][h][2 * hh + c / 2]))
                                                : __low2half2(qmh_u2h(dsc[r][h][2 * hh + c / 2]));
                        // the exact values minus 32: 1024 + v by its bits, minus 1056
                        const half2 v01 = __hsub2(qmh_u2h(__byte_perm(v, 0x64, 0x4140)), k1056);
                        const half2 v23 = __hsub2(qmh_u2h(__byte_perm(v, 0x64, 0x4342)), k1056);
                        a[r][h]     = qmh_h2u(__hmul2(v01, sc2));   // a0/a1: rows g/g+8, k slots 2t4, 2t4+1
                        a[r][h + 2] = qmh_h2u(__hmul2(v23, sc2));   // a2/a3: k slots 2t4+8, 2t4+9
                    }
                }
                qmh_mma_step(acc, a, b, step);
            }
        }
    }
}

// 256 BF16 weights of this thread's rows (rows[r][h]: row 16 r + 8 h + g's 512 bytes), into acc: nothing to decode,
// each 16-byte load of a row holds the A values of both k16 steps of a sub-block (as in the Q4_K unit: thread t4
// of a quad takes values 8 t4 .. + 7 of each 32); the activations are bf16 in the same layout (QMM_X_BF16).
template <int NT, int RT>
static __device__ __forceinline__ void qmh_unit_bf16(const char * const (&rows)[RT][2], const qmh_cols_half<NT> & x,
                                                     int t4, float (&acc)[RT][NT][4]) {
#pragma unroll
    for (int s = 0; s < 8; ++s) {
        uint4 w[RT][2];
#pragma unroll
        for (int r = 0; r < RT; ++r) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                w[r][h] = *(const uint4 *) (rows[r][h] + 64 * s + 16 * t4);
            }
        }
        uint4 b[NT];
#pragma unroll
        for (int t = 0; t < NT; ++t) {
            b[t] = x.b16(t, s);
        }
#pragma unroll
        for (int step = 0; step < 2; ++step) {
            uint32_t a[RT][4];
#pragma unroll
            for (int r = 0; r < RT; ++r) {
                a[r][0] = step ? w[r][0].z : w[r][0].x;   // rows g/g+8, k slots 2t4, 2t4+1
                a[r][1] = step ? w[r][1].z : w[r][1].x;
                a[r][2] = step ? w[r][0].w : w[r][0].y;   // k slots 2t4+8, 2t4+9
                a[r][3] = step ? w[r][1].w : w[r][1].y;
            }
            qmh_mma_step<true>(acc, a, b, step);
        }
    }
}
