// ggml_qmatmul's tensor-core kernel with its activations staged in shared memory by the TMA (Hopper; Q4_K, Q5_K,
// Q6_K): the bits of qmm_mma (qmatmul_mma.cuh), which it runs unit for unit; only where the activations come from
// differs.
//
// Why: qmm_mma at 16-48 columns waits on its activation loads (each warp reads 8 NT columns x 8 bytes per 32-value
// block straight from L2; every CUDA block reads all of K for all columns): with them served from shared memory it
// ran 25-40% faster (docs/benchmarks.md, tenth session). Here each warp keeps a ring of QMM_STAGES shared-memory
// slots, each the activations of one half unit (128 values of K for all 8 NT columns, and their scales), filled by
// two bulk copies (cp.async.bulk) QMM_STAGES halves ahead of the one computed and counted on one mbarrier per slot.
// For the two copies the activations are laid out by half unit (qmm_quantize_x with `halves`); one copy per column
// was slower than no staging at all (the TMA's issue rate), and so were clusters sharing each half by multicast
// (docs/benchmarks.md, eleventh session).

#pragma once

#include "qmatmul_stream.cuh"

#define QMM_STAGES 2   // slots per warp

// In a half unit of the staged layout and in a slot, 32-value block kbl (0..3) of column c sits at 32 *
// qmm_swz(kbl, c) in the column's 128 bytes: the 8 columns a warp reads at once then hit 4 bank groups, not one.
static __device__ __forceinline__ int qmm_swz(int kbl, int c) {
    return (kbl + c) % 4;
}

// A slot: the 8 NT activation columns of a half unit (128 bytes each), then its 4 blocks' scales [4][8 NT] float2.
template <int NT> struct qmm_slot {
    static constexpr int scales = 8 * NT * (QMM_UNIT / 2);
    static constexpr int bytes  = scales + 4 * 8 * NT * (int) sizeof(float2);
};

// The activations of one warp's units, from its ring of slots (qmm_cols' interface); `j` counts the halves
// consumed. The staged layout: yqh [K / 128][npad][128] (blocks swizzled), yds as qmm_mma's ([K / 32][npad]),
// npad = 8 NT, so that a half's columns and its scales are one contiguous run each.
template <int NT> struct qmm_cols_staged {
    char * ring;              // this warp's QMM_STAGES slots
    uint64_t * full;          // an mbarrier per slot: the slot's bytes have landed
    const int8_t * yqh;
    const float2 * yds;
    int n_units;
    int j = 0;

    // smem: the block's QMM_MMA_WARPS x QMM_STAGES mbarriers, then its slots, [warp][QMM_STAGES] (qmm_staged_smem)
    static __device__ __forceinline__ char * slots(char * smem) {
        return smem + QMM_MMA_WARPS * QMM_STAGES * sizeof(uint64_t);
    }

    __device__ __forceinline__ qmm_cols_staged(char * smem, const int8_t * yqh_, const float2 * yds_, int n_units_)
        : yqh(yqh_), yds(yds_), n_units(n_units_) {
        full = (uint64_t *) smem + threadIdx.y * QMM_STAGES;
        ring = slots(smem) + (size_t) threadIdx.y * QMM_STAGES * qmm_slot<NT>::bytes;
    }

    // ask for this warp's jj-th half unit (warp + 8 (jj / 2), half jj % 2) into its slot
    __device__ __forceinline__ void issue(int jj) {
        const int lane = threadIdx.x;
        const int u    = threadIdx.y + QMM_MMA_WARPS * (jj / 2);
        if (u >= n_units || lane >= 2) {
            return;
        }
        const int hb = 2 * u + jj % 2;   // half-unit index in K
        const int s  = jj % QMM_STAGES;
        char * slot  = ring + s * qmm_slot<NT>::bytes;
        if (lane == 0) {
            qms_bar_expect(&full[s], qmm_slot<NT>::bytes);
            qms_bulk_copy(slot, yqh + (size_t) hb * qmm_slot<NT>::scales, qmm_slot<NT>::scales, &full[s]);
        } else {
            __syncwarp(0x3);   // lane 0's byte count is in before this copy can complete
            qms_bulk_copy(slot + qmm_slot<NT>::scales, yds + (size_t) hb * 4 * 8 * NT,
                          qmm_slot<NT>::bytes - qmm_slot<NT>::scales, &full[s]);
            return;
        }
        __syncwarp(0x3);
    }

    __device__ __forceinline__ const char * slot() const {
        return ring + (j % QMM_STAGES) * qmm_slot<NT>::bytes;
    }

    __device__ __forceinline__ void half(int, int) {
        qms_bar_wait(&full[j % QMM_STAGES], (j / QMM_STAGES) & 1);
    }

    // done with half j: refill its slot with half j + QMM_STAGES
    __device__ __forceinline__ void done() {
        __syncwarp();
        issue(j + QMM_STAGES);
        ++j;
    }

    __device__ __forceinline__ int2 b8(int t, int kb, int t4_) const {
        const int g = threadIdx.x / 4;
        return *(const int2 *) (slot() + (8 * t + g) * (QMM_UNIT / 2) + qmm_swz(kb % 4, g) * QK8_1 + 8 * t4_);
    }

    __device__ __forceinline__ int b4(int t, int kb, int e, int t4_) const {
        const int g = threadIdx.x / 4;
        return *(const int *) (slot() + (8 * t + g) * (QMM_UNIT / 2) + qmm_swz(kb % 4, g) * QK8_1 + 16 * e + 4 * t4_);
    }

    __device__ __forceinline__ float4 scales(int kb, int t) const {
        const int t4 = threadIdx.x % 4;
        return *(const float4 *) (slot() + qmm_slot<NT>::scales + ((kb % 4) * 8 * NT + 8 * t + 2 * t4) * sizeof(float2));
    }
};

template <int NT> constexpr size_t qmm_staged_smem() {
    return QMM_MMA_WARPS * QMM_STAGES * (sizeof(uint64_t) + (size_t) qmm_slot<NT>::bytes);
}

// As qmm_mma (one CUDA block: 16 RT rows, all N columns, QMM_MMA_WARPS warps splitting K), the activations from the
// warp's ring of slots. K: a multiple of 256 (the K-quants' super-blocks).
template <ggml_type type, int NT, int RT>
static __global__ void __launch_bounds__(QMM_MMA_WARPS * WARP_SIZE, qmm_min_blocks<NT, RT>())
qmm_mma_staged(const char * __restrict__ W, const int8_t * __restrict__ yqh, const float2 * __restrict__ yds,
               float * __restrict__ dst, int nb, int K, int M, int N, int stride_col_dst,
               const float * __restrict__ add, int stride_col_add) {
    extern __shared__ __align__(128) char qmm_smem[];
    const int warp = threadIdx.y;
    const int r0   = blockIdx.x * (QMM_MMA_ROWS * RT);
    const int n_units = K / QMM_UNIT;

    qmm_cols_staged<NT> x(qmm_smem, yqh, yds, n_units);
    if (threadIdx.x < QMM_STAGES) {
        qms_bar_init(&x.full[threadIdx.x]);
    }

    qmm_rows<type, NT, RT> w(W, r0, M, (int64_t) nb * ggml_cuda_type_traits<type>::bs);
    if (warp < n_units) {
        w.prefetch(warp);   // the weights do not depend on the previous kernel: start before waiting for it
    }

    __syncwarp();   // the warp's barriers are initialised (only its own lanes use them)
    ggml_cuda_pdl_sync();
#pragma unroll
    for (int jj = 0; jj < QMM_STAGES; ++jj) {
        x.issue(jj);
    }

    float acc[RT][NT][4] = {};
    qmm_units<type, NT, RT>(w, x, nb, n_units, acc);

    // as qmm_mma, the partial sums in the slots' place (every copy into them has landed: all were consumed)
    __syncthreads();
    static_assert(QMM_MMA_WARPS * NT * 4 * WARP_SIZE * sizeof(float) <= QMM_MMA_WARPS * QMM_STAGES * qmm_slot<NT>::bytes,
                  "the partial sums must fit in the slots");
    qmm_store_sums<NT, RT>(acc, (float (*)[NT * 4][WARP_SIZE]) qmm_cols_staged<NT>::slots(qmm_smem), r0, M, N, dst,
                           stride_col_dst, add, stride_col_add);
}

template <ggml_type type, int NT, int RT>
static void qmm_staged_launch(const qmm_args & p, int device, cudaStream_t stream) {
    constexpr auto kernel = qmm_mma_staged<type, NT, RT>;
    constexpr size_t smem = qmm_staged_smem<NT>();
    ggml_ext_cuda_allow_smem<kernel>(smem, device);
    const dim3 grid((p.M + QMM_MMA_ROWS * RT - 1) / (QMM_MMA_ROWS * RT));
    ggml_cuda_kernel_launch(kernel, ggml_cuda_kernel_launch_params(grid, dim3(WARP_SIZE, QMM_MMA_WARPS), smem, stream),
                            p.W, p.yq, p.yds, p.dst, p.nb, p.K, p.M, p.N, p.stride_col_dst, p.add, p.stride_col_add);
}

template <ggml_type type, int NT>
static void qmm_staged_tiles(const qmm_args & p, int rt, int device, cudaStream_t stream) {
    switch (rt) {
        case 1: qmm_staged_launch<type, NT, 1>(p, device, stream); break;
        case 2: qmm_staged_launch<type, NT, 2>(p, device, stream); break;
        default: GGML_ABORT("ggml_qmatmul: staged row_tiles %d", rt);
    }
}

// W * X with the activations in the staged layout (p.yq: yqh, p.npad = 8 nt), nt >= 2 column tiles, rt 1 or 2
// row tiles. Instantiated by qmatmul_mma_<type>.cu.
template <ggml_type type>
void qmm_staged_run(const qmm_args & p, int nt, int rt, int device, cudaStream_t stream) {
    GGML_ASSERT(p.K % QMM_UNIT == 0 && p.npad == 8 * nt);
    switch (nt) {
        case 2: qmm_staged_tiles<type, 2>(p, rt, device, stream); break;
        case 3: qmm_staged_tiles<type, 3>(p, rt, device, stream); break;
        case 4: qmm_staged_tiles<type, 4>(p, rt, device, stream); break;
        case 5: qmm_staged_tiles<type, 5>(p, rt, device, stream); break;
        case 6: qmm_staged_tiles<type, 6>(p, rt, device, stream); break;
        default: GGML_ABORT("ggml_qmatmul: staged with %d column tiles", nt);
    }
}
