// ggml_qmatmul on CUDA: W * X for a few columns, bit-identical per column whatever the number of columns.
// Q4_K and Q6_K take the tensor-core kernel further down (on Ampere and later); Q5_K and Q8_0 (and Q4_K/Q6_K on
// older GPUs) the vector kernel described here.
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
#include "vecdotq.cuh"

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

// --- Q4_K and Q6_K on tensor cores ------------------------------------------------------------------------------
// These types go through int8 MMA (16 weight rows x 8 columns per instruction), which keeps the cost of 48
// columns near that of one. Q4_K: mma m16n8k32 over one 32-value sub-block (one scale and min); Q6_K: m16n8k16
// over one 16-value group (one scale; the -32 offset is applied to the integers). The integer dot products are
// exact; the float part is, per output and group in K order, acc += (d*sc * dx) * sumi (Q4_K then also
// acc -= (dmin*m) * sx), with explicit roundings so that no contraction is left to the compiler. A CUDA block is
// QMM_MMA_WARPS warps over the same 16 rows, warp w taking super-blocks w, w + QMM_MMA_WARPS, ...; their partial
// sums are added in warp order. None of this depends on N, which only sets how many 8-column tiles a warp runs.
//
// Activations: quantised per column and 32 values (scale d = amax/127 rounded to f16 as q8_1 does, q =
// round(x/d)) into int8 [N][K] plus float2 (d, d * sum q) per block. For Q4_K, within a 32-value block the MMA
// sees the values permuted (thread t of a quad holds values 8t..8t+7, one 8-byte load); A and B use the same
// permutation, so the dot product is unchanged.

#define QMM_MMA_WARPS 8
#define QMM_MMA_ROWS  16

static __global__ void qmm_quantize_x(const float * __restrict__ x, int8_t * __restrict__ yq, float2 * __restrict__ yds,
                                      int K, int N, int64_t stride_col_x) {
    const int warp = blockIdx.x * (blockDim.x / WARP_SIZE) + threadIdx.x / WARP_SIZE;
    const int lane = threadIdx.x % WARP_SIZE;
    const int blocks_per_col = K / QK8_1;
    if (warp >= blocks_per_col * N) {
        return;
    }
    const int col = warp / blocks_per_col;
    const int kb  = warp % blocks_per_col;
    ggml_cuda_pdl_sync();   // x is the previous kernel's output: with programmatic dependent launch, wait for it
    const float v = x[col * stride_col_x + kb * QK8_1 + lane];
    float amax = fabsf(v);
#pragma unroll
    for (int offset = WARP_SIZE / 2; offset > 0; offset >>= 1) {
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffff, amax, offset, WARP_SIZE));
    }
    const float d = amax / 127.0f;
    const int q = amax == 0.0f ? 0 : (int) roundf(v / d);
    int sum = q;
#pragma unroll
    for (int offset = WARP_SIZE / 2; offset > 0; offset >>= 1) {
        sum += __shfl_xor_sync(0xffffffff, sum, offset, WARP_SIZE);
    }
    yq[(size_t) col * K + kb * QK8_1 + lane] = (int8_t) q;
    if (lane == 0) {
        const float dh = __half2float(__float2half_rn(d));
        yds[(size_t) col * blocks_per_col + kb] = make_float2(dh, __fmul_rn(dh, (float) sum));
    }
}

static __device__ __forceinline__ void mma_s8_k32(int (&c)[4], int a0, int a1, int a2, int a3, int b0, int b1) {
#if __CUDA_ARCH__ >= 800
    asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
                 "{%10, %11, %12, %13};"
                 : "=r"(c[0]), "=r"(c[1]), "=r"(c[2]), "=r"(c[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1), "r"(0), "r"(0), "r"(0), "r"(0));
#else
    GGML_UNUSED_VARS(c, a0, a1, a2, a3, b0, b1);
    NO_DEVICE_CODE;
#endif
}

static __device__ __forceinline__ void mma_s8_k16(int (&c)[4], int a0, int a1, int b0) {
#if __CUDA_ARCH__ >= 800
    asm volatile("mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5}, {%6}, "
                 "{%7, %8, %9, %10};"
                 : "=r"(c[0]), "=r"(c[1]), "=r"(c[2]), "=r"(c[3])
                 : "r"(a0), "r"(a1), "r"(b0), "r"(0), "r"(0), "r"(0), "r"(0));
#else
    GGML_UNUSED_VARS(c, a0, a1, b0);
    NO_DEVICE_CODE;
#endif
}

// byte i (0..11, a compile-time constant after unrolling) of Q4_K's packed scales, held as 3 words
#define QMM_Q4K_BYTE(i) ((int) (((i) < 4 ? h.y : (i) < 8 ? h.z : h.w) >> (8 * ((i) % 4)) & 0xFF))

// a 4-byte word at a 2-byte aligned address (Q6_K blocks are 210 bytes); `aligned`: the address is 4-aligned
static __device__ __forceinline__ int qmm_ld32_a2(const uint8_t * p, bool aligned) {
    if (aligned) {
        return *(const int *) p;
    }
    const uint16_t * q = (const uint16_t *) p;
    return (int) (q[0] | ((uint32_t) q[1] << 16));
}

// acc[t][i] += one group's contribution for tile t (c: the MMA's integer sums), in a fixed order
static __device__ __forceinline__ void qmm_accumulate(float (&acc)[4], const int (&c)[4], const float (&dsc)[2],
                                                      const float2 ds0, const float2 ds1) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float dx = i % 2 ? ds1.x : ds0.x;
        acc[i] = __fmaf_rn(__fmul_rn(dsc[i / 2], dx), (float) c[i], acc[i]);
    }
}

// One super-block of this thread's two rows (g and g + 8 of the tile) against NT column tiles.
template <ggml_type type, int NT> struct qmm_superblock;

template <int NT> struct qmm_superblock<GGML_TYPE_Q4_K, NT> {
    static __device__ __forceinline__ void run(const void * const (&rows)[2], int sb, const int8_t * __restrict__ yq,
                                               const float2 * __restrict__ yds, const int (&colb)[NT],
                                               const int (&colc)[NT][2], int K, int t4, float (&acc)[NT][4]) {
        uint4 hdr[2];
        uint2 qs[2][4];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const block_q4_K * b = (const block_q4_K *) rows[r] + sb;
            hdr[r] = *(const uint4 *) b;
#pragma unroll
            for (int p = 0; p < 4; ++p) {
                qs[r][p] = *(const uint2 *) (b->qs + 32 * p + 8 * t4);
            }
        }
        const int blocks_per_col = K / QK8_1;
#pragma unroll
        for (int s = 0; s < 8; ++s) {
            float dsc[2], dm[2];
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const uint4 h = hdr[r];
                int sc, m;
                if (s < 4) {
                    sc = QMM_Q4K_BYTE(s) & 63;
                    m  = QMM_Q4K_BYTE(s + 4) & 63;
                } else {
                    sc = (QMM_Q4K_BYTE(s + 4) & 0xF) | ((QMM_Q4K_BYTE(s - 4) >> 6) << 4);
                    m  = (QMM_Q4K_BYTE(s + 4) >> 4) | ((QMM_Q4K_BYTE(s) >> 6) << 4);
                }
                const float2 dmin = __half22float2(*(const half2 *) &h.x);
                dsc[r] = __fmul_rn(dmin.x, (float) sc);
                dm[r]  = __fmul_rn(dmin.y, (float) m);
            }
            const int shift = 4 * (s % 2);
            const int a0 = (qs[0][s / 2].x >> shift) & 0x0F0F0F0F;
            const int a1 = (qs[1][s / 2].x >> shift) & 0x0F0F0F0F;
            const int a2 = (qs[0][s / 2].y >> shift) & 0x0F0F0F0F;
            const int a3 = (qs[1][s / 2].y >> shift) & 0x0F0F0F0F;
            const int kb = sb * (QK_K / QK8_1) + s;
#pragma unroll
            for (int t = 0; t < NT; ++t) {
                const int2 bq = *(const int2 *) (yq + (size_t) colb[t] * K + kb * QK8_1 + 8 * t4);
                const float2 ds0 = yds[(size_t) colc[t][0] * blocks_per_col + kb];
                const float2 ds1 = yds[(size_t) colc[t][1] * blocks_per_col + kb];
                int c[4];
                mma_s8_k32(c, a0, a1, a2, a3, bq.x, bq.y);
                qmm_accumulate(acc[t], c, dsc, ds0, ds1);
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    acc[t][i] = __fmaf_rn(-dm[i / 2], i % 2 ? ds1.y : ds0.y, acc[t][i]);
                }
            }
        }
    }
};

template <int NT> struct qmm_superblock<GGML_TYPE_Q6_K, NT> {
    static __device__ __forceinline__ void run(const void * const (&rows)[2], int sb, const int8_t * __restrict__ yq,
                                               const float2 * __restrict__ yds, const int (&colb)[NT],
                                               const int (&colc)[NT][2], int K, int t4, float (&acc)[NT][4]) {
        // per row: ql words [h][j%2][e] (bytes 64h + 32(j%2) + 16e + 4t4), qh words [h][e] (32h + 16e + 4t4)
        int ql[2][2][2][2], qh[2][2][2];
        float d[2];
        int scw[2][4];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const block_q6_K * b = (const block_q6_K *) rows[r] + sb;
            // with an even number of super-blocks per row this is the same for all of a warp's blocks
            const bool al = ((uintptr_t) b & 3) == 0;
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    ql[r][hh][0][e] = qmm_ld32_a2(b->ql + 64 * hh + 16 * e + 4 * t4, al);
                    ql[r][hh][1][e] = qmm_ld32_a2(b->ql + 64 * hh + 32 + 16 * e + 4 * t4, al);
                    qh[r][hh][e]    = qmm_ld32_a2(b->qh + 32 * hh + 16 * e + 4 * t4, al);
                }
            }
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                scw[r][i] = qmm_ld32_a2((const uint8_t *) b->scales + 4 * i, al);
            }
            d[r] = __half2float(b->d);
        }
        const int blocks_per_col = K / QK8_1;
        // group G = 8h + 2j + e holds values 128h + 32j + 16e + (0..15)
#pragma unroll
        for (int G = 0; G < 16; ++G) {
            const int hh = G / 8, j = (G / 2) % 4, e = G % 2;
            float dsc[2];
            int a[2];
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const int sc = (int) (int8_t) ((scw[r][G / 4] >> (8 * (G % 4))) & 0xFF);
                dsc[r] = __fmul_rn(d[r], (float) sc);
                const int lo = (ql[r][hh][j % 2][e] >> (4 * (j / 2))) & 0x0F0F0F0F;
                const int hi = ((qh[r][hh][e] >> (2 * j)) & 0x03030303) << 4;
                a[r] = __vsubss4(lo | hi, 0x20202020);
            }
            const int kb = sb * (QK_K / QK8_1) + G / 2;
#pragma unroll
            for (int t = 0; t < NT; ++t) {
                const int bq = *(const int *) (yq + (size_t) colb[t] * K + sb * QK_K + 16 * G + 4 * t4);
                const float2 ds0 = yds[(size_t) colc[t][0] * blocks_per_col + kb];
                const float2 ds1 = yds[(size_t) colc[t][1] * blocks_per_col + kb];
                int c[4];
                mma_s8_k16(c, a[0], a[1], bq);
                qmm_accumulate(acc[t], c, dsc, ds0, ds1);
            }
        }
    }
};

template <ggml_type type, int NT>
static __global__ void __launch_bounds__(QMM_MMA_WARPS * WARP_SIZE)
qmm_mma(const char * __restrict__ W, const int8_t * __restrict__ yq, const float2 * __restrict__ yds,
        float * __restrict__ dst, int nsb, int M, int N, int stride_col_dst) {
    const int lane = threadIdx.x;
    const int warp = threadIdx.y;
    const int g    = lane / 4;
    const int t4   = lane % 4;
    const int r0   = blockIdx.x * QMM_MMA_ROWS;
    const size_t row_bytes = (size_t) nsb * ggml_cuda_type_traits<type>::bs;   // one 256-value block per super-block

    const void * rows[2];  // rows g and g + 8 of the tile (clamped for loads)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        rows[r] = W + (size_t) min(r0 + 8 * r + g, M - 1) * row_bytes;
    }
    int colb[NT], colc[NT][2];  // B operand column 8t + g; accumulator columns 8t + 2 t4 + {0, 1}
#pragma unroll
    for (int t = 0; t < NT; ++t) {
        colb[t]    = min(8 * t + g, N - 1);
        colc[t][0] = min(8 * t + 2 * t4, N - 1);
        colc[t][1] = min(8 * t + 2 * t4 + 1, N - 1);
    }

    ggml_cuda_pdl_sync();

    float acc[NT][4] = {};
    for (int sb = warp; sb < nsb; sb += QMM_MMA_WARPS) {
        qmm_superblock<type, NT>::run(rows, sb, yq, yds, colb, colc, nsb * QK_K, t4, acc);
    }

    __shared__ float partial[QMM_MMA_WARPS - 1][NT * 4][WARP_SIZE];
    if (warp > 0) {
#pragma unroll
        for (int t = 0; t < NT; ++t) {
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                partial[warp - 1][t * 4 + i][lane] = acc[t][i];
            }
        }
    }
    __syncthreads();
    if (warp > 0) {
        return;
    }
#pragma unroll
    for (int t = 0; t < NT; ++t) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            float sum = acc[t][i];
#pragma unroll
            for (int l = 0; l < QMM_MMA_WARPS - 1; ++l) {
                sum = __fadd_rn(sum, partial[l][t * 4 + i][lane]);
            }
            const int row = r0 + 8 * (i / 2) + g;
            const int col = 8 * t + 2 * t4 + i % 2;
            if (row < M && col < N) {
                dst[(size_t) col * stride_col_dst + row] = sum;
            }
        }
    }
}

template <ggml_type type, int NT>
static void qmm_mma_launch(const void * W, const int8_t * yq, const float2 * yds, float * dst, int nsb, int M, int N,
                           int stride_col_dst, cudaStream_t stream) {
    const dim3 grid((M + QMM_MMA_ROWS - 1) / QMM_MMA_ROWS);
    const dim3 block(WARP_SIZE, QMM_MMA_WARPS);
    ggml_cuda_kernel_launch(qmm_mma<type, NT>, ggml_cuda_kernel_launch_params(grid, block, 0, stream),
                            (const char *) W, yq, yds, dst, nsb, M, N, stride_col_dst);
}

template <ggml_type type>
static void qmatmul_mma(ggml_backend_cuda_context & ctx, const ggml_tensor * w, const ggml_tensor * x, ggml_tensor * dst) {
    cudaStream_t stream = ctx.stream();
    const int K = (int) w->ne[0];
    const int M = (int) w->ne[1];
    const int N = (int) x->ne[1];
    ggml_cuda_pool_alloc<char> buf(ctx.pool(), (size_t) N * K + (size_t) N * (K / QK8_1) * sizeof(float2));
    int8_t * yq   = (int8_t *) buf.get();
    float2 * yds  = (float2 *) (buf.get() + (size_t) N * K);   // N*K is a multiple of 256: aligned
    const int n_warps = N * (K / QK8_1);
    ggml_cuda_kernel_launch(qmm_quantize_x, ggml_cuda_kernel_launch_params(dim3((n_warps + 7) / 8), dim3(8 * WARP_SIZE), 0, stream),
                            (const float *) x->data, yq, yds, K, N, (int64_t) (x->nb[1] / sizeof(float)));

    const int nsb = K / QK_K;
    const int stride_col_dst = (int) (dst->nb[1] / sizeof(float));
    float * out = (float *) dst->data;
    switch ((N + 7) / 8) {
        case 1: qmm_mma_launch<type, 1>(w->data, yq, yds, out, nsb, M, N, stride_col_dst, stream); break;
        case 2: qmm_mma_launch<type, 2>(w->data, yq, yds, out, nsb, M, N, stride_col_dst, stream); break;
        case 3: qmm_mma_launch<type, 3>(w->data, yq, yds, out, nsb, M, N, stride_col_dst, stream); break;
        case 4: qmm_mma_launch<type, 4>(w->data, yq, yds, out, nsb, M, N, stride_col_dst, stream); break;
        case 5: qmm_mma_launch<type, 5>(w->data, yq, yds, out, nsb, M, N, stride_col_dst, stream); break;
        case 6: qmm_mma_launch<type, 6>(w->data, yq, yds, out, nsb, M, N, stride_col_dst, stream); break;
        default: GGML_ABORT("ggml_qmatmul: %d columns", N);
    }
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
    if (ggml_cuda_info().devices[ctx.device].cc >= GGML_CUDA_CC_AMPERE) {   // int8 mma.sync
        if (w->type == GGML_TYPE_Q4_K) {
            qmatmul_mma<GGML_TYPE_Q4_K>(ctx, w, x, dst);
            return;
        }
        if (w->type == GGML_TYPE_Q6_K) {
            qmatmul_mma<GGML_TYPE_Q6_K>(ctx, w, x, dst);
            return;
        }
    }

    const int64_t K_padded = GGML_PAD(K, MATRIX_ROW_PADDING);
    ggml_cuda_pool_alloc<char> y(ctx.pool(), N * K_padded * sizeof(block_q8_1) / QK8_1);
    quantize_row_q8_1_cuda((const float *) x->data, nullptr, y.get(), w->type, K, x->nb[1] / sizeof(float),
                           N * x->nb[1] / sizeof(float), N * x->nb[1] / sizeof(float), K_padded, N, 1, 1, stream);

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
}

bool ggml_ext_cuda_qmatmul_supported(const ggml_tensor * op) {
    const ggml_tensor * w = op->src[0];
    // the launch indexes quant blocks with int
    return ggml_qmatmul_supported(w->type) && w->ne[1] * (w->ne[0] / ggml_blck_size(w->type)) <= INT_MAX;
}
