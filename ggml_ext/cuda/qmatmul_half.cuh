// ggml_qmatmul's f16 arithmetic (Q4_K; the shared-stage kernel of qmatmul_shared.cuh with HALF): the weights of a
// K unit dequantised to f16 once for all columns, f16 activations, f16 MMAs (m16n8k16) accumulating in f32 across
// the whole of K. What it saves against the int8 path of qmatmul_mma.cuh: there every 32-value group ends in float
// work per output (scale, convert, accumulate: ~16 float instructions per MMA, so the cost grows with the column
// count); here the per-column work is the MMA alone, and the weight work (a few half2 instructions per value pair)
// is paid once whatever the column count.
//
// Numbers: a weight is round_f16(round_f16(d * sc) * q) (Q4_K's dmin * m term likewise, as round_f16(dmin * m)),
// an activation round_f16(x); the products are exact in the MMA and summed in f32. Q4_K's minimum: sum over a
// sub-block of -dmin*m * x = -dmin*m * (sum of its x): the 8 sub-block sums of a column (f32 sums of the f16 values,
// rounded to f16) sit after its 256 values, and one more MMA per unit takes them (k slots 0-7; 8-15 zero).
//
// Activations: per K unit, per column, QMH_HALF_PITCH halves: values 0..255, the 8 sums, padding (the pitch keeps a
// warp's 16-byte loads of 8 columns on distinct banks). Within a 32-value sub-block thread t4 of a quad holds
// values 8 t4 .. 8 t4 + 7, the first four for the first k16 MMA, the rest for the second (k slots 2 t4, 2 t4 + 1
// and 2 t4 + 8, 2 t4 + 9); A and B use the same permutation of K, so the products are unchanged.

#pragma once

#include "qmatmul_mma.cuh"

#define QMH_HALF_PITCH 288   // halves per column and K unit: 256 values, 8 sums, 24 padding

static __device__ __forceinline__ void mma_f16_k16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#if __CUDA_ARCH__ >= 800
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
                 "{%0, %1, %2, %3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
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

// bytes 0, 1 (hi: 2, 3) of w, each below 1024, as the half2 (b0, b1) exactly: 1024 + b by its bits, minus 1024
static __device__ __forceinline__ half2 qmh_byte_pair(uint32_t w, bool hi) {
    const uint32_t p = __byte_perm(w, 0, hi ? 0x4342 : 0x4140) | 0x64006400u;
    return __hsub2(qmh_u2h(p), __float2half2_rn(1024.0f));
}

// The stage's activations (one K unit): [npad][QMH_HALF_PITCH] halves
template <int NT> struct qmh_cols_half {
    const half * q;

    // column 8t + g's values 32 s + 8 t4 .. + 7 (both k16 steps of sub-block s)
    __device__ __forceinline__ uint4 b16(int t, int s) const {
        const int g = threadIdx.x / 4, t4 = threadIdx.x % 4;
        return *(const uint4 *) (q + (8 * t + g) * QMH_HALF_PITCH + 32 * s + 8 * t4);
    }

    // column 8t + g's sums of sub-blocks 2 t4, 2 t4 + 1
    __device__ __forceinline__ uint32_t bmin(int t) const {
        const int g = threadIdx.x / 4, t4 = threadIdx.x % 4;
        return *(const uint32_t *) (q + (8 * t + g) * QMH_HALF_PITCH + QMM_UNIT + 2 * t4);
    }
};

// One Q4_K unit (super-block) u of this thread's rows (rows[r][h]: row 16 r + 8 h + g), into acc
template <int NT, int RT>
static __device__ __forceinline__ void qmh_unit_q4_k(const char * const (&rows)[RT][2], int u, const qmh_cols_half<NT> & x,
                                                     int t4, float (&acc)[RT][NT][4]) {
    uint32_t dsc[RT][2][4];   // d * sc of sub-blocks (0, 1), (2, 3), (4, 5), (6, 7) as half2
    uint32_t amin[RT][2];     // -dmin * m of sub-blocks 2 t4, 2 t4 + 1: the minimum MMA's A
#pragma unroll
    for (int r = 0; r < RT; ++r) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const uint4 hd = *(const uint4 *) (rows[r][h] + (size_t) u * sizeof(block_q4_K));
            const qmm_k4_scales k4 = qmm_k4_unpack(hd);   // (its float d, dmin unused: the f16 ones are hd.x)
            const half2 dm = qmh_u2h(hd.x);
            const half2 d2 = __low2half2(dm), nmin2 = __hneg2(__high2half2(dm));
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                dsc[r][h][q] = qmh_h2u(__hmul2(qmh_byte_pair(q < 2 ? k4.sc_lo : k4.sc_hi, q % 2), d2));
            }
            amin[r][h] = qmh_h2u(__hmul2(qmh_byte_pair(t4 < 2 ? k4.m_lo : k4.m_hi, t4 % 2), nmin2));
        }
    }
    const half2 k1024 = __float2half2_rn(1024.0f), k16th = __float2half2_rn(1.0f / 16.0f), km64 = __float2half2_rn(-64.0f);
#pragma unroll
    for (int j = 0; j < 4; ++j) {   // sub-blocks 2j (low nibbles of qs bytes 32j..32j+31) and 2j + 1 (high)
        uint2 qs[RT][2];
#pragma unroll
        for (int r = 0; r < RT; ++r) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                qs[r][h] = *(const uint2 *) (rows[r][h] + (size_t) u * sizeof(block_q4_K) + 16 + 32 * j + 8 * t4);
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
                    for (int h = 0; h < 2; ++h) {
                        const uint32_t w  = step ? qs[r][h].y : qs[r][h].x;
                        const half2 sc2   = e ? __high2half2(qmh_u2h(dsc[r][h][j])) : __low2half2(qmh_u2h(dsc[r][h][j]));
                        const uint32_t mask = e ? 0x00F000F0u : 0x000F000Fu;
                        const uint32_t p01 = (__byte_perm(w, 0, 0x4140) & mask) | 0x64006400u;
                        const uint32_t p23 = (__byte_perm(w, 0, 0x4342) & mask) | 0x64006400u;
                        // the exact nibbles: 1024 + v - 1024, or (1024 + 16 v) / 16 - 64
                        const half2 v01 = e ? __hfma2(qmh_u2h(p01), k16th, km64) : __hsub2(qmh_u2h(p01), k1024);
                        const half2 v23 = e ? __hfma2(qmh_u2h(p23), k16th, km64) : __hsub2(qmh_u2h(p23), k1024);
                        a[r][h]     = qmh_h2u(__hmul2(v01, sc2));   // a0/a1: rows g/g+8, k slots 2t4, 2t4+1
                        a[r][h + 2] = qmh_h2u(__hmul2(v23, sc2));   // a2/a3: k slots 2t4+8, 2t4+9
                    }
                }
#pragma unroll
                for (int t = 0; t < NT; ++t) {
                    const uint32_t b0 = step ? b[t].z : b[t].x, b1 = step ? b[t].w : b[t].y;
#pragma unroll
                    for (int r = 0; r < RT; ++r) {
                        mma_f16_k16(acc[r][t], a[r], b0, b1);
                    }
                }
            }
        }
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
