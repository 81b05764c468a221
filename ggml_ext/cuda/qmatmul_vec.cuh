// ggml_qmatmul for a few columns (Q4_K, Q5_K, Q6_K; Ampere and later): a matrix-vector kernel that gives the very
// bits of the tensor-core kernel (qmatmul_mma.cuh), so that a decode step and a verify agree to the bit, with the
// loads of a vector kernel. The MMA kernel pads one column to eight and reads each row's blocks in 8-byte pieces
// spread over 16-row tiles; at one column that reached 38-56% of the H100's copy bandwidth.
//
// The same bits: the MMA kernel's warp w (of QMM_MMA_WARPS) adds, per output, the groups of K units w, w + 8, ...
// in K order (acc = fma(d*sc * dx, (float) sumi, acc), then for Q4_K/Q5_K acc = fma(-dmin*m, sx, acc)), and the
// warps' sums are added in warp order. Here one warp takes one row: its 8 slots of QMV_LANES lanes stand for the
// MMA kernel's 8 warps and run the same units in the same order. The lanes of a slot split a unit's groups
// between them (each integer sum is exact, so how it is formed does not matter), the float chain over the groups
// passes through the slot's lanes in K order by shuffles, and the slots' sums are added in slot order. The float
// operations, their operands and their order are the MMA kernel's, with the same explicit roundings.
//
// Loads: a slot's lanes read a block's quants as 16-byte pieces (Q6_K's 210-byte blocks are only 2-byte aligned:
// aligned words and funnel shifts), the next unit's while the current one computes.

#pragma once

#include "qmatmul_mma.cuh"

#define QMV_WARPS 4                              // rows per CUDA block, one per warp
#define QMV_LANES (WARP_SIZE / QMM_MMA_WARPS)    // lanes per K slot
#define QMV_MAX_COLS 4                           // columns the kernel is compiled for

// 16 bytes at a 2-byte aligned address, from aligned words (reads up to 2 bytes past the 16: the callers' fields
// are followed by more of the same block)
static __device__ __forceinline__ uint4 qmv_ld16_a2(const char * p) {
    const uint32_t * w = (const uint32_t *) ((uintptr_t) p & ~(uintptr_t) 3);
    const uint32_t   s = 8 * (uint32_t) ((uintptr_t) p & 3);
    const uint32_t v0 = w[0], v1 = w[1], v2 = w[2], v3 = w[3], v4 = w[4];
    return make_uint4(__funnelshift_r(v0, v1, s), __funnelshift_r(v1, v2, s), __funnelshift_r(v2, v3, s),
                      __funnelshift_r(v3, v4, s));
}

static __device__ __forceinline__ int qmv_word(const uint4 & v, int k) {
    return (int) (k == 0 ? v.x : k == 1 ? v.y : k == 2 ? v.z : v.w);
}

// One lane's share of one K unit of a row: `load` it, then for each of its `groups` groups (i, compile-time): the
// group's first value in the unit (`k_off`), its values as words of 4 signed bytes (`weights`) and its weight
// scale and minimum (`scale_min`). `chain_lane(step)` / `chain_group(step)`: whose group comes step-th in K order.
template <ggml_type type> struct qmv_unit;

// Q4_K and Q5_K (HIGH): lane t takes sub-blocks 2t and 2t + 1 (the low and high nibbles of qs bytes 32t..32t+31)
template <bool HIGH> struct qmv_unit_k45 {
    static constexpr int bytes  = HIGH ? sizeof(block_q5_K) : sizeof(block_q4_K);
    static constexpr int qs_off = HIGH ? 48 : 16;
    static constexpr int groups = 2;
    static constexpr int values = 32;
    static constexpr bool has_min = true;

    uint4 hdr;      // f16 d, f16 dmin, 12 bytes of packed 6-bit scales and minimums
    uint4 qs[2];    // this lane's 32 quant bytes
    uint4 qh[2];    // Q5_K: all 32 bytes of fifth bits (bit s of byte l: value l of sub-block s)

    __device__ __forceinline__ void load(const char * b, int t) {
        hdr   = *(const uint4 *) b;
        qs[0] = *(const uint4 *) (b + qs_off + 32 * t);
        qs[1] = *(const uint4 *) (b + qs_off + 32 * t + 16);
        if (HIGH) {
            qh[0] = *(const uint4 *) (b + 16);
            qh[1] = *(const uint4 *) (b + 32);
        }
    }
    static __device__ __forceinline__ int k_off(int t, int i) {
        return QK8_1 * (2 * t + i);
    }
    __device__ __forceinline__ void weights(int t, int i, int (&w)[values / 4]) const {
        const int s = 2 * t + i;
#pragma unroll
        for (int k = 0; k < values / 4; ++k) {
            w[k] = (qmv_word(qs[k / 4], k % 4) >> (4 * i)) & 0x0F0F0F0F;
            if (HIGH) {
                w[k] |= ((qmv_word(qh[k / 4], k % 4) >> s) & 0x01010101) << 4;
            }
        }
    }
    // as qmm_k4_scale_min, for a sub-block known only at run time: byte j of the packed 12 lies in word 1 + j/4
    __device__ __forceinline__ void scale_min(int t, int i, float & dsc, float & dm) const {
        const int s  = 2 * t + i;
        const int sh = 8 * (s % 4);
        const int y = (int) (hdr.y >> sh) & 0xFF, z = (int) (hdr.z >> sh) & 0xFF, w = (int) (hdr.w >> sh) & 0xFF;
        const int sc = s < 4 ? y & 63 : (w & 0xF) | ((y >> 6) << 4);
        const int m  = s < 4 ? z & 63 : (w >> 4) | ((z >> 6) << 4);
        const float2 dmin = __half22float2(*(const half2 *) &hdr.x);
        dsc = __fmul_rn(dmin.x, qmm_i2f(sc));
        dm  = __fmul_rn(dmin.y, qmm_i2f(m));
    }
    static constexpr __device__ int chain_lane(int step) {
        return step / 2;
    }
    static constexpr __device__ int chain_group(int step) {
        return step % 2;
    }
};

template <> struct qmv_unit<GGML_TYPE_Q4_K> : qmv_unit_k45<false> {};
template <> struct qmv_unit<GGML_TYPE_Q5_K> : qmv_unit_k45<true> {};

// Q6_K: lane t = 2hh + e takes the 16-value groups G = 8hh + 2j + e, j = 0..3 (values 128hh + 32j + 16e + 0..15:
// ql bytes 64hh + 32(j%2) + 16e + 0..15, nibble j/2; qh bytes 32hh + 16e + 0..15, bits 2j, 2j + 1)
template <> struct qmv_unit<GGML_TYPE_Q6_K> {
    static constexpr int bytes  = sizeof(block_q6_K);
    static constexpr int groups = 4;
    static constexpr int values = 16;
    static constexpr bool has_min = false;

    uint4 ql[2], qh;
    int sc;      // scale bytes e, e + 2, e + 4, e + 6 of this half (8hh + e + 2j), as 4 bytes
    float d;

    __device__ __forceinline__ void load(const char * b, int t) {
        const int hh = t / 2, e = t % 2;
        ql[0] = qmv_ld16_a2(b + 64 * hh + 16 * e);
        ql[1] = qmv_ld16_a2(b + 64 * hh + 32 + 16 * e);
        qh    = qmv_ld16_a2(b + 128 + 32 * hh + 16 * e);
        const uint16_t * s16 = (const uint16_t *) (b + 192 + 8 * hh);
        sc = 0;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            sc |= ((s16[j] >> (8 * e)) & 0xFF) << (8 * j);
        }
        d = __half2float(*(const half *) (b + 208));
    }
    static __device__ __forceinline__ int k_off(int t, int j) {
        return 128 * (t / 2) + 32 * j + 16 * (t % 2);
    }
    __device__ __forceinline__ void weights(int, int j, int (&w)[values / 4]) const {
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const int lo = (qmv_word(ql[j % 2], k) >> (4 * (j / 2))) & 0x0F0F0F0F;
            const int hi = ((qmv_word(qh, k) >> (2 * j)) & 0x03030303) << 4;
            w[k] = __vsubss4(lo | hi, 0x20202020);
        }
    }
    __device__ __forceinline__ void scale_min(int, int j, float & dsc, float & dm) const {
        dsc = __fmul_rn(d, qmm_i2f((int) (int8_t) ((sc >> (8 * j)) & 0xFF)));
        dm  = 0.0f;
    }
    static constexpr __device__ int chain_lane(int step) {   // step = G
        return 2 * (step / 8) + step % 2;
    }
    static constexpr __device__ int chain_group(int step) {
        return (step / 2) % 4;
    }
};

// One CUDA block: QMV_WARPS rows (a warp each), NC columns. Arguments as qmm_mma's.
template <ggml_type type, int NC>
static __global__ void __launch_bounds__(QMV_WARPS * WARP_SIZE)
qmv_kernel(const char * __restrict__ W, const int8_t * __restrict__ yq, const float2 * __restrict__ yds,
           float * __restrict__ dst, int nb, int K, int M, int npad, int stride_col_dst) {
    using unit_t = qmv_unit<type>;
    constexpr int NG = unit_t::groups;
    const int lane = threadIdx.x;
    const int slot = lane / QMV_LANES;
    const int t    = lane % QMV_LANES;
    const int row  = blockIdx.x * QMV_WARPS + threadIdx.y;
    if (row >= M) {
        return;
    }
    const char * w_row = W + (size_t) row * nb * ggml_cuda_type_traits<type>::bs;
    const int n_units = K / QMM_UNIT;
    const unsigned slot_mask = 0xFu << (QMV_LANES * slot);
    static_assert(QMV_LANES == 4, "slot_mask assumes 4 lanes per slot");

    unit_t cur;
    if (slot < n_units) {
        cur.load(w_row + (size_t) slot * unit_t::bytes, t);   // weights do not depend on the previous kernel
    }
    ggml_cuda_pdl_sync();

    float acc[NC] = {};
    for (int u = slot; u < n_units; u += QMM_MMA_WARPS) {
        unit_t next;
        if (u + QMM_MMA_WARPS < n_units) {
            next.load(w_row + (size_t) (u + QMM_MMA_WARPS) * unit_t::bytes, t);
        }
        // this lane's groups: the factors of acc = fma(a, f, acc) and of the minimum's fma(mn, s, acc)
        float a[NG][NC], f[NG][NC], s[NG][NC], mn[NG];
#pragma unroll
        for (int i = 0; i < NG; ++i) {
            int w[unit_t::values / 4];
            cur.weights(t, i, w);
            float dsc, dm;
            cur.scale_min(t, i, dsc, dm);
            mn[i] = -dm;
            const int k0 = u * QMM_UNIT + unit_t::k_off(t, i);
#pragma unroll
            for (int c = 0; c < NC; ++c) {
                const int8_t * y = yq + (size_t) c * K + k0;
                int sumi = 0;
#pragma unroll
                for (int v = 0; v < unit_t::values / 16; ++v) {
                    const int4 y4 = *(const int4 *) (y + 16 * v);
                    sumi = ggml_cuda_dp4a(w[4 * v + 0], y4.x, sumi);
                    sumi = ggml_cuda_dp4a(w[4 * v + 1], y4.y, sumi);
                    sumi = ggml_cuda_dp4a(w[4 * v + 2], y4.z, sumi);
                    sumi = ggml_cuda_dp4a(w[4 * v + 3], y4.w, sumi);
                }
                const float2 ds = yds[(size_t) (k0 / QK8_1) * npad + c];
                a[i][c] = __fmul_rn(dsc, ds.x);
                f[i][c] = qmm_i2f(sumi);
                s[i][c] = ds.y;
            }
        }
        // the slot's groups in K order, whichever lane holds them
#pragma unroll
        for (int step = 0; step < QMV_LANES * NG; ++step) {
            const int src = unit_t::chain_lane(step), i = unit_t::chain_group(step);
            const float mn_i = unit_t::has_min ? __shfl_sync(slot_mask, mn[i], src, QMV_LANES) : 0.0f;
#pragma unroll
            for (int c = 0; c < NC; ++c) {
                acc[c] = __fmaf_rn(__shfl_sync(slot_mask, a[i][c], src, QMV_LANES),
                                   __shfl_sync(slot_mask, f[i][c], src, QMV_LANES), acc[c]);
                if (unit_t::has_min) {
                    acc[c] = __fmaf_rn(mn_i, __shfl_sync(slot_mask, s[i][c], src, QMV_LANES), acc[c]);
                }
            }
        }
        cur = next;
    }
    __syncwarp();

    // the slots' sums in slot order, as the MMA kernel adds its warps'
#pragma unroll
    for (int c = 0; c < NC; ++c) {
        float sum = __shfl_sync(0xffffffff, acc[c], 0);
#pragma unroll
        for (int w = 1; w < QMM_MMA_WARPS; ++w) {
            sum = __fadd_rn(sum, __shfl_sync(0xffffffff, acc[c], QMV_LANES * w));
        }
        if (lane == c) {
            dst[(size_t) c * stride_col_dst + row] = sum;
        }
    }
}

// W * X for N <= QMV_MAX_COLS columns (p as for qmm_mma_run). Instantiated once per type by qmatmul_mma_<type>.cu.
template <ggml_type type>
void qmv_run(const qmm_args & p, cudaStream_t stream) {
    const dim3 grid((p.M + QMV_WARPS - 1) / QMV_WARPS);
    const dim3 block(WARP_SIZE, QMV_WARPS);
    const ggml_cuda_kernel_launch_params params(grid, block, 0, stream);
    switch (p.N) {
        case 1: ggml_cuda_kernel_launch(qmv_kernel<type, 1>, params, p.W, p.yq, p.yds, p.dst, p.nb, p.K, p.M, p.npad, p.stride_col_dst); break;
        case 2: ggml_cuda_kernel_launch(qmv_kernel<type, 2>, params, p.W, p.yq, p.yds, p.dst, p.nb, p.K, p.M, p.npad, p.stride_col_dst); break;
        case 3: ggml_cuda_kernel_launch(qmv_kernel<type, 3>, params, p.W, p.yq, p.yds, p.dst, p.nb, p.K, p.M, p.npad, p.stride_col_dst); break;
        case 4: ggml_cuda_kernel_launch(qmv_kernel<type, 4>, params, p.W, p.yq, p.yds, p.dst, p.nb, p.K, p.M, p.npad, p.stride_col_dst); break;
        default: GGML_ABORT("ggml_qmatmul: the vector kernel takes up to %d columns, got %d", QMV_MAX_COLS, p.N);
    }
}
