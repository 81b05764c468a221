// ggml_qmatmul for a few columns of Q4_K and Q5_K weights (Ampere and later): a matrix-vector kernel that gives the
// very bits of the tensor-core kernel (qmatmul_mma.cuh), so that a decode step and a verify agree to the bit, with
// the memory traffic of a vector kernel. (The MMA kernel pads one column to eight and reads each row in 8-byte
// pieces spread over 16-row tiles; at one column it reaches 38-56% of the H100's copy bandwidth.)
//
// The same bits: the MMA kernel's warp w (of QMM_MMA_WARPS) adds, per output, the sub-blocks of the K units (super-
// blocks) w, w + 8, ... in K order (acc = fma(d*sc * dx, (float) sumi, acc), then acc = fma(-dmin*m, sx, acc)), and
// the warps' sums are added in warp order. Here lane 8q + w of a warp is that warp w for row q of the warp's
// QMV_ROWS rows: it runs the same units in the same order with the same float operations and roundings (an integer
// sum over a sub-block is exact, however it is formed), and a row's 8 lane sums are added in lane order.
//
// Loads: a round is units 8k .. 8k + 7 of each of the warp's rows, one contiguous run of bytes per row; the warp
// copies it to shared memory with 16-byte cp.async (coalesced, not through L1), two rounds in flight, and each lane
// then reads its own unit from there. (A first version that read the units straight into registers was slower
// than ggml's vector kernel on the larger matrices: each load instruction touched 32 lines, one per lane; one that
// split a unit over 4 lanes and passed the float chain between them by shuffles was bound by the load/shuffle
// queue. H100, Nsight Compute.)

#pragma once

#include "cp-async.cuh"
#include "qmatmul_mma.cuh"

#define QMV_WARPS    4                              // warps per CUDA block
#define QMV_ROWS     (WARP_SIZE / QMM_MMA_WARPS)    // rows per warp
#define QMV_STAGES   2                              // rounds in flight per warp
#define QMV_MAX_COLS 4                              // columns the kernel is compiled for

static __device__ __forceinline__ void qmv_cp_async_commit() {
    asm volatile("cp.async.commit_group;");
}

template <int N> static __device__ __forceinline__ void qmv_cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" : : "n"(N));
}

static __device__ __forceinline__ int qmv_word(const int4 & v, int k) {
    return k == 0 ? v.x : k == 1 ? v.y : k == 2 ? v.z : v.w;
}

// acc[c] += the unit at b (a Q4_K/Q5_K super-block, in shared memory) times the activations of its 256 values (y:
// column 0, columns K apart; ds: their (d, d * sum q) per 32 values, sub-block s of column c at s * npad + c)
template <bool HIGH, int NC>
static __device__ __forceinline__ void qmv_unit_k45(const char * b, const int8_t * y, const float2 * ds, int K,
                                                    int npad, float (&acc)[NC]) {
    constexpr int qs_off = HIGH ? 48 : 16;   // block_q5_K: dm, scales[12], qh[32], qs[128]; block_q4_K: no qh
    const uint4 hdr = *(const uint4 *) b;
    int4 qs[8], qh[2];
#pragma unroll
    for (int k = 0; k < 8; ++k) {
        qs[k] = *(const int4 *) (b + qs_off + 16 * k);
    }
    if (HIGH) {
        qh[0] = *(const int4 *) (b + 16);
        qh[1] = *(const int4 *) (b + 32);
    }
#pragma unroll
    for (int s = 0; s < 8; ++s) {   // sub-block s: the low (s even) or high nibbles of qs bytes 32(s/2) + 0..31
        float dsc, dm;
        qmm_k4_scale_min(hdr, s, dsc, dm);
        int w[8];
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            w[k] = (qmv_word(qs[2 * (s / 2) + k / 4], k % 4) >> (4 * (s % 2))) & 0x0F0F0F0F;
            if (HIGH) {   // bit s of qh byte l is the fifth bit of value l of sub-block s
                w[k] |= ((qmv_word(qh[k / 4], k % 4) >> s) & 0x01010101) << 4;
            }
        }
#pragma unroll
        for (int c = 0; c < NC; ++c) {
            const int4 y0 = *(const int4 *) (y + (size_t) c * K + QK8_1 * s);
            const int4 y1 = *(const int4 *) (y + (size_t) c * K + QK8_1 * s + 16);
            const float2 d = ds[s * npad + c];
            int sumi = 0;
#pragma unroll
            for (int k = 0; k < 8; ++k) {
                sumi = ggml_cuda_dp4a(w[k], qmv_word(k < 4 ? y0 : y1, k % 4), sumi);
            }
            acc[c] = __fmaf_rn(__fmul_rn(dsc, d.x), qmm_i2f(sumi), acc[c]);
            acc[c] = __fmaf_rn(-dm, d.y, acc[c]);
        }
    }
}

// One CUDA block: QMV_WARPS * QMV_ROWS rows, NC columns. Arguments as qmm_mma's.
template <ggml_type type, int NC>
static __global__ void __launch_bounds__(QMV_WARPS * WARP_SIZE)
qmv_kernel(const char * __restrict__ W, const int8_t * __restrict__ yq, const float2 * __restrict__ yds,
           float * __restrict__ dst, int nb, int K, int M, int npad, int stride_col_dst) {
    constexpr bool HIGH = type == GGML_TYPE_Q5_K;
    static_assert(type == GGML_TYPE_Q4_K || HIGH, "the vector kernel takes Q4_K and Q5_K");
    constexpr int bs    = HIGH ? sizeof(block_q5_K) : sizeof(block_q4_K);
    constexpr int span  = QMM_MMA_WARPS * bs;   // one round of one row: 1152 or 1408 bytes, 16-byte aligned
    static_assert(bs % 16 == 0, "rounds are copied in 16-byte pieces");
    __shared__ __align__(16) char stage[QMV_WARPS][QMV_STAGES][QMV_ROWS][span];   // 36 / 44 KB

    const int lane = threadIdx.x;
    const int slot = lane % QMM_MMA_WARPS;
    const int q    = lane / QMM_MMA_WARPS;
    const int warp_row0 = (blockIdx.x * QMV_WARPS + threadIdx.y) * QMV_ROWS;
    if (warp_row0 >= M) {
        return;
    }
    const int64_t row_bytes = (int64_t) nb * bs;
    const int n_units  = K / QMM_UNIT;
    const int n_rounds = (n_units + QMM_MMA_WARPS - 1) / QMM_MMA_WARPS;
    const char * warp_w = W + (int64_t) warp_row0 * row_bytes;
    const int n_rows = min(QMV_ROWS, M - warp_row0);

    // round k of every row of the warp into stage st (the whole warp copies; an empty commit past the last round
    // keeps the group count that the waits below count on)
    auto issue = [&](int k, int st) {
        if (k < n_rounds) {
            const int chunks = min(QMM_MMA_WARPS, n_units - QMM_MMA_WARPS * k) * bs / 16;
            for (int r = 0; r < n_rows; ++r) {
                const char * src = warp_w + r * row_bytes + (int64_t) k * span;
                const unsigned dst0 = ggml_cuda_cvta_generic_to_shared(stage[threadIdx.y][st][r]);
                for (int c = lane; c < chunks; c += WARP_SIZE) {
                    cp_async_cg_16<0>(dst0 + 16 * c, src + 16 * c);
                }
            }
        }
        qmv_cp_async_commit();
    };
#pragma unroll
    for (int st = 0; st < QMV_STAGES; ++st) {
        issue(st, st);   // the weights do not depend on the previous kernel: start before waiting for it
    }
    ggml_cuda_pdl_sync();

    float acc[NC] = {};
    for (int k = 0; k < n_rounds; ++k) {
        const int st = k % QMV_STAGES;
        qmv_cp_async_wait<QMV_STAGES - 1>();   // this lane's copies of round k have landed
        __syncwarp();                          // and every lane's
        const int u = QMM_MMA_WARPS * k + slot;
        if (u < n_units && q < n_rows) {
            qmv_unit_k45<HIGH, NC>(stage[threadIdx.y][st][q] + slot * bs, yq + (size_t) u * QMM_UNIT,
                                   yds + (size_t) u * (QMM_UNIT / QK8_1) * npad, K, npad, acc);
        }
        __syncwarp();                          // every lane is done with stage st
        issue(k + QMV_STAGES, st);
    }

    // a row's 8 slot sums (lanes 8q .. 8q + 7) in slot order, as the MMA kernel adds its warps'
#pragma unroll
    for (int c = 0; c < NC; ++c) {
        float sum = __shfl_sync(0xffffffff, acc[c], 0, QMM_MMA_WARPS);
#pragma unroll
        for (int w = 1; w < QMM_MMA_WARPS; ++w) {
            sum = __fadd_rn(sum, __shfl_sync(0xffffffff, acc[c], w, QMM_MMA_WARPS));
        }
        if (slot == c % QMM_MMA_WARPS && q < n_rows) {
            dst[(size_t) c * stride_col_dst + warp_row0 + q] = sum;
        }
    }
}

// W * X for N <= QMV_MAX_COLS columns (p as for qmm_mma_run). Instantiated by qmatmul_mma_q4_k.cu / _q5_k.cu.
template <ggml_type type>
void qmv_run(const qmm_args & p, cudaStream_t stream) {
    const int rows_per_block = QMV_WARPS * QMV_ROWS;
    const dim3 grid((p.M + rows_per_block - 1) / rows_per_block);
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
