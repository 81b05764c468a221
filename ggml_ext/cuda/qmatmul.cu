// ggml_qmatmul on CUDA: W * X for a few columns, bit-identical per column whatever the number of columns.
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

// --- Q4_K on tensor cores --------------------------------------------------------------------------------------
// Q4_K weights go through int8 MMA (mma.sync m16n8k32: 16 weight rows x 8 columns x 32 values of one Q4_K
// sub-block), which keeps the cost of 48 columns near that of one. The integer dot product of a sub-block is
// exact; the float part is, per output and sub-block in K order, acc += (d*sc * dx) * sumi, then
// acc -= (dmin*m) * sx, with explicit roundings (no contraction choices left to the compiler). A CUDA block is
// 4 warps over the same 32 rows, warp w taking super-blocks w, w+4, ...; the 4 partial sums are added in warp
// order. None of this depends on N, which only sets how many 8-column tiles each warp runs.
//
// Activations: quantised per column and 32 values (scale d = amax/127 rounded to f16 as q8_1 does, q =
// round(x/d)) into int8 [N][K] plus float2 (d, d * sum q) per block, so that a thread's 8 values are one load.
// Within a 32-value block the MMA sees the values permuted (thread t of a quad holds values 8t..8t+7); A and B
// use the same permutation, so the dot product is unchanged.

#define QMM_MMA_ROWS 32   // rows per CUDA block: 2 MMA tiles of 16 per warp
#define QMM_MMA_MAX_TILES (GGML_EXT_QMATMUL_MAX_COLS / 8)

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

static __device__ __forceinline__ void mma_s8_16x8x32(int (&c)[4], const int (&a)[4], int b0, int b1) {
#if __CUDA_ARCH__ >= 800
    asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
                 "{%10, %11, %12, %13};"
                 : "=r"(c[0]), "=r"(c[1]), "=r"(c[2]), "=r"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "r"(0), "r"(0), "r"(0), "r"(0));
#else
    GGML_UNUSED_VARS(c, a, b0, b1);
    NO_DEVICE_CODE;
#endif
}

// 6-bit scale and min of sub-block j (0..7) from the 12 packed bytes, held as 3 words
static __device__ __forceinline__ void q4k_scale_min(const int j, const uint32_t w0, const uint32_t w1,
                                                     const uint32_t w2, int & sc, int & m) {
    const uint32_t w[3] = {w0, w1, w2};
#define QMM_BYTE(i) ((int) ((w[(i) / 4] >> (8 * ((i) % 4))) & 0xFF))
    if (j < 4) {
        sc = QMM_BYTE(j) & 63;
        m  = QMM_BYTE(j + 4) & 63;
    } else {
        sc = (QMM_BYTE(j + 4) & 0xF) | ((QMM_BYTE(j - 4) >> 6) << 4);
        m  = (QMM_BYTE(j + 4) >> 4) | ((QMM_BYTE(j) >> 6) << 4);
    }
#undef QMM_BYTE
}

template <int NT>
static __global__ void __launch_bounds__(QMM_THREADS)
qmm_q4k_mma(const block_q4_K * __restrict__ W, const int8_t * __restrict__ yq, const float2 * __restrict__ yds,
            float * __restrict__ dst, int nsb, int M, int N, int stride_col_dst) {
    const int lane = threadIdx.x;
    const int warp = threadIdx.y;
    const int g    = lane / 4;
    const int t4   = lane % 4;
    const int K    = nsb * QK_K;
    const int r0   = blockIdx.x * QMM_MMA_ROWS;

    // this thread's 4 weight rows: tile mt, half h -> row r0 + 16 mt + 8 h + g (clamped for loads)
    const block_q4_K * rows[4];
#pragma unroll
    for (int r = 0; r < 4; ++r) {
        rows[r] = W + (size_t) min(r0 + 16 * (r / 2) + 8 * (r % 2) + g, M - 1) * nsb;
    }
    // this thread's columns: B operand column 8t + g; accumulator columns 8t + 2 t4 + {0, 1}
    int colb[NT], colc[NT][2];
#pragma unroll
    for (int t = 0; t < NT; ++t) {
        colb[t]    = min(8 * t + g, N - 1);
        colc[t][0] = min(8 * t + 2 * t4, N - 1);
        colc[t][1] = min(8 * t + 2 * t4 + 1, N - 1);
    }
    const int blocks_per_col = K / QK8_1;

    ggml_cuda_pdl_sync();

    float acc[NT][2][4] = {};
    for (int sb = warp; sb < nsb; sb += QMM_WARPS) {
        uint4 hdr[4];
        uint2 qs[4][4];
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            const block_q4_K * b = rows[r] + sb;
            hdr[r] = *(const uint4 *) b;
#pragma unroll
            for (int p = 0; p < 4; ++p) {
                qs[r][p] = *(const uint2 *) (b->qs + 32 * p + 8 * t4);
            }
        }
#pragma unroll
        for (int s = 0; s < 8; ++s) {
            float dsc[4], dm[4];
#pragma unroll
            for (int r = 0; r < 4; ++r) {
                int sc, m;
                q4k_scale_min(s, hdr[r].y, hdr[r].z, hdr[r].w, sc, m);
                const float2 dmin = __half22float2(*(const half2 *) &hdr[r].x);
                dsc[r] = __fmul_rn(dmin.x, (float) sc);
                dm[r]  = __fmul_rn(dmin.y, (float) m);
            }
            const int shift = 4 * (s % 2);
            int a[2][4];
#pragma unroll
            for (int mt = 0; mt < 2; ++mt) {
                a[mt][0] = (qs[2 * mt + 0][s / 2].x >> shift) & 0x0F0F0F0F;
                a[mt][1] = (qs[2 * mt + 1][s / 2].x >> shift) & 0x0F0F0F0F;
                a[mt][2] = (qs[2 * mt + 0][s / 2].y >> shift) & 0x0F0F0F0F;
                a[mt][3] = (qs[2 * mt + 1][s / 2].y >> shift) & 0x0F0F0F0F;
            }
            const int kb = sb * (QK_K / QK8_1) + s;
#pragma unroll
            for (int t = 0; t < NT; ++t) {
                const int2 b = *(const int2 *) (yq + (size_t) colb[t] * K + kb * QK8_1 + 8 * t4);
                const float2 ds0 = yds[(size_t) colc[t][0] * blocks_per_col + kb];
                const float2 ds1 = yds[(size_t) colc[t][1] * blocks_per_col + kb];
#pragma unroll
                for (int mt = 0; mt < 2; ++mt) {
                    int c[4];
                    mma_s8_16x8x32(c, a[mt], b.x, b.y);
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        const int r = 2 * mt + i / 2;
                        const float2 ds = i % 2 ? ds1 : ds0;
                        float v = __fmaf_rn(__fmul_rn(dsc[r], ds.x), (float) c[i], acc[t][mt][i]);
                        acc[t][mt][i] = __fmaf_rn(-dm[r], ds.y, v);
                    }
                }
            }
        }
    }

    __shared__ float partial[QMM_WARPS - 1][NT * 8][WARP_SIZE];
    if (warp > 0) {
#pragma unroll
        for (int t = 0; t < NT; ++t) {
#pragma unroll
            for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    partial[warp - 1][t * 8 + mt * 4 + i][lane] = acc[t][mt][i];
                }
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
        for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                float sum = acc[t][mt][i];
#pragma unroll
                for (int l = 0; l < QMM_WARPS - 1; ++l) {
                    sum = __fadd_rn(sum, partial[l][t * 8 + mt * 4 + i][lane]);
                }
                const int row = r0 + 16 * mt + 8 * (i / 2) + g;
                const int col = 8 * t + 2 * t4 + i % 2;
                if (row < M && col < N) {
                    dst[(size_t) col * stride_col_dst + row] = sum;
                }
            }
        }
    }
}

template <int NT>
static void qmm_q4k_launch(const void * W, const int8_t * yq, const float2 * yds, float * dst, int nsb, int M, int N,
                           int stride_col_dst, cudaStream_t stream) {
    const dim3 grid((M + QMM_MMA_ROWS - 1) / QMM_MMA_ROWS);
    const dim3 block(WARP_SIZE, QMM_WARPS);
    ggml_cuda_kernel_launch(qmm_q4k_mma<NT>, ggml_cuda_kernel_launch_params(grid, block, 0, stream),
                            (const block_q4_K *) W, yq, yds, dst, nsb, M, N, stride_col_dst);
}

static void qmatmul_q4k(ggml_backend_cuda_context & ctx, const ggml_tensor * w, const ggml_tensor * x, ggml_tensor * dst) {
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
        case 1: qmm_q4k_launch<1>(w->data, yq, yds, out, nsb, M, N, stride_col_dst, stream); break;
        case 2: qmm_q4k_launch<2>(w->data, yq, yds, out, nsb, M, N, stride_col_dst, stream); break;
        case 3: qmm_q4k_launch<3>(w->data, yq, yds, out, nsb, M, N, stride_col_dst, stream); break;
        case 4: qmm_q4k_launch<4>(w->data, yq, yds, out, nsb, M, N, stride_col_dst, stream); break;
        case 5: qmm_q4k_launch<5>(w->data, yq, yds, out, nsb, M, N, stride_col_dst, stream); break;
        case 6: qmm_q4k_launch<6>(w->data, yq, yds, out, nsb, M, N, stride_col_dst, stream); break;
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
    if (w->type == GGML_TYPE_Q4_K && ggml_cuda_info().devices[ctx.device].cc >= GGML_CUDA_CC_AMPERE) {
        qmatmul_q4k(ctx, w, x, dst);
        return;
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
