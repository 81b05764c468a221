// ggml_qmatmul on CUDA: W * X for a few columns, bit-identical per column whatever the number of columns.
// On Ampere and later every type takes the tensor-core kernel further down (on Hopper one column of Q4_K/Q5_K/Q6_K
// takes the streaming kernel of the same bits, qmatmul_stream.cuh); older GPUs the vector kernel described here.
// Asked for (GGML_EXT_QMATMUL_F16), Q4_K on Hopper takes the f16 kernel of qmatmul_shared.cuh instead.
//
// The columns of x are quantised to q8_1 (ggml's quantize_row_q8_1_cuda: per column, per 32 values), then a
// vector kernel in the manner of ggml's mul_mat_vec_q dots each weight row with them through ggml's own
// vec_dot_<type>_q8_1 (integer dot products inside a quant block, one float per block piece). What makes a
// column's result independent of N:
//   - the split of a row's K-blocks over the QMM_THREADS threads of a CUDA block is fixed (it depends on the
//     weight type only, never on the column count or on how many rows a CUDA block takes);
//   - each thread adds its pieces in K order with __fadd_rn (no contraction into a neighbouring multiply that
//     could differ between instantiations);
//   - the QMM_WARPS partial sums are combined in warp order through shared memory, then by a fixed butterfly.
// The column count and the rows per CUDA block only change which (row, column) pairs a CUDA block computes.
// Columns go in chunks of up to QMM_MAX_CHUNK; the chunks of one row group are neighbouring blocks of the grid,
// so a row group's weights are read from DRAM once and from L2 by the other chunks.

#include "ggml-ext-cuda.cuh"
#include "ggml-ext.h"
#include "quantize.cuh"
#include "unary.cuh"
#include "vecdotq.cuh"
#include "qmatmul_staged.cuh"
#include "qmatmul_shared.cuh"

#define QMM_WARPS     4
#define QMM_THREADS   (QMM_WARPS * WARP_SIZE)
#define QMM_MAX_CHUNK 8

typedef float (*qmm_vec_dot_t)(const void * __restrict__ vbq, const block_q8_1 * __restrict__ bq8_1,
                               const int & kbx, const int & iqs);

template <ggml_type type> struct qmm_traits;
template <> struct qmm_traits<GGML_TYPE_Q4_K> {
    static constexpr int vdr = VDR_Q4_K_Q8_1_MMVQ;
    static constexpr qmm_vec_dot_t vec_dot = vec_dot_q4_K_q8_1;
};
template <> struct qmm_traits<GGML_TYPE_Q5_K> {
    static constexpr int vdr = VDR_Q5_K_Q8_1_MMVQ;
    static constexpr qmm_vec_dot_t vec_dot = vec_dot_q5_K_q8_1;
};
template <> struct qmm_traits<GGML_TYPE_Q6_K> {
    static constexpr int vdr = VDR_Q6_K_Q8_1_MMVQ;
    static constexpr qmm_vec_dot_t vec_dot = vec_dot_q6_K_q8_1;
};
template <> struct qmm_traits<GGML_TYPE_Q8_0> {
    static constexpr int vdr = VDR_Q8_0_Q8_1_MMVQ;
    static constexpr qmm_vec_dot_t vec_dot = vec_dot_q8_0_q8_1;
};

// One CUDA block: ROWS weight rows times CHUNK columns. Grid: (row group) * n_chunks + chunk.
template <ggml_type type, int CHUNK, int ROWS>
static __global__ void __launch_bounds__(QMM_THREADS, 1)
qmatmul_kernel(const void * __restrict__ vx, const block_q8_1 * __restrict__ y, float * __restrict__ dst,
               int blocks_per_row, int n_rows, int n_cols, int n_chunks, int stride_col_y, int stride_col_dst) {
    constexpr int qk  = ggml_cuda_type_traits<type>::qk;
    constexpr int qi  = ggml_cuda_type_traits<type>::qi;
    constexpr int vdr = qmm_traits<type>::vdr;
    constexpr int threads_per_block_x = qi / vdr;               // threads sharing one quant block
    constexpr int blocks_per_iter     = QMM_THREADS / threads_per_block_x;

    const int tid   = threadIdx.y * WARP_SIZE + threadIdx.x;
    const int chunk = blockIdx.x % n_chunks;
    const int row0  = (blockIdx.x / n_chunks) * ROWS;
    const int col0  = chunk * CHUNK;

    // rows/columns past the end repeat the last one (never stored): no bounds checks in the hot loop
    int row_off[ROWS];
#pragma unroll
    for (int i = 0; i < ROWS; ++i) {
        row_off[i] = min(row0 + i, n_rows - 1) * blocks_per_row;
    }
    const block_q8_1 * ycol[CHUNK];
#pragma unroll
    for (int j = 0; j < CHUNK; ++j) {
        ycol[j] = y + (size_t) min(col0 + j, n_cols - 1) * stride_col_y;
    }

    ggml_cuda_pdl_sync();

    float acc[CHUNK][ROWS] = {{0.0f}};
    const int kqs = vdr * (tid % threads_per_block_x);
    for (int kbx = tid / threads_per_block_x; kbx < blocks_per_row; kbx += blocks_per_iter) {
        const int kby = kbx * (qk / QK8_1);
#pragma unroll
        for (int j = 0; j < CHUNK; ++j) {
#pragma unroll
            for (int i = 0; i < ROWS; ++i) {
                acc[j][i] = __fadd_rn(acc[j][i], qmm_traits<type>::vec_dot(vx, ycol[j] + kby, row_off[i] + kbx, kqs));
            }
        }
    }

    __shared__ float partial[QMM_WARPS - 1][CHUNK][ROWS][WARP_SIZE];
    if (threadIdx.y > 0) {
#pragma unroll
        for (int j = 0; j < CHUNK; ++j) {
#pragma unroll
            for (int i = 0; i < ROWS; ++i) {
                partial[threadIdx.y - 1][j][i][threadIdx.x] = acc[j][i];
            }
        }
    }
    __syncthreads();
    if (threadIdx.y > 0) {
        return;
    }
#pragma unroll
    for (int j = 0; j < CHUNK; ++j) {
#pragma unroll
        for (int i = 0; i < ROWS; ++i) {
            float sum = acc[j][i];
#pragma unroll
            for (int l = 0; l < QMM_WARPS - 1; ++l) {
                sum = __fadd_rn(sum, partial[l][j][i][threadIdx.x]);
            }
#pragma unroll
            for (int offset = WARP_SIZE / 2; offset > 0; offset >>= 1) {
                sum = __fadd_rn(sum, __shfl_xor_sync(0xffffffff, sum, offset, WARP_SIZE));
            }
            acc[j][i] = sum;
        }
    }
    // lane l < ROWS*CHUNK stores one output (a register array cannot be indexed by lane without local memory)
#pragma unroll
    for (int j = 0; j < CHUNK; ++j) {
#pragma unroll
        for (int i = 0; i < ROWS; ++i) {
            if (threadIdx.x == j * ROWS + i && col0 + j < n_cols && row0 + i < n_rows) {
                dst[(size_t) (col0 + j) * stride_col_dst + row0 + i] = acc[j][i];
            }
        }
    }
}

template <ggml_type type, int CHUNK, int ROWS>
static void qmatmul_launch(const void * vx, const block_q8_1 * y, float * dst, int blocks_per_row, int n_rows,
                           int n_cols, int stride_col_y, int stride_col_dst, cudaStream_t stream) {
    const int n_chunks = (n_cols + CHUNK - 1) / CHUNK;
    const int n_groups = (n_rows + ROWS - 1) / ROWS;
    const dim3 grid((unsigned) n_groups * n_chunks);
    const dim3 block(WARP_SIZE, QMM_WARPS);
    ggml_cuda_kernel_launch(qmatmul_kernel<type, CHUNK, ROWS>, ggml_cuda_kernel_launch_params(grid, block, 0, stream),
                            vx, y, dst, blocks_per_row, n_rows, n_cols, n_chunks, stride_col_y, stride_col_dst);
}

// Chunk and rows per CUDA block by column count: more rows per block for more columns, so that the
// activations each block reads from L2 serve more weight rows. Any choice gives the same bits.
template <ggml_type type>
static void qmatmul_switch(const void * vx, const block_q8_1 * y, float * dst, int blocks_per_row, int n_rows,
                           int n_cols, int stride_col_y, int stride_col_dst, cudaStream_t stream) {
    switch (n_cols) {
        case 1:  qmatmul_launch<type, 1, 1>(vx, y, dst, blocks_per_row, n_rows, n_cols, stride_col_y, stride_col_dst, stream); break;
        case 2:  qmatmul_launch<type, 2, 2>(vx, y, dst, blocks_per_row, n_rows, n_cols, stride_col_y, stride_col_dst, stream); break;
        case 3:
        case 4:  qmatmul_launch<type, 4, 2>(vx, y, dst, blocks_per_row, n_rows, n_cols, stride_col_y, stride_col_dst, stream); break;
        default: qmatmul_launch<type, QMM_MAX_CHUNK, 4>(vx, y, dst, blocks_per_row, n_rows, n_cols, stride_col_y, stride_col_dst, stream); break;
    }
}

// --- The tensor-core path (qmatmul_mma.cuh): activations quantised here, the kernel in qmatmul_mma_<type>.cu ---
extern template void qmm_mma_run<GGML_TYPE_Q4_K>(const qmm_args & p, int nt, int rt, cudaStream_t stream);
extern template void qmm_mma_run<GGML_TYPE_Q5_K>(const qmm_args & p, int nt, int rt, cudaStream_t stream);
extern template void qmm_mma_run<GGML_TYPE_Q6_K>(const qmm_args & p, int nt, int rt, cudaStream_t stream);
extern template void qmm_mma_run<GGML_TYPE_Q8_0>(const qmm_args & p, int nt, int rt, cudaStream_t stream);
extern template void qmm_staged_run<GGML_TYPE_Q4_K>(const qmm_args & p, int nt, int rt, int device, cudaStream_t stream);
extern template void qmm_staged_run<GGML_TYPE_Q5_K>(const qmm_args & p, int nt, int rt, int device, cudaStream_t stream);
extern template void qmm_staged_run<GGML_TYPE_Q6_K>(const qmm_args & p, int nt, int rt, int device, cudaStream_t stream);
extern template void qms_run<GGML_TYPE_Q4_K>(const qmm_args & p, int device, cudaStream_t stream);
extern template void qms_run<GGML_TYPE_Q5_K>(const qmm_args & p, int device, cudaStream_t stream);
extern template void qms_run<GGML_TYPE_Q6_K>(const qmm_args & p, int device, cudaStream_t stream);

bool ggml_ext_cuda_qmatmul_streams(int device) {
    const int cc = ggml_cuda_info().devices[device].cc;
    return GGML_CUDA_CC_IS_NVIDIA(cc) && ggml_cuda_highest_compiled_arch(cc) >= GGML_CUDA_CC_HOPPER;
}

// How the activations are laid out for the kernel that reads them
enum qmm_x_layout {
    QMM_X_INT8,     // int8 [npad][K], scales [K / 32][npad] (qmatmul_mma.cuh, "Activations")
    QMM_X_HALVES,   // int8 by half unit [K / 128][npad][128], blocks swizzled (qmatmul_staged.cuh); scales as above
    QMM_X_F16,      // f16 by unit, ggml-ext.h's prepared layout: values and sub-block sums (qmatmul_half.cuh)
    QMM_X_BF16,     // the same in bf16, without the sums (the BF16 weights' unit)
};

// A 32-value block's values held VPL to a lane by LG = 32 / VPL lanes (a lane group): lane p of the group holds the
// values of "virtual lanes" p, p + LG, ..., p + (VPL - 1) LG. qmm_block_reduce combines them as the butterfly over 32
// lanes of one value each does (offsets 16, 8, ..., 1; its result the same in every lane): the steps of offset >= LG
// pair values within a lane, the rest are shuffles within the group. So a float sum has the same bits whatever VPL.
template <int VPL, typename T, typename Op>
static __device__ __forceinline__ T qmm_block_reduce(T (&s)[VPL], Op op) {
    constexpr int LG = WARP_SIZE / VPL;
#pragma unroll
    for (int o = WARP_SIZE / 2; o >= LG; o >>= 1) {   // virtual lane p + LG i pairs with p + LG (i ^ o / LG)
        T t[VPL];
#pragma unroll
        for (int i = 0; i < VPL; ++i) {
            t[i] = op(s[i], s[i ^ (o / LG)]);
        }
#pragma unroll
        for (int i = 0; i < VPL; ++i) {
            s[i] = t[i];
        }
    }
    T r = s[0];   // (every s[i] now the same bits: a + b == b + a)
#pragma unroll
    for (int o = LG / 2; o > 0; o >>= 1) {
        r = op(r, __shfl_xor_sync(0xffffffff, r, o, WARP_SIZE));
    }
    return r;
}

// One 32-value block of a column as the kernels read it, held as qmm_block_reduce says (lane p of its group: value
// v[i] at position p + LG i of block kb; `store`: whether the group's block exists, every lane reaching the shuffles
// either way). Int8: scale d = amax/127 rounded to f16 as q8_1 does, q = round(v/d), and (d, d * sum q); f16:
// round_f16(v), and the sum of the rounded values in f32 (the butterfly's order) rounded to f16.
template <int VPL>
static __device__ __forceinline__ void qmm_quantize_block(const float (&v)[VPL], int p, int col, int kb, int K,
                                                          int npad, qmm_x_layout layout, bool store,
                                                          int8_t * __restrict__ yq, float2 * __restrict__ yds) {
    constexpr int LG = WARP_SIZE / VPL;
    if (layout == QMM_X_BF16) {
        nv_bfloat16 * unit = (nv_bfloat16 *) yq + (size_t) (kb / 8) * npad * QMH_HALF_PITCH;
#pragma unroll
        for (int i = 0; i < VPL; ++i) {
            if (store) {
                unit[GGML_EXT_QMATMUL_HALF_AT(QK8_1 * (kb % 8) + p + LG * i, col, npad)] = __float2bfloat16_rn(v[i]);
            }
        }
        return;
    }
    if (layout == QMM_X_F16) {
        half h[VPL];
        float s[VPL];
#pragma unroll
        for (int i = 0; i < VPL; ++i) {
            h[i] = __float2half_rn(v[i]);
            s[i] = __half2float(h[i]);
        }
        const float sum = qmm_block_reduce<VPL>(s, [](float a, float b) { return a + b; });
        if (!store) {
            return;
        }
        half * unit = (half *) yq + (size_t) (kb / 8) * npad * QMH_HALF_PITCH;
#pragma unroll
        for (int i = 0; i < VPL; ++i) {
            unit[GGML_EXT_QMATMUL_HALF_AT(QK8_1 * (kb % 8) + p + LG * i, col, npad)] = h[i];
        }
        if (p == 0) {
            unit[GGML_EXT_QMATMUL_HALF_AT(QMM_UNIT + kb % 8, col, npad)] = __float2half_rn(sum);
            unit[GGML_EXT_QMATMUL_HALF_ZERO_AT(kb % 8, col, npad)] = __float2half_rn(0.0f);   // (wgmma's k 8-15)
        }
        return;
    }
    float a[VPL];
#pragma unroll
    for (int i = 0; i < VPL; ++i) {
        a[i] = fabsf(v[i]);
    }
    const float amax = qmm_block_reduce<VPL>(a, [](float x, float y) { return fmaxf(x, y); });
    const float d = amax / 127.0f;
    int q[VPL], qs[VPL];
#pragma unroll
    for (int i = 0; i < VPL; ++i) {
        q[i] = amax == 0.0f ? 0 : (int) roundf(v[i] / d);
        qs[i] = q[i];
    }
    const int sum = qmm_block_reduce<VPL>(qs, [](int x, int y) { return x + y; });
    if (!store) {
        return;
    }
#pragma unroll
    for (int i = 0; i < VPL; ++i) {
        const int l = p + LG * i;
        const size_t at = layout == QMM_X_HALVES
            ? ((size_t) (kb / 4) * npad + col) * (QMM_UNIT / 2) + QK8_1 * ((kb % 4 + col) % 4) + l
            : (size_t) col * K + kb * QK8_1 + l;
        yq[at] = (int8_t) q[i];
    }
    if (p == 0) {
        const float dh = __half2float(__float2half_rn(d));
        yds[(size_t) kb * npad + col] = make_float2(dh, __fmul_rn(dh, (float) sum));
    }
}

// ggml_qmatmul_fused's up, RMS-normed in groups of G values (G a multiple of 32; norm: f32 [G]): the factor of the
// group holding k0 (its first value), the sum of its squares found by the 32 virtual lanes of a lane group
// (qmm_block_reduce), each summing G/32 values in order, so every group of every warp finds the same factor whatever
// N and VPL are; value = (up * factor) * norm, ggml's rms_norm then mul.
template <int VPL>
static __device__ __forceinline__ float qmm_group_factor(const float * __restrict__ upc, int G, float eps, int k0,
                                                         int p) {
    constexpr int LG = WARP_SIZE / VPL;
    float s[VPL];
#pragma unroll
    for (int i = 0; i < VPL; ++i) {
        s[i] = 0.0f;
#pragma unroll 4
        for (int j = p + LG * i; j < G; j += WARP_SIZE) {   // (unrolled: a head of 128 values asked for at once)
            s[i] += upc[k0 + j] * upc[k0 + j];
        }
    }
    return rsqrtf(qmm_block_reduce<VPL>(s, [](float a, float b) { return a + b; }) / (float) G + eps);
}

static __device__ __forceinline__ float qmm_group_normed(const float * __restrict__ upc, const float * __restrict__ norm,
                                                         int G, float eps, int k, int lane) {
    const int k0 = k - k % G;
    return __fmul_rn(__fmul_rn(upc[k], qmm_group_factor<1>(upc, G, eps, k0, lane)), norm[k - k0]);
}

// The activations: a warp per VPL 32-value blocks of a column, a lane group per block (qmm_block_reduce), VPL values a
// lane. With up the gated values (qmm_gated); with a norm as well, up's groups normed first (qmm_group_factor). The
// same bits for every VPL (qmm_prep_values chooses it). (A warp per four blocks one after another, fewer and fuller
// CUDA blocks, was slower: H100, twenty-first session; and so were a few CUDA blocks an SM, each warp several blocks'
// loads at once: thirty-fifth session.)
template <int VPL>
static __global__ void qmm_quantize_x(const float * __restrict__ x, const float * __restrict__ up,
                                      const float * __restrict__ norm, int G, float eps, int gate,
                                      int8_t * __restrict__ yq, float2 * __restrict__ yds, int K, int N, int npad,
                                      int64_t stride_col_x, int64_t stride_col_up, qmm_x_layout layout,
                                      bool early_launch) {
    constexpr int LG = WARP_SIZE / VPL;
    if (early_launch) {
        ggml_cuda_pdl_lc();   // the product after it may start (its blocks wait for us before reading yq)
    }
    const int warp = blockIdx.x * (blockDim.x / WARP_SIZE) + threadIdx.x / WARP_SIZE;
    const int lane = threadIdx.x % WARP_SIZE, p = lane % LG;
    const int blocks_per_col = K / QK8_1, n_blocks = blocks_per_col * npad;
    if (VPL * warp >= n_blocks) {
        return;
    }
    const int b = VPL * warp + lane / LG;   // this lane group's block
    const bool live = b < n_blocks;
    const int col = live ? b / blocks_per_col : 0;
    const int kb  = live ? b % blocks_per_col : 0;
    ggml_cuda_pdl_sync();   // x is the previous kernel's output: with programmatic dependent launch, wait for it
    // (a lane group without a value, past the last block or in a padding column, reads column 0's and drops them,
    // so that every lane of the warp reaches the shuffles; a warp of none reads nothing)
    const bool has = live && col < N;
    const float * xc = x + (has ? col : 0) * stride_col_x;
    float v[VPL];
    if (!__any_sync(0xffffffff, has)) {
#pragma unroll
        for (int i = 0; i < VPL; ++i) {
            v[i] = 0.0f;
        }
    } else if (up != nullptr) {
        const float * upc = up + (has ? col : 0) * stride_col_up;
        const int k0 = kb * QK8_1 - kb * QK8_1 % max(G, 1);
        const float factor = norm != nullptr ? qmm_group_factor<VPL>(upc, G, eps, k0, p) : 1.0f;
#pragma unroll
        for (int i = 0; i < VPL; ++i) {
            const int k = kb * QK8_1 + p + LG * i;
            const float u = norm != nullptr ? __fmul_rn(__fmul_rn(upc[k], factor), norm[k - k0]) : upc[k];
            v[i] = has ? qmm_gated(xc[k], u, gate) : 0.0f;
        }
    } else {
#pragma unroll
        for (int i = 0; i < VPL; ++i) {
            v[i] = has ? xc[kb * QK8_1 + p + LG * i] : 0.0f;
        }
    }
    qmm_quantize_block<VPL>(v, p, col, kb, K, npad, layout, live, yq, yds);
}

// ggml_qmatmul_rms_norm: a column's factor 1 / sqrt(mean(x^2) + eps), computed by a whole CUDA block of
// QMM_RMS_MAX_THREADS threads and the same in every thread of it, and in every block: each thread sums the squares
// of values tid, tid + blockDim, ... in order, the warps butterfly-reduce (every lane ends with the same bits), and
// every thread adds the warp totals in warp order. No dependence on N. A thread asks for its values
// QMM_RMS_BATCH at a time (one memory latency for a 5,120-value column, not one per value).
#define QMM_RMS_MAX_THREADS 1024
#define QMM_RMS_BATCH       8

static __device__ __forceinline__ float qmm_rms_scale(const float * __restrict__ xc, int K, float eps) {
    __shared__ float warp_sums[QMM_RMS_MAX_THREADS / WARP_SIZE];
    float s = 0.0f;
    for (int k0 = threadIdx.x; k0 < K; k0 += QMM_RMS_BATCH * blockDim.x) {
        float v[QMM_RMS_BATCH];
#pragma unroll
        for (int b = 0; b < QMM_RMS_BATCH; ++b) {
            const int k = k0 + b * blockDim.x;
            v[b] = k < K ? xc[k] : 0.0f;
        }
#pragma unroll
        for (int b = 0; b < QMM_RMS_BATCH; ++b) {
            if (k0 + b * blockDim.x < K) {
                s += v[b] * v[b];
            }
        }
    }
#pragma unroll
    for (int offset = WARP_SIZE / 2; offset > 0; offset >>= 1) {
        s += __shfl_xor_sync(0xffffffff, s, offset, WARP_SIZE);
    }
    if (threadIdx.x % WARP_SIZE == 0) {
        warp_sums[threadIdx.x / WARP_SIZE] = s;
    }
    __syncthreads();
    float total = 0.0f;
    for (int w = 0; w < (int) blockDim.x / WARP_SIZE; ++w) {
        total += warp_sums[w];
    }
    return rsqrtf(total / (float) K + eps);
}

// The normed activations quantised: warps of one 32-value block each (QMM_RMS_QUANT_WARPS per block) on a
// grid (K / (32 * warps), npad) so that a block's warps share a column, each block first finding that column's
// factor from all of it (K values from L2, a few per thread: the price of not waiting on a separate norm kernel).
// Padding columns are zero.
#define QMM_RMS_QUANT_WARPS (QMM_RMS_MAX_THREADS / WARP_SIZE)

static __global__ void qmm_quantize_x_rms(const float * __restrict__ x, const float * __restrict__ norm, float eps,
                                          int8_t * __restrict__ yq, float2 * __restrict__ yds,
                                          int K, int N, int npad, int64_t stride_col_x, qmm_x_layout layout,
                                          bool early_launch) {
    if (early_launch) {
        ggml_cuda_pdl_lc();   // as in qmm_quantize_x
    }
    const int col  = blockIdx.y;
    const int lane = threadIdx.x % WARP_SIZE;
    const int kb   = blockIdx.x * QMM_RMS_QUANT_WARPS + threadIdx.x / WARP_SIZE;
    const int k    = kb * QK8_1 + lane;
    const bool live = kb < K / QK8_1 && col < N;
    const float w = live ? norm[k] : 0.0f;   // a weight: asked for before waiting on the previous kernel
    ggml_cuda_pdl_sync();
    const float * xc = x + col * stride_col_x;
    const float xk = live ? xc[k] : 0.0f;    // this lane's own value, asked for with the sum's
    const float scale = col < N ? qmm_rms_scale(xc, K, eps) : 0.0f;   // (col is the same in the whole block)
    if (kb >= K / QK8_1) {
        return;
    }
    const float v[1] = {live ? __fmul_rn(__fmul_rn(xk, scale), w) : 0.0f};
    qmm_quantize_block<1>(v, lane, col, kb, K, npad, layout, true, yq, yds);
}

// The normed activations as floats, [K, N] contiguous (grid: N columns), for the vector kernel of older GPUs.
static __global__ void qmm_rms_norm_x(const float * __restrict__ x, const float * __restrict__ norm, float eps,
                                      float * __restrict__ out, int K, int64_t stride_col_x) {
    const int col = blockIdx.x;
    ggml_cuda_pdl_sync();
    const float * xc = x + col * stride_col_x;
    const float scale = qmm_rms_scale(xc, K, eps);
    for (int k = threadIdx.x; k < K; k += blockDim.x) {
        out[(int64_t) col * K + k] = __fmul_rn(__fmul_rn(xc[k], scale), norm[k]);
    }
}

// ggml_qmatmul_fused's add on GPUs without the tensor-core kernel (whose stores add it): dst += add, element-wise
static __global__ void qmm_add_after(float * __restrict__ dst, const float * __restrict__ add, int M, int64_t n,
                                     int stride_col_dst, int stride_col_add) {
    const int64_t i = (int64_t) blockIdx.x * blockDim.x + threadIdx.x;
    ggml_cuda_pdl_sync();
    if (i < n) {
        const int64_t row = i % M, col = i / M;
        dst[col * stride_col_dst + row] = __fadd_rn(dst[col * stride_col_dst + row], add[col * stride_col_add + row]);
    }
}

// The gated columns (qmm_gated) as floats, [K, N] contiguous (grid: N columns; a warp per 32 values), for the
// vector kernel of older GPUs; with a norm, up's groups normed first as qmm_quantize_x does.
static __global__ void qmm_glu_x(const float * __restrict__ x, const float * __restrict__ up,
                                 const float * __restrict__ norm, int G, float eps, int gate, float * __restrict__ out,
                                 int K, int64_t stride_col_x, int64_t stride_col_up) {
    const int col  = blockIdx.x;
    const int lane = threadIdx.x % WARP_SIZE;
    const float * upc = up + col * stride_col_up;
    ggml_cuda_pdl_sync();
    for (int k = threadIdx.x; k < K; k += blockDim.x) {   // (K a multiple of 32: whole warps stay in the loop)
        const float u = norm != nullptr ? qmm_group_normed(upc, norm, G, eps, k, lane) : upc[k];
        out[(int64_t) col * K + k] = qmm_gated(x[col * stride_col_x + k], u, gate);
    }
}

// src[2], the norm: of the columns without up (ggml_qmatmul_rms_norm), of up's groups with it (ggml_qmatmul_fused)
static const ggml_tensor * qmm_column_norm(const ggml_tensor * dst) {
    return dst->src[4] == nullptr ? dst->src[2] : nullptr;
}

static const ggml_tensor * qmm_up_norm(const ggml_tensor * dst) {
    return dst->src[4] != nullptr ? dst->src[2] : nullptr;
}

static float qmm_norm_eps(const ggml_tensor * dst) {
    float eps;
    memcpy(&eps, &dst->op_params[1], sizeof(float));
    return eps;
}

// Row tiles per warp when the caller leaves the choice to the kernel, from the H100 sweeps of every forced choice
// (`bench/qmatmul.py --sweep`, docs/benchmarks.md "Which kernel a verify's matmuls take"): one for one column tile
// (up to 8 columns) and for matrices of at most 2048 rows (no more 16-row tiles than an H100 has SMs: more tiles
// per warp would only leave SMs idle); for the other short matrices (<= 6144 rows) four, or for Q6_K one up to 24
// columns and two above; two otherwise (with two CUDA blocks per SM up to 24 columns: qmm_min_blocks). Any choice
// gives the same bits.
static int qmm_auto_row_tiles(ggml_type type, int nt, int M) {
    if (nt == 1 || M <= 2048) {
        return 1;
    }
    if (M <= 6144) {
        return type != GGML_TYPE_Q6_K ? 4 : nt <= 3 ? 1 : 2;
    }
    return 2;
}

// Row tiles of the staged kernel (qmatmul_staged.cuh) when the kernel chooses, or 0 where it does not take it: on
// Hopper from 9 columns, for Q6_K (one row tile up to 6144 rows, two above) and Q5_K (two), and for Q4_K at 17-24
// columns on matrices of more than 6144 rows (two), where the tools/qmm_lab.cu sweep of the 27B shapes found it
// faster than qmm_mma (docs/benchmarks.md, eleventh session).
static int qmm_auto_staged(ggml_type type, int nt, int M) {
    if (nt < 2) {
        return 0;
    }
    switch (type) {
        case GGML_TYPE_Q6_K: return M <= 6144 ? 1 : 2;
        case GGML_TYPE_Q5_K: return 2;
        case GGML_TYPE_Q4_K: return nt == 3 && M > 6144 ? 2 : 0;
        default:             return 0;
    }
}

// Whether the preparation kernels and the f16 kernel let the kernel after them launch early (programmatic dependent
// launch: its blocks take their place and ask for what does not depend on us, then wait for our end).
// PYDFLASH_EARLY_LAUNCH=0 turns it off (for an A/B; read once).
static bool qmm_early_launch() {
    static const bool on = ggml_ext_env_switch("PYDFLASH_EARLY_LAUNCH", true);
    return on;
}

#define QMM_QUANT_WARPS 8   // warps a CUDA block of qmm_quantize_x

// Warps of qmm_quantize_x (one value a lane) the GPU holds at once, as its registers and block size allow (an H100:
// 64 an SM, 8,448); once per device
static int qmm_prep_resident_warps(int device) {
    static int warps[GGML_CUDA_MAX_DEVICES] = {};
    if (warps[device] == 0) {
        int blocks = 0;
        CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, qmm_quantize_x<1>, QMM_QUANT_WARPS * WARP_SIZE, 0));
        warps[device] = blocks * QMM_QUANT_WARPS * ggml_cuda_info().devices[device].nsm;
    }
    return warps[device];
}

// Values a lane of qmm_quantize_x holds: two where one a lane would be more warps than the GPU holds at once, so that
// no second, partial wave holds the product up (the 5120x6144 output at 48 columns: 9,216 warps against an H100's
// 8,448; 19.2 us against 20.0, H100, docs/benchmarks.md, thirty-ninth session), else one (two everywhere bought the
// 27B's verify nothing: hold 112). The same bits either way.
static int qmm_prep_values(int n_blocks, int device) {
    return n_blocks > qmm_prep_resident_warps(device) ? 2 : 1;
}

// The activations quantised (or rounded to f16) into yq/yds in `layout`: gated with up, normed with norm, as
// ggml_qmatmul_fused asks (qmm_quantize_x, qmm_quantize_x_rms)
static void qmm_prepare_x(ggml_backend_cuda_context & ctx, const ggml_tensor * x, const ggml_tensor * dst, int K, int N,
                          int npad, qmm_x_layout layout, int8_t * yq, float2 * yds) {
    cudaStream_t stream = ctx.stream();
    const int64_t stride_col_x = x->nb[1] / sizeof(float);
    const ggml_tensor * up = dst->src[4];   // ggml_qmatmul_fused: the gated columns
    if (const ggml_tensor * norm = qmm_column_norm(dst)) {   // ggml_qmatmul_rms_norm
        const dim3 grid((K / QK8_1 + QMM_RMS_QUANT_WARPS - 1) / QMM_RMS_QUANT_WARPS, npad);
        ggml_cuda_kernel_launch(qmm_quantize_x_rms, ggml_cuda_kernel_launch_params(grid, dim3(QMM_RMS_QUANT_WARPS * WARP_SIZE), 0, stream),
                                (const float *) x->data, (const float *) norm->data, qmm_norm_eps(dst), yq, yds, K, N,
                                npad, stride_col_x, layout, qmm_early_launch());
        return;
    }
    const ggml_tensor * unorm = qmm_up_norm(dst);
    const int n_blocks = npad * (K / QK8_1);
    const int vpl = qmm_prep_values(n_blocks, ctx.device);
    const int n_warps = (n_blocks + vpl - 1) / vpl;
    const auto kernel = vpl == 2 ? qmm_quantize_x<2> : qmm_quantize_x<1>;
    ggml_cuda_kernel_launch(kernel, ggml_cuda_kernel_launch_params(dim3((n_warps + QMM_QUANT_WARPS - 1) / QMM_QUANT_WARPS),
                                                                     dim3(QMM_QUANT_WARPS * WARP_SIZE), 0, stream),
                            (const float *) x->data, up ? (const float *) up->data : nullptr,
                            unorm ? (const float *) unorm->data : nullptr, unorm ? (int) ggml_nelements(unorm) : 0,
                            qmm_norm_eps(dst), dst->op_params[2], yq, yds, K, N, npad, stride_col_x,
                            up ? (int64_t) (up->nb[1] / sizeof(float)) : 0, layout, qmm_early_launch());
}

// Q4_K, Q6_K or BF16 through the f16 kernel (qmatmul_shared.cuh): K a multiple of 256, Hopper. The activations
// prepared here from x, or x itself where it is prepared (ggml_qmatmul_prepared); GLU (Q4_K): the kernel's GLU
// form writes dst, the next product's prepared activations (ggml_qmatmul_swiglu_prepared)
template <ggml_type type, bool GLU = false>
static void qmatmul_half(ggml_backend_cuda_context & ctx, const ggml_tensor * w, const ggml_tensor * x, ggml_tensor * dst) {
    const bool prepared = dst->op_params[3] == GGML_EXT_QMATMUL_FORM_PREPARED_IN;
    const int K = (int) w->ne[0], M = (int) w->ne[1], N = prepared ? dst->op_params[4] : (int) x->ne[1];
    const int nt = (N + 7) / 8, npad = 8 * nt;
    GGML_ASSERT(qmh_tiles<type>(M) <= QMH_MAX_TILES);
    const int P = qmh_grid<type>(M, K, ggml_cuda_info().devices[ctx.device].nsm, qmh_per_sm<type, GLU>(M, ctx.device));
    ggml_cuda_pool_alloc<char> xh(ctx.pool());
    if (!prepared) {
        xh.alloc((size_t) (K / QMM_UNIT) * qmh_act_bytes(npad));
        qmm_prepare_x(ctx, x, dst, K, N, npad, type == GGML_TYPE_BF16 ? QMM_X_BF16 : QMM_X_F16, (int8_t *) xh.get(),
                      nullptr);
    }
    ggml_cuda_pool_alloc<float> ws(ctx.pool(), qmh_ws_floats<type>(nt, P, M));
    const ggml_tensor * add = dst->src[3];   // ggml_qmatmul_fused: added as the outputs are stored
    const qmh_args p = {(const char *) w->data, prepared ? (const half *) x->data : (const half *) xh.get(),
                        GLU ? nullptr : (float *) dst->data, K / QMM_UNIT, K, M, N, npad,
                        GLU ? 0 : (int) (dst->nb[1] / sizeof(float)), add ? (const float *) add->data : nullptr,
                        add ? (int) (add->nb[1] / sizeof(float)) : 0, ws.get(), qmm_early_launch(),
                        GLU ? (half *) dst->data : nullptr, GLU ? M / 2 : 0, GLU && dst->op_params[4] != 0};
    qmh_run<type, GLU>(p, ctx.device, P, ctx.stream());
}

// ggml_qmatmul_swiglu_prepared (Q4_K) and ggml_qmatmul_prepared (Q4_K, Q6_K): the f16 kernel only
// (ggml_ext_cuda_qmatmul_supported)
static void qmatmul_prepared_forms(ggml_backend_cuda_context & ctx, const ggml_tensor * w, const ggml_tensor * x,
                                   ggml_tensor * dst) {
    const bool glu = dst->op_params[3] == GGML_EXT_QMATMUL_FORM_SWIGLU_PREPARED;
    if (w->type == GGML_TYPE_Q4_K) {
        glu ? qmatmul_half<GGML_TYPE_Q4_K, true>(ctx, w, x, dst) : qmatmul_half<GGML_TYPE_Q4_K>(ctx, w, x, dst);
    } else if (w->type == GGML_TYPE_Q6_K && !glu) {
        qmatmul_half<GGML_TYPE_Q6_K>(ctx, w, x, dst);
    } else {
        GGML_ABORT("ggml_qmatmul: no prepared form for %s", ggml_type_name(w->type));
    }
}

// BF16 where its f16-kernel form does not run (before Hopper, or K not a multiple of 256): one warp per output, the
// row in f32 against the (normed / gated) column, lanes' sums added by a butterfly. Slow; for completeness.
static __global__ void qmm_bf16_rows(const nv_bfloat16 * __restrict__ w, const float * __restrict__ x,
                                     const float * __restrict__ add, float * __restrict__ dst, int K, int M,
                                     int64_t stride_col_x, int stride_col_add, int stride_col_dst) {
    const int row = blockIdx.x * (blockDim.x / WARP_SIZE) + threadIdx.x / WARP_SIZE, col = blockIdx.y;
    const int lane = threadIdx.x % WARP_SIZE;
    ggml_cuda_pdl_sync();
    if (row >= M) {
        return;
    }
    float sum = 0.0f;
    for (int k = lane; k < K; k += WARP_SIZE) {
        sum += __bfloat162float(w[(size_t) row * K + k]) * x[col * stride_col_x + k];
    }
#pragma unroll
    for (int offset = WARP_SIZE / 2; offset > 0; offset >>= 1) {
        sum += __shfl_xor_sync(0xffffffff, sum, offset, WARP_SIZE);
    }
    if (lane == 0) {
        dst[(size_t) col * stride_col_dst + row] = add ? __fadd_rn(sum, add[(size_t) col * stride_col_add + row]) : sum;
    }
}

template <ggml_type type>
static void qmatmul_mma(ggml_backend_cuda_context & ctx, const ggml_tensor * w, const ggml_tensor * x, ggml_tensor * dst) {
    cudaStream_t stream = ctx.stream();
    const int K    = (int) w->ne[0];
    const int M    = (int) w->ne[1];
    const int N    = (int) x->ne[1];
    const int nt   = (N + 7) / 8;
    const int npad = 8 * nt;
    int forced = dst->op_params[0];   // row_tiles (ggml_qmatmul): 0 = choose here, < 0 the staged kernel
    const bool hopper = ggml_ext_cuda_qmatmul_streams(ctx.device);
    if (forced == GGML_EXT_QMATMUL_F16) {
        if constexpr (type == GGML_TYPE_Q4_K || type == GGML_TYPE_Q6_K) {
            if (hopper && K % QMM_UNIT == 0) {
                qmatmul_half<type>(ctx, w, x, dst);
                return;
            }
        }
        forced = 0;   // no f16 kernel here: the kernel's own choice
    }
    int staged_rt = 0;   // > 0: the staged kernel with these row tiles
    if constexpr (type != GGML_TYPE_Q8_0) {
        if (hopper && nt >= 2) {
            staged_rt = forced < 0 ? -forced : forced == 0 ? qmm_auto_staged(type, nt, M) : 0;
        }
    }
    ggml_cuda_pool_alloc<char> buf(ctx.pool(), (size_t) npad * K + (size_t) npad * (K / QK8_1) * sizeof(float2));
    int8_t * yq   = (int8_t *) buf.get();
    float2 * yds  = (float2 *) (buf.get() + (size_t) npad * K);   // npad*K is a multiple of 256: aligned
    qmm_prepare_x(ctx, x, dst, K, N, npad, staged_rt > 0 ? QMM_X_HALVES : QMM_X_INT8, yq, yds);

    qmm_args p = {(const char *) w->data, yq, yds, (float *) dst->data, (int) (K / ggml_blck_size(w->type)),
                  K, M, N, npad, (int) (dst->nb[1] / sizeof(float))};
    if (const ggml_tensor * add = dst->src[3]) {   // ggml_qmatmul_fused: added as the outputs are stored
        p.add            = (const float *) add->data;
        p.stride_col_add = (int) (add->nb[1] / sizeof(float));
    }
    if constexpr (type != GGML_TYPE_Q8_0) {
        if (staged_rt > 0) {
            qmm_staged_run<type>(p, nt, staged_rt, ctx.device, stream);
            return;
        }
        // one column, the kernel's choice: the streaming matrix-vector kernel of the same bits on Hopper
        if (N == 1 && forced == 0 && hopper && qms_run_smem<type>(K) <= ggml_cuda_info().devices[ctx.device].smpbo) {
            qms_run<type>(p, ctx.device, stream);
            return;
        }
    }
    const int rt = forced != 0 ? abs(forced) : qmm_auto_row_tiles(type, nt, M);
    qmm_mma_run<type>(p, nt, rt, stream);
}

void ggml_ext_cuda_qmatmul(ggml_backend_cuda_context & ctx, ggml_tensor * dst) {
    const ggml_tensor * w = dst->src[0];
    const ggml_tensor * x = dst->src[1];
    cudaStream_t stream = ctx.stream();

    const int64_t K = w->ne[0];
    const int64_t M = w->ne[1];
    const int64_t N = x->ne[1];
    GGML_ASSERT(ggml_qmatmul_supported(w->type) && N >= 1 && N <= GGML_EXT_QMATMUL_MAX_COLS);
    GGML_ASSERT(M * (K / ggml_blck_size(w->type)) <= INT_MAX);
    if (dst->op_params[3] != GGML_EXT_QMATMUL_FORM_PLAIN) {
        qmatmul_prepared_forms(ctx, w, x, dst);
        return;
    }
    if (w->type == GGML_TYPE_BF16 && ggml_ext_cuda_qmatmul_streams(ctx.device) && K % QMM_UNIT == 0) {
        qmatmul_half<GGML_TYPE_BF16>(ctx, w, x, dst);
        return;
    }
    if (ggml_cuda_info().devices[ctx.device].cc >= GGML_CUDA_CC_AMPERE && w->type != GGML_TYPE_BF16) {   // int8 mma.sync
        switch (w->type) {
            case GGML_TYPE_Q4_K: qmatmul_mma<GGML_TYPE_Q4_K>(ctx, w, x, dst); return;
            case GGML_TYPE_Q5_K: qmatmul_mma<GGML_TYPE_Q5_K>(ctx, w, x, dst); return;
            case GGML_TYPE_Q6_K: qmatmul_mma<GGML_TYPE_Q6_K>(ctx, w, x, dst); return;
            case GGML_TYPE_Q8_0: qmatmul_mma<GGML_TYPE_Q8_0>(ctx, w, x, dst); return;
            default: break;
        }
    }

    const float * xf = (const float *) x->data;
    int64_t stride_col_x = x->nb[1] / sizeof(float);
    ggml_cuda_pool_alloc<float> normed(ctx.pool());
    if (const ggml_tensor * norm = qmm_column_norm(dst)) {   // ggml_qmatmul_rms_norm
        normed.alloc(N * K);
        ggml_cuda_kernel_launch(qmm_rms_norm_x, ggml_cuda_kernel_launch_params(dim3(N), dim3(QMM_RMS_MAX_THREADS), 0, stream),
                                xf, (const float *) norm->data, qmm_norm_eps(dst), normed.get(), (int) K, stride_col_x);
        xf = normed.get();
        stride_col_x = K;
    } else if (const ggml_tensor * up = dst->src[4]) {   // ggml_qmatmul_fused's gated columns first
        const ggml_tensor * unorm = qmm_up_norm(dst);
        normed.alloc(N * K);
        ggml_cuda_kernel_launch(qmm_glu_x, ggml_cuda_kernel_launch_params(dim3(N), dim3(256), 0, stream),
                                xf, (const float *) up->data, unorm ? (const float *) unorm->data : nullptr,
                                unorm ? (int) ggml_nelements(unorm) : 0, qmm_norm_eps(dst), dst->op_params[2],
                                normed.get(), (int) K, stride_col_x, (int64_t) (up->nb[1] / sizeof(float)));
        xf = normed.get();
        stride_col_x = K;
    }
    if (w->type == GGML_TYPE_BF16) {
        const ggml_tensor * add = dst->src[3];
        ggml_cuda_kernel_launch(qmm_bf16_rows, ggml_cuda_kernel_launch_params(dim3((M + 7) / 8, N), dim3(8 * WARP_SIZE), 0, stream),
                                (const nv_bfloat16 *) w->data, xf, add ? (const float *) add->data : nullptr, (float *) dst->data,
                                (int) K, (int) M, stride_col_x, add ? (int) (add->nb[1] / sizeof(float)) : 0,
                                (int) (dst->nb[1] / sizeof(float)));
        return;
    }
    const int64_t K_padded = GGML_PAD(K, MATRIX_ROW_PADDING);
    ggml_cuda_pool_alloc<char> y(ctx.pool(), N * K_padded * sizeof(block_q8_1) / QK8_1);
    quantize_row_q8_1_cuda(xf, nullptr, y.get(), w->type, K, stride_col_x, N * stride_col_x, N * stride_col_x,
                           K_padded, N, 1, 1, stream);

    const int blocks_per_row = (int) (K / ggml_blck_size(w->type));
    const int stride_col_y   = (int) (K_padded / QK8_1);
    const block_q8_1 * yq    = (const block_q8_1 *) y.get();
    float * out              = (float *) dst->data;
    const int stride_col_dst = (int) (dst->nb[1] / sizeof(float));
    switch (w->type) {
        case GGML_TYPE_Q4_K: qmatmul_switch<GGML_TYPE_Q4_K>(w->data, yq, out, blocks_per_row, M, N, stride_col_y, stride_col_dst, stream); break;
        case GGML_TYPE_Q5_K: qmatmul_switch<GGML_TYPE_Q5_K>(w->data, yq, out, blocks_per_row, M, N, stride_col_y, stride_col_dst, stream); break;
        case GGML_TYPE_Q6_K: qmatmul_switch<GGML_TYPE_Q6_K>(w->data, yq, out, blocks_per_row, M, N, stride_col_y, stride_col_dst, stream); break;
        case GGML_TYPE_Q8_0: qmatmul_switch<GGML_TYPE_Q8_0>(w->data, yq, out, blocks_per_row, M, N, stride_col_y, stride_col_dst, stream); break;
        default: GGML_ABORT("ggml_qmatmul: unsupported weight type %s", ggml_type_name(w->type));
    }
    if (const ggml_tensor * add = dst->src[3]) {   // ggml_qmatmul_fused, here after the product
        const int64_t n = M * N;
        ggml_cuda_kernel_launch(qmm_add_after, ggml_cuda_kernel_launch_params(dim3((n + 255) / 256), dim3(256), 0, stream),
                                out, (const float *) add->data, (int) M, n, stride_col_dst, (int) (add->nb[1] / sizeof(float)));
    }
}

void ggml_ext_cuda_qmatmul_prepare(ggml_backend_cuda_context & ctx, ggml_tensor * dst) {
    const ggml_tensor * x = dst->src[0];   // (and the norm at src[2], where qmm_prepare_x looks for it)
    const int K = (int) x->ne[0], N = (int) x->ne[1];
    qmm_prepare_x(ctx, x, dst, K, N, (int) dst->ne[1], QMM_X_F16, (int8_t *) dst->data, nullptr);
}

bool ggml_ext_cuda_qmatmul_supported(int device, const ggml_tensor * op) {
    const ggml_tensor * w = op->src[0];
    if (op->op_params[3] != GGML_EXT_QMATMUL_FORM_PLAIN) {   // the f16 kernel's forms: Hopper only
        const int64_t M = w->ne[1];
        const bool q4 = w->type == GGML_TYPE_Q4_K;
        const bool glu = op->op_params[3] == GGML_EXT_QMATMUL_FORM_SWIGLU_PREPARED;
        return ggml_ext_cuda_qmatmul_streams(device) && (q4 || (w->type == GGML_TYPE_Q6_K && !glu)) &&
               w->ne[0] % QMM_UNIT == 0 &&
               M * (w->ne[0] / QMM_UNIT) <= INT_MAX &&
               (q4 ? qmh_tiles<GGML_TYPE_Q4_K>((int) M) : qmh_tiles<GGML_TYPE_Q6_K>((int) M)) <= QMH_MAX_TILES;
    }
    // the launch indexes quant blocks with int; a norm of up's groups takes whole warps per group
    const bool groups_ok = qmm_up_norm(op) == nullptr || ggml_nelements(qmm_up_norm(op)) % WARP_SIZE == 0;
    return ggml_qmatmul_supported(w->type) && w->ne[1] * (w->ne[0] / ggml_blck_size(w->type)) <= INT_MAX && groups_ok;
}
