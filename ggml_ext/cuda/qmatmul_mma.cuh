// ggml_qmatmul on tensor cores (all four weight types, Ampere and later): the kernel, compiled once per weight
// type in qmatmul_mma_<type>.cu (so that the build compiles the types in parallel); qmatmul.cu quantises the
// activations and launches it.

#pragma once

#include "ggml-ext-cuda.cuh"
#include "ggml-ext.h"

#include <cstdint>

// --- Design ---------------------------------------------------------------------------------------------------
// Int8 MMA, 16 weight rows x 8 columns per instruction, keeps the cost of 48 columns near that of one. Q4_K, Q5_K
// and Q8_0: mma m16n8k32 over one 32-value block (one scale, and for Q4_K/Q5_K one min); Q6_K: m16n8k16 over one
// 16-value group (one scale; the -32 offset is applied to the integers). The integer dot products are exact; the
// float part is, per output and group in K order, acc += (d*sc * dx) * sumi (Q4_K/Q5_K then also
// acc -= (dmin*m) * sx), with explicit roundings so that no contraction is left to the compiler.
//
// What makes an output independent of N: K is cut into units of 256 values (a super-block; for Q8_0 eight
// blocks, the last unit of a row possibly shorter); warp w of a CUDA block takes units w, w + QMM_MMA_WARPS, ...
// for all the rows the block covers, and the QMM_MMA_WARPS partial sums are added in warp order. None of this
// depends on N, which sets how many 8-column tiles (NT) a warp runs, nor on RT, the number of 16-row tiles a
// warp runs (a CUDA block covers 16 * RT rows). RT only decides how often each activation fragment, loaded once,
// is reused: at 48 columns the activations of one unit (48 x 320 bytes) outweigh 16 rows of weights (16 x 144 for
// Q4_K) several times, so with RT = 1 the kernel would be bound by L2 reads of activations, not by DRAM.
//
// Activations: quantised per column and 32 values (scale d = amax/127 rounded to f16 as q8_1 does, q =
// round(x/d)) into int8 [Npad][K] plus float2 (d, d * sum q) laid out [K/32][Npad], Npad = N rounded up to 8
// (padding columns are zero), so that one 16-byte load gives a thread the scales of its two output columns.
// For Q4_K/Q5_K/Q8_0, within a 32-value block the MMA sees the values permuted (thread t of a quad holds values
// 8t..8t+7, one 8-byte load); A and B use the same permutation, so the dot product is unchanged.

#define QMM_MMA_WARPS 8
#define QMM_MMA_ROWS  16
#define QMM_UNIT      256   // K values per unit of the K split

// Integers become floats without the I2F conversion (a quarter of the integer and FMA pipes' rate; it was the
// busiest unit at 48 columns): the bits of 12582912 + v, v + QMM_MAGIC as an int, are a float, and subtracting
// 12582912 leaves (float) v exactly for |v| < 2^22. The integer MMAs and dp4a chains start from QMM_MAGIC rather
// than 0, so their sums come out ready for that subtraction (qmm_magic_f), and one PRMT puts a byte into those bits
// (qmm_byte_f). The MMA sums stay below 2^22 (32 x 31 x 127 for Q5_K, 32 x 127^2 for Q8_0), as do the scales and
// mins.
#define QMM_MAGIC 0x4B400000

static __device__ __forceinline__ void mma_s8_k32(int (&c)[4], const int (&a)[4], int b0, int b1) {
#if __CUDA_ARCH__ >= 800
    asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
                 "{%10, %10, %10, %10};"
                 : "=r"(c[0]), "=r"(c[1]), "=r"(c[2]), "=r"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "r"(QMM_MAGIC));
#else
    GGML_UNUSED_VARS(c, a, b0, b1);
    NO_DEVICE_CODE;
#endif
}

static __device__ __forceinline__ void mma_s8_k16(int (&c)[4], const int (&a)[2], int b0) {
#if __CUDA_ARCH__ >= 800
    asm volatile("mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5}, {%6}, "
                 "{%7, %7, %7, %7};"
                 : "=r"(c[0]), "=r"(c[1]), "=r"(c[2]), "=r"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(b0), "r"(QMM_MAGIC));
#else
    GGML_UNUSED_VARS(c, a, b0);
    NO_DEVICE_CODE;
#endif
}

// (float) of a sum that carries QMM_MAGIC
static __device__ __forceinline__ float qmm_magic_f(int v) {
    return __fsub_rn(__int_as_float(v), 12582912.0f);
}

// 12582912 + unsigned byte k (0..3, a compile-time constant) of w, as a float: one PRMT
static __device__ __forceinline__ float qmm_byte_magic(int w, int k) {
    return __int_as_float((int) __byte_perm((unsigned) w, (unsigned) QMM_MAGIC, 0x7640u | k));
}

// (float) of unsigned byte k of w
static __device__ __forceinline__ float qmm_byte_f(int w, int k) {
    return __fsub_rn(qmm_byte_magic(w, k), 12582912.0f);
}

// (float) of signed byte k of w, given w ^ 0x80808080 (each byte plus 128, as unsigned)
static __device__ __forceinline__ float qmm_sbyte_f(int w_plus_128, int k) {
    return __fsub_rn(qmm_byte_magic(w_plus_128, k), 12582912.0f + 128.0f);
}

// a 4-byte word at a 2-byte aligned address (Q6_K blocks are 210 bytes, Q8_0 34); `aligned`: it is 4-aligned
static __device__ __forceinline__ int qmm_ld32_a2(const char * p, bool aligned) {
    if (aligned) {
        return *(const int *) p;
    }
    const uint16_t * q = (const uint16_t *) p;
    return (int) (q[0] | ((uint32_t) q[1] << 16));
}

// Where this thread finds its B operands (activation column 8t + g) and its accumulators' scales (columns
// 8t + 2 t4 and 8t + 2 t4 + 1) for each column tile t: here in global memory as qmm_quantize_x wrote them. The units
// ask for them between half(u, hh) and done() (the values of K unit u's half hh, 128 values): a staged source
// (qmatmul_staged.cuh) has them in shared memory only then.
template <int NT> struct qmm_cols {
    const int8_t * col0;      // yq + g * K: column g of tile 0 (one pointer, not NT: registers are short at RT = 4)
    int K;
    const float2 * ds;        // yds + 2 t4
    int npad;

    // activation column 8t + g
    __device__ __forceinline__ const int8_t * col(int t) const {
        return col0 + (size_t) (8 * t) * K;
    }

    __device__ __forceinline__ void half(int, int) {}
    __device__ __forceinline__ void done() {}

    // the 8 values 8 t4.. of activation block kb in column 8t + g (Q4_K, Q5_K, Q8_0)
    __device__ __forceinline__ int2 b8(int t, int kb, int t4) const {
        return *(const int2 *) (col(t) + kb * QK8_1 + 8 * t4);
    }

    // the 4 values 16 e + 4 t4.. of activation block kb in column 8t + g (Q6_K)
    __device__ __forceinline__ int b4(int t, int kb, int e, int t4) const {
        return *(const int *) (col(t) + kb * QK8_1 + 16 * e + 4 * t4);
    }

    // (d, s) of both accumulator columns of tile t at activation block kb
    __device__ __forceinline__ float4 scales(int kb, int t) const {
        return *(const float4 *) (ds + (size_t) kb * npad + 8 * t);
    }
};

// acc += the contribution of one group (c: the MMA's integer sums, dsc: weight scale of rows g and g + 8)
static __device__ __forceinline__ void qmm_accumulate(float (&acc)[4], const int (&c)[4], const float (&dsc)[2],
                                                      const float4 ds) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float dx = i % 2 ? ds.z : ds.x;
        acc[i] = __fmaf_rn(__fmul_rn(dsc[i / 2], dx), qmm_magic_f(c[i]), acc[i]);
    }
}

// One 32-value activation block kb against the A fragments a[r] of every row tile, for every column tile.
// dm: Q4_K/Q5_K's minimum (weight dmin * m per row), applied after the scaled sum of each group.
template <int NT, int RT, bool MIN, class X>
static __device__ __forceinline__ void qmm_block_k32(const int (&a)[RT][4], const float (&dsc)[RT][2],
                                                     const float (&dm)[RT][2], const X & x, int kb, int t4,
                                                     float (&acc)[RT][NT][4]) {
#pragma unroll
    for (int t = 0; t < NT; ++t) {
        const int2 b = x.b8(t, kb, t4);
        const float4 ds = x.scales(kb, t);
#pragma unroll
        for (int r = 0; r < RT; ++r) {
            int c[4];
            mma_s8_k32(c, a[r], b.x, b.y);
            qmm_accumulate(acc[r][t], c, dsc[r], ds);
            if (MIN) {
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    acc[r][t][i] = __fmaf_rn(-dm[r][i / 2], i % 2 ? ds.w : ds.y, acc[r][t][i]);
                }
            }
        }
    }
}

// v - 32 in each byte, for bytes 0..63 (Q6_K's quants): no byte borrows, so an addition of 96 and a flip of the sign
// bit (__vsubss4 takes eight instructions)
static __device__ __forceinline__ int qmm_minus32(int v) {
    return (v + 0x60606060) ^ (int) 0x80808080;
}

// Q4_K/Q5_K's six-bit scales and mins of sub-blocks 0..3 and 4..7, a byte each, and (d, dmin): unpacked from a
// block's first 16 bytes once per unit, four bytes an instruction or two
struct qmm_k4_scales {
    int sc_lo, m_lo, sc_hi, m_hi;
    float2 dmin;
};

static __device__ __forceinline__ qmm_k4_scales qmm_k4_unpack(const uint4 h) {
    qmm_k4_scales k;
    k.sc_lo = h.y & 0x3F3F3F3F;
    k.m_lo  = h.z & 0x3F3F3F3F;
    k.sc_hi = (h.w & 0x0F0F0F0F) | ((h.y >> 2) & 0x30303030);
    k.m_hi  = ((h.w >> 4) & 0x0F0F0F0F) | ((h.z >> 2) & 0x30303030);
    k.dmin  = __half22float2(*(const half2 *) &h.x);
    return k;
}

// sub-block s (0..7, a compile-time constant): d * scale and dmin * min
static __device__ __forceinline__ void qmm_k4_scale_min(const qmm_k4_scales & k, int s, float & dsc, float & dm) {
    dsc = __fmul_rn(k.dmin.x, qmm_byte_f(s < 4 ? k.sc_lo : k.sc_hi, s % 4));
    dm  = __fmul_rn(k.dmin.y, qmm_byte_f(s < 4 ? k.m_lo : k.m_hi, s % 4));
}

// One unit of K for the rows of this thread (rows[r][h]: row 16r + 8h + g of the block's tiles).
template <ggml_type type, int NT, int RT> struct qmm_unit;

// Q4_K and Q5_K (HIGH: Q5_K's fifth bit, from qh)
template <bool HIGH, int NT, int RT, class X>
static __device__ __forceinline__ void qmm_unit_k45(const char * const (&rows)[RT][2], int u, X & x, int t4,
                                                    float (&acc)[RT][NT][4]) {
    constexpr int bs     = HIGH ? sizeof(block_q5_K) : sizeof(block_q4_K);
    constexpr int qs_off = HIGH ? 48 : 16;   // block_q5_K: dm, scales[12], qh[32], qs[128]; block_q4_K: no qh
    static_assert(sizeof(block_q5_K) == 176 && sizeof(block_q4_K) == 144, "unexpected K-quant block layout");
    qmm_k4_scales hdr[RT][2];
    uint2 qs[RT][2], qh[RT][2];
#pragma unroll
    for (int r = 0; r < RT; ++r) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const char * b = rows[r][h] + (size_t) u * bs;
            hdr[r][h] = qmm_k4_unpack(*(const uint4 *) b);
            qh[r][h]  = HIGH ? *(const uint2 *) (b + 16 + 8 * t4) : make_uint2(0, 0);
        }
    }
#pragma unroll
    for (int s = 0; s < 8; ++s) {
        if (s % 4 == 0) {
            x.half(u, s / 4);
        }
        if (s % 2 == 0) {   // the quants of sub-blocks s and s + 1 (low and high nibbles), loaded only now: at RT = 4
#pragma unroll              // a whole super-block's would not fit in the registers next to the accumulators
            for (int r = 0; r < RT; ++r) {
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    qs[r][h] = *(const uint2 *) (rows[r][h] + (size_t) u * bs + qs_off + 16 * s + 8 * t4);
                }
            }
        }
        float dsc[RT][2], dm[RT][2];
        int a[RT][4];
#pragma unroll
        for (int r = 0; r < RT; ++r) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                qmm_k4_scale_min(hdr[r][h], s, dsc[r][h], dm[r][h]);
                int w0 = (qs[r][h].x >> (4 * (s % 2))) & 0x0F0F0F0F;
                int w1 = (qs[r][h].y >> (4 * (s % 2))) & 0x0F0F0F0F;
                if (HIGH) {   // bit s of qh byte l is the fifth bit of value 32 s + l
                    w0 |= ((qh[r][h].x >> s) & 0x01010101) << 4;
                    w1 |= ((qh[r][h].y >> s) & 0x01010101) << 4;
                }
                a[r][h]     = w0;   // A: a0/a1 rows g/g+8 at the thread's first 4 (permuted) values, a2/a3 the next 4
                a[r][h + 2] = w1;
            }
        }
        qmm_block_k32<NT, RT, true>(a, dsc, dm, x, u * (QMM_UNIT / QK8_1) + s, t4, acc);
        if (s % 4 == 3) {
            x.done();
        }
    }
}

template <int NT, int RT> struct qmm_unit<GGML_TYPE_Q4_K, NT, RT> {
    static constexpr int bytes = sizeof(block_q4_K);
    template <class X>
    static __device__ __forceinline__ void run(const char * const (&rows)[RT][2], int u, int, X & x, int t4,
                                               float (&acc)[RT][NT][4]) {
        qmm_unit_k45<false, NT, RT>(rows, u, x, t4, acc);
    }
};

template <int NT, int RT> struct qmm_unit<GGML_TYPE_Q5_K, NT, RT> {
    static constexpr int bytes = sizeof(block_q5_K);
    template <class X>
    static __device__ __forceinline__ void run(const char * const (&rows)[RT][2], int u, int, X & x, int t4,
                                               float (&acc)[RT][NT][4]) {
        qmm_unit_k45<true, NT, RT>(rows, u, x, t4, acc);
    }
};

template <int NT, int RT> struct qmm_unit<GGML_TYPE_Q6_K, NT, RT> {
    static constexpr int bytes = sizeof(block_q6_K);
    template <class X>
    static __device__ __forceinline__ void run(const char * const (&rows)[RT][2], int u, int, X & x, int t4,
                                               float (&acc)[RT][NT][4]) {
        static_assert(sizeof(block_q6_K) == 210, "unexpected Q6_K block layout");   // ql[128], qh[64], scales[16], d
        // per row and half hh of the super-block (values 128hh..128hh+127), loaded only when the half starts (at
        // RT = 4 a whole super-block's would not fit in the registers next to the accumulators): ql words [j%2][e]
        // (bytes 64hh + 32(j%2) + 16e + 4t4), qh words [e] (32hh + 16e + 4t4), scale words 2hh, 2hh + 1 (their
        // bytes offset by 128, for qmm_sbyte_f)
        int ql[RT][2][2][2], qh[RT][2][2], scw[RT][2][2];
        float d[RT][2];
        bool al[RT][2];   // the row's block is 4-aligned: with an even row size the same for all rows and units
#pragma unroll
        for (int r = 0; r < RT; ++r) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const char * b = rows[r][h] + (size_t) u * sizeof(block_q6_K);
                al[r][h] = ((uintptr_t) b & 3) == 0;
                d[r][h]  = __half2float(*(const half *) (b + 208));
            }
        }
        // group G = 8hh + 2j + e holds values 128hh + 32j + 16e + (0..15); activation block kb = 8u + G/2
#pragma unroll
        for (int G = 0; G < 16; ++G) {
            const int hh = G / 8, j = (G / 2) % 4, e = G % 2;
            if (G % 8 == 0) {
                x.half(u, hh);
#pragma unroll
                for (int r = 0; r < RT; ++r) {
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        const char * b = rows[r][h] + (size_t) u * sizeof(block_q6_K);
#pragma unroll
                        for (int ee = 0; ee < 2; ++ee) {
                            ql[r][h][0][ee] = qmm_ld32_a2(b + 64 * hh + 16 * ee + 4 * t4, al[r][h]);
                            ql[r][h][1][ee] = qmm_ld32_a2(b + 64 * hh + 32 + 16 * ee + 4 * t4, al[r][h]);
                            qh[r][h][ee]    = qmm_ld32_a2(b + 128 + 32 * hh + 16 * ee + 4 * t4, al[r][h]);
                            scw[r][h][ee]   = qmm_ld32_a2(b + 192 + 8 * hh + 4 * ee, al[r][h]) ^ 0x80808080;
                        }
                    }
                }
            }
            float dsc[RT][2];
            int a[RT][2];
#pragma unroll
            for (int r = 0; r < RT; ++r) {
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    dsc[r][h] = __fmul_rn(d[r][h], qmm_sbyte_f(scw[r][h][(G % 8) / 4], G % 4));
                    const int lo = (ql[r][h][j % 2][e] >> (4 * (j / 2))) & 0x0F0F0F0F;
                    const int hi = ((qh[r][h][e] >> (2 * j)) & 0x03030303) << 4;
                    a[r][h] = qmm_minus32(lo | hi);
                }
            }
            const int kb = u * (QMM_UNIT / QK8_1) + G / 2;
#pragma unroll
            for (int t = 0; t < NT; ++t) {
                const int b = x.b4(t, kb, e, t4);
                const float4 ds = x.scales(kb, t);
#pragma unroll
                for (int r = 0; r < RT; ++r) {
                    int c[4];
                    mma_s8_k16(c, a[r], b);
                    qmm_accumulate(acc[r][t], c, dsc[r], ds);
                }
            }
            if (G % 8 == 7) {
                x.done();
            }
        }
    }
};

// Q8_0: a unit is 8 blocks of 34 bytes (f16 d, 32 int8); nb: blocks per row, so the last unit may be shorter
template <int NT, int RT> struct qmm_unit<GGML_TYPE_Q8_0, NT, RT> {
    static constexpr int bytes = (QMM_UNIT / QK8_0) * sizeof(block_q8_0);
    template <class X>
    static __device__ __forceinline__ void run(const char * const (&rows)[RT][2], int u, int nb, X & x, int t4,
                                               float (&acc)[RT][NT][4]) {
        static_assert(sizeof(block_q8_0) == 34, "unexpected Q8_0 block layout");
        const float no_min[RT][2] = {};
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            if (u * (QMM_UNIT / QK8_0) + 4 * hh >= nb) {
                break;
            }
            x.half(u, hh);
#pragma unroll
            for (int i = 4 * hh; i < 4 * hh + 4; ++i) {
                const int kb = u * (QMM_UNIT / QK8_0) + i;
                if (kb >= nb) {
                    break;
                }
                float dsc[RT][2];
                int a[RT][4];
#pragma unroll
                for (int r = 0; r < RT; ++r) {
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        const char * b = rows[r][h] + (size_t) kb * sizeof(block_q8_0);
                        const char * q = b + 2 + 8 * t4;
                        const bool al = ((uintptr_t) q & 3) == 0;
                        dsc[r][h]   = __half2float(*(const half *) b);
                        a[r][h]     = qmm_ld32_a2(q, al);
                        a[r][h + 2] = qmm_ld32_a2(q + 4, al);
                    }
                }
                qmm_block_k32<NT, RT, false>(a, dsc, no_min, x, kb, t4, acc);
            }
            x.done();
        }
    }
};

static __device__ __forceinline__ void qmm_prefetch_l2(const char * p) {
    asm volatile("prefetch.global.L2 [%0];" : : "l"(p));
}

// CUDA blocks of this kernel an SM must hold at once (__launch_bounds__' second argument; 0: ptxas decides): two
// for RT = 2 up to 24 columns, where ptxas otherwise takes 175-200 registers and one block (8 warps) per SM leaves
// the kernel waiting on latency (H100 profile: 12.5% occupancy, an instruction every 2.3 cycles per scheduler);
// within 128 registers it spills at most 8 bytes there. Not 1 elsewhere: that lets ptxas take up to twice the
// registers of its own choice (Q6_K at one column: 133 instead of 68) and costs the one-column kernel a third of
// its speed. Registers do not change the result.
template <int NT, int RT> constexpr int qmm_min_blocks() {
    return RT == 2 && NT <= 3 ? 2 : 0;
}

// The weight rows of a thread (rows[r][h]: row 16r + 8h + g of the block's tiles, clamped for loads)
template <ggml_type type, int NT, int RT> struct qmm_rows {
    const char * rows[RT][2];
    int64_t row_bytes;

    __device__ __forceinline__ qmm_rows(const char * W, int r0, int M, int64_t row_bytes_) : row_bytes(row_bytes_) {
        const int g = threadIdx.x / 4;
#pragma unroll
        for (int r = 0; r < RT; ++r) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                rows[r][h] = W + (size_t) min(r0 + QMM_MMA_ROWS * r + 8 * h + g, M - 1) * row_bytes;
            }
        }
    }

    // ask L2 for unit v of this thread's rows: the 4 lanes of a quad touch 4 points of a row's unit less than 128
    // bytes apart, so every cache line of it
    __device__ __forceinline__ void prefetch(int v) const {
        constexpr int unit_bytes = qmm_unit<type, NT, RT>::bytes;
        const int t4 = threadIdx.x % 4;
        const int64_t off  = (int64_t) v * unit_bytes;
        const int64_t span = min((int64_t) unit_bytes, row_bytes - off);
#pragma unroll
        for (int r = 0; r < RT; ++r) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                qmm_prefetch_l2(rows[r][h] + off + t4 * (span - 1) / 3);
            }
        }
    }
};

// A warp's units w, w + QMM_MMA_WARPS, ... into acc, each next one asked of DRAM while this one computes
template <ggml_type type, int NT, int RT, class X>
static __device__ __forceinline__ void qmm_units(const qmm_rows<type, NT, RT> & w, X & x, int nb, int n_units,
                                                 float (&acc)[RT][NT][4]) {
    const int warp = threadIdx.y;
    const int t4   = threadIdx.x % 4;
    for (int u = warp; u < n_units; u += QMM_MMA_WARPS) {
        if (u + QMM_MMA_WARPS < n_units) {
            w.prefetch(u + QMM_MMA_WARPS);
        }
        qmm_unit<type, NT, RT>::run(w.rows, u, nb, x, t4, acc);
    }
}

// Combine the warps' partial sums in warp order, one row tile at a time (partial: shared memory for one tile), and
// store the block's outputs, plus add's where given (ggml_qmatmul_fused); the NT * 4 sums of a lane are shared out
// over the warps (element e = warp + 8 i of the lane's).
template <int NT, int RT>
static __device__ __forceinline__ void qmm_store_sums(const float (&acc)[RT][NT][4],
                                                      float (*partial)[NT * 4][WARP_SIZE], int r0, int M, int N,
                                                      float * __restrict__ dst, int stride_col_dst,
                                                      const float * __restrict__ add, int stride_col_add) {
    constexpr int EPT = (NT * 4 + QMM_MMA_WARPS - 1) / QMM_MMA_WARPS;   // elements per thread and row tile
    const int lane = threadIdx.x;
    const int warp = threadIdx.y;
    const int g    = lane / 4;
    const int t4   = lane % 4;
    auto row_of = [&](int r, int e) { return r0 + QMM_MMA_ROWS * r + 8 * ((e % 4) / 2) + g; };
    auto col_of = [&](int e) { return 8 * (e / 4) + 2 * t4 + e % 2; };
    // the added values, all asked for at once (one memory latency, not one per row tile)
    float addv[RT][EPT] = {};
    if (add != nullptr) {
#pragma unroll
        for (int r = 0; r < RT; ++r) {
#pragma unroll
            for (int i = 0; i < EPT; ++i) {
                const int e = warp + QMM_MMA_WARPS * i, row = row_of(r, e), col = col_of(e);
                if (e < NT * 4 && row < M && col < N) {
                    addv[r][i] = add[(size_t) col * stride_col_add + row];
                }
            }
        }
    }
#pragma unroll
    for (int r = 0; r < RT; ++r) {
        if (r > 0) {
            __syncthreads();   // the previous tile's partial sums have been read
        }
#pragma unroll
        for (int t = 0; t < NT; ++t) {
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                partial[warp][t * 4 + i][lane] = acc[r][t][i];
            }
        }
        __syncthreads();
#pragma unroll
        for (int i = 0; i < EPT; ++i) {
            const int e = warp + QMM_MMA_WARPS * i;
            if (e >= NT * 4) {
                break;
            }
            float sum = partial[0][e][lane];
#pragma unroll
            for (int w = 1; w < QMM_MMA_WARPS; ++w) {
                sum = __fadd_rn(sum, partial[w][e][lane]);
            }
            const int row = row_of(r, e), col = col_of(e);
            if (row < M && col < N) {
                if (add != nullptr) {
                    sum = __fadd_rn(sum, addv[r][i]);
                }
                dst[(size_t) col * stride_col_dst + row] = sum;
            }
        }
    }
}

// One CUDA block: 16 * RT rows starting at 16 * RT * blockIdx.x, all N columns (NT tiles of 8), QMM_MMA_WARPS warps
// splitting K. nb: quant blocks per row.
template <ggml_type type, int NT, int RT>
static __global__ void __launch_bounds__(QMM_MMA_WARPS * WARP_SIZE, qmm_min_blocks<NT, RT>())
qmm_mma(const char * __restrict__ W, const int8_t * __restrict__ yq, const float2 * __restrict__ yds,
        float * __restrict__ dst, int nb, int K, int M, int N, int npad, int stride_col_dst,
        const float * __restrict__ add, int stride_col_add) {
    const int lane = threadIdx.x;
    const int warp = threadIdx.y;
    const int g    = lane / 4;
    const int t4   = lane % 4;
    const int r0   = blockIdx.x * (QMM_MMA_ROWS * RT);
    const int64_t row_bytes = (int64_t) nb * ggml_cuda_type_traits<type>::bs;
    const int n_units = (K + QMM_UNIT - 1) / QMM_UNIT;

    qmm_rows<type, NT, RT> w(W, r0, M, row_bytes);
    qmm_cols<NT> x;
    x.col0 = yq + (size_t) g * K;
    x.K    = K;
    x.ds   = yds + 2 * t4;
    x.npad = npad;
    if (warp < n_units) {
        w.prefetch(warp);   // the weights do not depend on the previous kernel: start before waiting for it
    }

    ggml_cuda_pdl_sync();

    float acc[RT][NT][4] = {};
    qmm_units<type, NT, RT>(w, x, nb, n_units, acc);

    __shared__ float partial[QMM_MMA_WARPS][NT * 4][WARP_SIZE];
    qmm_store_sums<NT, RT>(acc, partial, r0, M, N, dst, stride_col_dst, add, stride_col_add);
}

struct qmm_args {
    const char * W;
    const int8_t * yq;
    const float2 * yds;
    float * dst;
    int nb, K, M, N, npad, stride_col_dst;
    const float * add = nullptr;   // ggml_qmatmul_fused's added tensor [M, N], columns stride_col_add apart
    int stride_col_add = 0;
};

template <ggml_type type, int NT, int RT>
static void qmm_mma_launch(const qmm_args & p, cudaStream_t stream) {
    const dim3 grid((p.M + QMM_MMA_ROWS * RT - 1) / (QMM_MMA_ROWS * RT));
    const dim3 block(WARP_SIZE, QMM_MMA_WARPS);
    ggml_cuda_kernel_launch(qmm_mma<type, NT, RT>, ggml_cuda_kernel_launch_params(grid, block, 0, stream),
                            p.W, p.yq, p.yds, p.dst, p.nb, p.K, p.M, p.N, p.npad, p.stride_col_dst, p.add,
                            p.stride_col_add);
}

template <ggml_type type, int NT>
static void qmm_mma_tiles(const qmm_args & p, int rt, cudaStream_t stream) {
    switch (rt) {
        case 1: qmm_mma_launch<type, NT, 1>(p, stream); break;
        case 2: qmm_mma_launch<type, NT, 2>(p, stream); break;
        case 4: qmm_mma_launch<type, NT, 4>(p, stream); break;
        default: GGML_ABORT("ggml_qmatmul: row_tiles %d", rt);
    }
}

// W * X for nt column tiles with rt row tiles per warp (1, 2 or 4; at 8, ptxas spills for every type). Defined
// here, instantiated once per type by qmatmul_mma_<type>.cu.
template <ggml_type type>
void qmm_mma_run(const qmm_args & p, int nt, int rt, cudaStream_t stream) {
    switch (nt) {
        case 1: qmm_mma_tiles<type, 1>(p, rt, stream); break;
        case 2: qmm_mma_tiles<type, 2>(p, rt, stream); break;
        case 3: qmm_mma_tiles<type, 3>(p, rt, stream); break;
        case 4: qmm_mma_tiles<type, 4>(p, rt, stream); break;
        case 5: qmm_mma_tiles<type, 5>(p, rt, stream); break;
        case 6: qmm_mma_tiles<type, 6>(p, rt, stream); break;
        default: GGML_ABORT("ggml_qmatmul: %d column tiles", nt);
    }
}
