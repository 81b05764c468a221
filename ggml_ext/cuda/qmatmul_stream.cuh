// ggml_qmatmul for one column (Q4_K, Q5_K, Q6_K) on Hopper: a matrix-vector kernel that streams the weights
// through shared memory with the TMA (bulk async copies) and gives the very bits of the tensor-core kernel
// (qmatmul_mma.cuh), so that decoding a token and verifying it among 23 agree to the bit.
//
// The same bits: the MMA kernel's warp w (of QMM_MMA_WARPS = 8) adds, per output row, the groups of the K units
// (super-blocks) w, w + 8, ... in K order, acc = fma(d*sc * dx, (float) sumi, acc) (Q4_K/Q5_K then
// acc = fma(-dmin*m, sx, acc)), and the eight partial sums are added in warp order. Only the float chain has an
// order; each group's integer sum is exact however it is formed. Here thread (r, w) of a CUDA block runs that
// chain for row r and K slot w, and the eight slot sums of a row are added in slot order by shuffles.
//
// The speed: a one-column product is a stream of weight bytes. ggml's mul_mat_vec_q and our earlier vector
// kernels read them straight into registers and reach 40-56% of the H100's read bandwidth (docs/benchmarks.md).
// Here each warp owns a contiguous range of 4-row groups (lane = 8 r + slot) and runs its own ring of STAGES
// shared-memory buffers, each a row group times a chunk of K units: one lane per row asks the TMA for its row's
// chunk (one instruction, completion counted on the buffer's mbarrier) STAGES - 1 items ahead of the one computed.
// A warp waits only on its own copies; the CUDA block's warps share one copy of the column's activations, put in
// shared memory at the start. (A ring per block, synchronised by block barriers, kept fewer warps per SM on a
// long-K product for the same shared memory: Q6_K ffn_down 41 us against 35, docs/benchmarks.md.)

#pragma once

#include "qmatmul_mma.cuh"

#include <unordered_map>

#define QMS_SLOTS   QMM_MMA_WARPS   // K slots: the MMA kernel's warps
#define QMS_Y_PITCH (QMM_UNIT + 16) // bytes per activation unit in shared memory (no bank conflicts across slots)
#define QMS_D_PITCH 10              // float2 per activation unit's scales (8 used; 80 bytes: conflict-free)

// --- TMA and mbarrier (sm_90) -----------------------------------------------------------------------------------

static __device__ __forceinline__ uint32_t qms_smem_addr(const void * p) {
    return (uint32_t) __cvta_generic_to_shared(p);
}

static __device__ __forceinline__ void qms_bar_init(uint64_t * bar) {
#if __CUDA_ARCH__ >= 900
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" : : "r"(qms_smem_addr(bar)));
    asm volatile("fence.mbarrier_init.release.cluster;" : : : "memory");
#else
    GGML_UNUSED(bar);
    NO_DEVICE_CODE;
#endif
}

// the one arrival of this phase, announcing `bytes` to come from bulk copies
static __device__ __forceinline__ void qms_bar_expect(uint64_t * bar, int bytes) {
#if __CUDA_ARCH__ >= 900
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" : : "r"(qms_smem_addr(bar)), "r"(bytes)
                 : "memory");
#else
    GGML_UNUSED_VARS(bar, bytes);
    NO_DEVICE_CODE;
#endif
}

static __device__ __forceinline__ void qms_bar_wait(uint64_t * bar, int parity) {
#if __CUDA_ARCH__ >= 900
    asm volatile("{\n\t.reg .pred done;\n"
                 "QMS_WAIT_%=:\n\t"
                 "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n\t"
                 "@!done bra QMS_WAIT_%=;\n}"
                 : : "r"(qms_smem_addr(bar)), "r"(parity) : "memory");
#else
    GGML_UNUSED_VARS(bar, parity);
    NO_DEVICE_CODE;
#endif
}

// bytes (a multiple of 16; both addresses 16-byte aligned) from global to shared memory, counted on bar
static __device__ __forceinline__ void qms_bulk_copy(void * smem, const void * gmem, int bytes, uint64_t * bar) {
#if __CUDA_ARCH__ >= 900
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 : : "r"(qms_smem_addr(smem)), "l"(gmem), "r"(bytes), "r"(qms_smem_addr(bar)) : "memory");
#else
    GGML_UNUSED_VARS(smem, gmem, bytes, bar);
    NO_DEVICE_CODE;
#endif
}

// Warp 0 asks the TMA for rows [row0, row0 + n_rows) of W (rows past M are skipped), units [u0, u0 + nu), into
// buf: local row i at i * pitch, its bytes from the 16-byte boundary at or before its first byte (Q6_K rows start
// at 8-byte ones); the weights' last bytes past the last 16-byte boundary are copied by hand. Completion is
// counted on bar (one arrival: lane 0's, with the byte count).
static __device__ __forceinline__ void qms_ask(const char * W, int64_t row_bytes, int M, int bs, int row0, int n_rows,
                                               int u0, int nu, char * buf, int pitch, uint64_t * bar) {
    const int lane = threadIdx.x % WARP_SIZE;
    const int64_t total = row_bytes * M;
    auto span = [&](int i, int64_t & a0, int & bytes, int64_t & tail) {   // local row i's copy
        const int64_t start = (int64_t) (row0 + i) * row_bytes + (int64_t) u0 * bs;
        a0 = start & ~(int64_t) 15;
        const int64_t end = min((start + (int64_t) nu * bs + 15) & ~(int64_t) 15, total);
        bytes = (int) ((end - a0) & ~(int64_t) 15);
        tail  = end - a0 - bytes;
    };
    const int n = min(n_rows, M - row0);
    int sum = 0;
    for (int i = lane; i < n; i += WARP_SIZE) {
        int64_t a0, tail;
        int bytes;
        span(i, a0, bytes, tail);
        sum += bytes;
    }
#pragma unroll
    for (int o = WARP_SIZE / 2; o > 0; o /= 2) {
        sum += __shfl_xor_sync(0xffffffff, sum, o);
    }
    if (lane == 0) {
        qms_bar_expect(bar, sum);
    }
    __syncwarp();
    for (int i = lane; i < n; i += WARP_SIZE) {
        int64_t a0, tail;
        int bytes;
        span(i, a0, bytes, tail);
        if (bytes > 0) {
            qms_bulk_copy(buf + i * pitch, W + a0, bytes, bar);
        }
        for (int64_t j = 0; j < tail; ++j) {
            buf[i * pitch + bytes + j] = W[a0 + bytes + j];
        }
    }
}

// Where local row i's unit u0 starts in a stage buffer
static __device__ __forceinline__ int qms_row_offset(int64_t row, int64_t row_bytes, int u0, int bs) {
    return (int) ((row * row_bytes + (int64_t) u0 * bs) & 15);
}

// --- One K unit of one row: the chain --------------------------------------------------------------------------

template <ggml_type type> struct qms_block_bytes;
template <> struct qms_block_bytes<GGML_TYPE_Q4_K> { static constexpr int value = sizeof(block_q4_K); };
template <> struct qms_block_bytes<GGML_TYPE_Q5_K> { static constexpr int value = sizeof(block_q5_K); };
template <> struct qms_block_bytes<GGML_TYPE_Q6_K> { static constexpr int value = sizeof(block_q6_K); };

// NW consecutive 4-byte words of shared memory from a 2-byte aligned address (Q6_K blocks are 210 bytes): the
// aligned words around them, shifted by the misalignment (a shift of 0 gives the word itself)
template <int NW> static __device__ __forceinline__ void qms_words(const char * p, int (&w)[NW]) {
    const int * a = (const int *) ((uintptr_t) p & ~(uintptr_t) 3);
    const int sh = 8 * (int) ((uintptr_t) p & 3);
    int lo = a[0];
#pragma unroll
    for (int i = 0; i < NW; ++i) {
        const int hi = a[i + 1];
        w[i] = (int) __funnelshift_r((unsigned) lo, (unsigned) hi, sh);
        lo = hi;
    }
}

static __device__ __forceinline__ void qms_words4(const uint4 v, int (&w)[4]) {
    w[0] = (int) v.x; w[1] = (int) v.y; w[2] = (int) v.z; w[3] = (int) v.w;
}

// b: the unit's bytes in shared memory; y: its 256 activations; d: its 8 activation blocks' (d, d * sum q)
template <ggml_type type> struct qms_unit;

template <bool HIGH> static __device__ __forceinline__ void qms_unit_k45(const char * b, const int8_t * y,
                                                                       const float2 * d, float & acc) {
    constexpr int qs_off = HIGH ? 48 : 16;
    const qmm_k4_scales k4 = qmm_k4_unpack(*(const uint4 *) b);
    int qh[8] = {};
    if (HIGH) {
        qms_words4(*(const uint4 *) (b + 16), *(int (*)[4]) &qh[0]);
        qms_words4(*(const uint4 *) (b + 32), *(int (*)[4]) &qh[4]);
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) {   // sub-blocks 2j (low nibbles of qs bytes 32j..32j+31) and 2j + 1 (high)
        int q[8], y0[8], y1[8];
        qms_words4(*(const uint4 *) (b + qs_off + 32 * j), *(int (*)[4]) &q[0]);
        qms_words4(*(const uint4 *) (b + qs_off + 32 * j + 16), *(int (*)[4]) &q[4]);
        qms_words4(*(const uint4 *) (y + 64 * j), *(int (*)[4]) &y0[0]);
        qms_words4(*(const uint4 *) (y + 64 * j + 16), *(int (*)[4]) &y0[4]);
        qms_words4(*(const uint4 *) (y + 64 * j + 32), *(int (*)[4]) &y1[0]);
        qms_words4(*(const uint4 *) (y + 64 * j + 48), *(int (*)[4]) &y1[4]);
        int s0 = QMM_MAGIC, s1 = QMM_MAGIC;   // integer sums are exact in any order (qmm_magic_f)
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            int lo = q[k] & 0x0F0F0F0F, hi = (q[k] >> 4) & 0x0F0F0F0F;
            if (HIGH) {   // bit s of qh byte l is the fifth bit of value 32 s + l
                lo |= ((qh[k] >> (2 * j)) & 0x01010101) << 4;
                hi |= ((qh[k] >> (2 * j + 1)) & 0x01010101) << 4;
            }
            s0 = ggml_cuda_dp4a(lo, y0[k], s0);
            s1 = ggml_cuda_dp4a(hi, y1[k], s1);
        }
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const int s = 2 * j + e;
            float dsc, dm;
            qmm_k4_scale_min(k4, s, dsc, dm);
            const float2 ds = d[s];
            acc = __fmaf_rn(__fmul_rn(dsc, ds.x), qmm_magic_f(e ? s1 : s0), acc);
            acc = __fmaf_rn(-dm, ds.y, acc);
        }
    }
}

template <> struct qms_unit<GGML_TYPE_Q4_K> {
    static __device__ __forceinline__ void run(const char * b, const int8_t * y, const float2 * d, float & acc) {
        qms_unit_k45<false>(b, y, d, acc);
    }
};

template <> struct qms_unit<GGML_TYPE_Q5_K> {
    static __device__ __forceinline__ void run(const char * b, const int8_t * y, const float2 * d, float & acc) {
        qms_unit_k45<true>(b, y, d, acc);
    }
};

// Q6_K: group G = 8 hh + 2 j + e holds values 128 hh + 32 j + 16 e + (0..15): ql bytes 64 hh + 32 (j % 2) + 16 e
// + (0..15), nibble j / 2; qh bytes 32 hh + 16 e + (0..15), bits 2 j; scale byte G; activation block 8u + G / 2.
// The integer sum of a group, sum (q - 32) y, is formed as sum q y - 32 sum y (both exact). (Reading sum y from
// shared memory, formed once per block, was no faster: docs/benchmarks.md.)
template <> struct qms_unit<GGML_TYPE_Q6_K> {
    static __device__ __forceinline__ void run(const char * b, const int8_t * y, const float2 * d, float & acc) {
        int sc[4];   // the scale bytes plus 128 (qmm_sbyte_f)
        qms_words(b + 192, sc);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            sc[i] ^= 0x80808080;
        }
        const float dw = __half2float(*(const half *) (b + 208));
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            int ql[2][2][4], qh[2][4];   // [j % 2][e], [e]: each word serves two or four groups
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                qms_words(b + 128 + 32 * hh + 16 * e, qh[e]);
                qms_words(b + 64 * hh + 16 * e, ql[0][e]);
                qms_words(b + 64 * hh + 32 + 16 * e, ql[1][e]);
            }
#pragma unroll
            for (int jj = 0; jj < 8; ++jj) {   // groups G = 8 hh + jj in order
                const int j = jj / 2, e = jj % 2, G = 8 * hh + jj;
                int yw[4];
                qms_words4(*(const uint4 *) (y + 16 * G), yw);
                int sq = QMM_MAGIC, sy = 0;
#pragma unroll
                for (int k = 0; k < 4; ++k) {
                    const int lo = (ql[j % 2][e][k] >> (4 * (j / 2))) & 0x0F0F0F0F;
                    const int hi = ((qh[e][k] >> (2 * j)) & 0x03030303) << 4;
                    sq = ggml_cuda_dp4a(lo | hi, yw[k], sq);
                    sy = ggml_cuda_dp4a(0x01010101, yw[k], sy);
                }
                const float dsc = __fmul_rn(dw, qmm_sbyte_f(sc[G / 4], G % 4));
                acc = __fmaf_rn(__fmul_rn(dsc, d[G / 2].x), qmm_magic_f(sq - 32 * sy), acc);
            }
        }
    }
};

// --- The kernel -------------------------------------------------------------------------------------------------

struct qms_args {
    const char * W;
    const int8_t * yq;      // column 0 of the quantised activations (K int8)
    const float2 * yds;     // their scales, [K / 32][npad]
    float * dst;
    int nb, M, npad;
    int chunk;              // K units per stage, a multiple of QMS_SLOTS
    int pitch;              // shared-memory bytes per weight row of a stage, a multiple of 16
    const float * add = nullptr;   // ggml_qmatmul_fused's added column [M]
};

// One CUDA block: NW warps, each with its own ring of STAGES buffers and its own range of the 4-row groups (thread
// (r, w) of a warp: row r of the group, K slot w), sharing the column's activations. Dynamic shared memory: the NW
// rings, then K's activations and scales.
#define QMS_WARP_ROWS (WARP_SIZE / QMS_SLOTS)

template <ggml_type type, int NW, int STAGES>
static __global__ void __launch_bounds__(WARP_SIZE * NW)
qms_gemv(const qms_args p) {
    constexpr int bs = qms_block_bytes<type>::value;
    constexpr int R  = QMS_WARP_ROWS;
    extern __shared__ __align__(128) char qms_smem[];
    __shared__ uint64_t bars[NW][STAGES];

    const int tid = threadIdx.x, warp = tid / WARP_SIZE, lane = tid % WARP_SIZE;
    const int n_units  = p.nb;
    const int n_chunks = (n_units + p.chunk - 1) / p.chunk;
    const int64_t row_bytes = (int64_t) p.nb * bs;
    const int n_groups = (p.M + R - 1) / R;
    const int64_t gw = (int64_t) blockIdx.x * NW + warp, n_warps = (int64_t) gridDim.x * NW;
    const int g0 = (int) (gw * n_groups / n_warps);
    const int g1 = (int) ((gw + 1) * n_groups / n_warps);
    const int n_items = (g1 - g0) * n_chunks;
    const int stage_bytes = R * p.pitch;
    char * const ring = qms_smem + warp * STAGES * stage_bytes;
    uint64_t * const bar = bars[warp];
    int8_t * const ys = (int8_t *) (qms_smem + NW * STAGES * stage_bytes);
    float2 * const ds = (float2 *) (ys + n_units * QMS_Y_PITCH);

    if (lane < STAGES) {
        qms_bar_init(&bar[lane]);
    }
    __syncwarp();

    int ig = g0, ic = 0;   // the next item to ask for (item k: group g0 + k / n_chunks, chunk k % n_chunks)
    auto issue = [&](int k) {
        const int u0 = p.chunk * ic;
        qms_ask(p.W, row_bytes, p.M, bs, ig * R, R, u0, min(p.chunk, n_units - u0), ring + (k % STAGES) * stage_bytes,
                p.pitch, &bar[k % STAGES]);
        if (++ic == n_chunks) {
            ic = 0;
            ++ig;
        }
    };
    for (int k = 0; k < min(STAGES - 1, n_items); ++k) {   // the weights do not depend on the previous kernel
        issue(k);
    }
    ggml_cuda_pdl_sync();
    for (int i = tid; i < n_units * (QMM_UNIT / 16); i += WARP_SIZE * NW) {
        const int u = i / (QMM_UNIT / 16), o = 16 * (i % (QMM_UNIT / 16));
        *(int4 *) (ys + u * QMS_Y_PITCH + o) = *(const int4 *) (p.yq + u * QMM_UNIT + o);
    }
    for (int i = tid; i < n_units * (QMM_UNIT / QK8_1); i += WARP_SIZE * NW) {
        const int u = i / (QMM_UNIT / QK8_1), s = i % (QMM_UNIT / QK8_1);
        ds[u * QMS_D_PITCH + s] = p.yds[(int64_t) i * p.npad];
    }
    __syncthreads();

    const int r = lane / QMS_SLOTS, slot = lane % QMS_SLOTS;
    int g = g0, c = 0;
    float acc = 0.0f;
    for (int i = 0; i < n_items; ++i) {
        qms_bar_wait(&bar[i % STAGES], (i / STAGES) & 1);
        __syncwarp();   // (item i - 1's buffer is free for item i + STAGES - 1)
        if (i + STAGES - 1 < n_items) {
            issue(i + STAGES - 1);
        }
        const int row = g * R + r;
        const int u0 = p.chunk * c, nu = min(p.chunk, n_units - u0);
        if (row < p.M) {
            const char * b = ring + (i % STAGES) * stage_bytes + r * p.pitch + qms_row_offset(row, row_bytes, u0, bs);
            for (int j = slot; j < nu; j += QMS_SLOTS) {   // u0 is a multiple of 8: unit u0 + j is slot j % 8's
                const int u = u0 + j;
                qms_unit<type>::run(b + j * bs, ys + u * QMS_Y_PITCH, ds + u * QMS_D_PITCH, acc);
            }
        }
        if (++c == n_chunks) {   // the row's 8 slot sums (8 neighbouring lanes) in slot order
            float sum = __shfl_sync(0xffffffff, acc, 0, QMS_SLOTS);
#pragma unroll
            for (int w = 1; w < QMS_SLOTS; ++w) {
                sum = __fadd_rn(sum, __shfl_sync(0xffffffff, acc, w, QMS_SLOTS));
            }
            if (slot == 0 && row < p.M) {
                p.dst[row] = p.add != nullptr ? __fadd_rn(sum, p.add[row]) : sum;
            }
            acc = 0.0f;
            c = 0;
            ++g;
        }
    }
}

// shared memory of a CUDA block
template <int NW, int STAGES> static size_t qms_smem_bytes(const qms_args & p) {
    return (size_t) NW * STAGES * QMS_WARP_ROWS * p.pitch + (size_t) p.nb * (QMS_Y_PITCH + QMS_D_PITCH * sizeof(float2));
}

// bytes per row of a stage: a chunk of units rounded out to 16-byte boundaries, and the 4 bytes qms_words may
// read past its end
template <ggml_type type> static int qms_pitch(int chunk) {
    return (chunk * qms_block_bytes<type>::value + 15 + 4 + 15) / 16 * 16;
}

// The shape ggml_qmatmul runs, from the H100 sweep of tools/qmm_lab.cu (docs/benchmarks.md, "A ring per warp"):
// 6 warps a block, 2 stages a warp, 8 units (one per slot) a stage.
#define QMS_RUN_WARPS  6
#define QMS_RUN_STAGES 2
#define QMS_RUN_CHUNK  8

// shared memory qms_run needs for K (too much for a very long row: then the caller takes the MMA kernel)
template <ggml_type type> static size_t qms_run_smem(int K) {
    qms_args p = {};
    p.nb    = K / QK_K;
    p.pitch = qms_pitch<type>(QMS_RUN_CHUNK);
    return qms_smem_bytes<QMS_RUN_WARPS, QMS_RUN_STAGES>(p);
}

// W * x for one column on a Hopper GPU (p as for qmm_mma_run, N = 1). Instantiated by qmatmul_mma_<type>.cu.
template <ggml_type type>
void qms_run(const qmm_args & m, int device, cudaStream_t stream) {
    constexpr auto kernel = qms_gemv<type, QMS_RUN_WARPS, QMS_RUN_STAGES>;
    constexpr int threads = WARP_SIZE * QMS_RUN_WARPS;
    const qms_args p = {m.W, m.yq, m.yds, m.dst, m.nb, m.M, m.npad, QMS_RUN_CHUNK, qms_pitch<type>(QMS_RUN_CHUNK), m.add};
    const size_t smem = qms_smem_bytes<QMS_RUN_WARPS, QMS_RUN_STAGES>(p);
    ggml_ext_cuda_allow_smem<kernel>(smem, device);
    // persistent: as many CUDA blocks as fit at once, each warp taking a contiguous range of the row groups (asked
    // of the runtime once per device and shared-memory size: without CUDA graphs this runs for every product)
    static std::unordered_map<size_t, int> blocks_per_sm[GGML_CUDA_MAX_DEVICES];
    auto known = blocks_per_sm[device].find(smem);
    if (known == blocks_per_sm[device].end()) {
        int n = 0;
        CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, threads, smem));
        known = blocks_per_sm[device].emplace(smem, n).first;
    }
    const int per_sm = known->second;
    const int n_groups = (m.M + QMS_WARP_ROWS - 1) / QMS_WARP_ROWS;
    const int grid = std::min((n_groups + QMS_RUN_WARPS - 1) / QMS_RUN_WARPS,
                              std::max(per_sm, 1) * ggml_cuda_info().devices[device].nsm);
    ggml_cuda_kernel_launch(kernel, ggml_cuda_kernel_launch_params(dim3(grid), dim3(threads), smem, stream), p);
}
