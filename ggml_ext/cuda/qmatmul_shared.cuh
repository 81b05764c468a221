// ggml_qmatmul's f16 kernel (Hopper, Q4_K and Q6_K, and BF16 in bf16; row_tiles GGML_EXT_QMATMUL_F16): the f16
// arithmetic of qmatmul_half.cuh fed from a ring of shared-memory stages that hold both a stage's weights and its
// activations, shared by all the warps of a CUDA block, the work cut "stream-K" over a fixed set of blocks.
//
// Why (docs/benchmarks.md, "An f16 kernel for verify"): in qmm_mma and its staged form the 8 warps of a CUDA block
// split K, so every warp reads its units' activations for itself and every CUDA block (16 RT rows) all of K's: at
// 23 columns and 34,816 rows ~170 MB from L2 beside 100 MB of weights from DRAM; and their int8 arithmetic ends
// every 32-value group in float work per output, which grows with the column count. Here the warps split the rows
// (a CUDA block: NW x 16 rows), each stage of K comes into shared memory once for all of them, and the
// per-column work is the MMA alone.
//
// The work: T row tiles (of a block's rows) times S stages of K (U 256-value units each, the last what is left) are
// T * S items in tile-major order; CUDA block p of P runs items [p T S / P, (p + 1) T S / P), so every block gets
// the same share (no tail wave: P is as many blocks as the SMs hold at once). A block's run of items within one tile
// is a segment; a tile cut into several segments is finished by the block holding its first segment (the one that
// ends its run there, while the others start theirs with the tile): the other segments' partial sums, from a
// workspace, added to its own in segment (K) order. Every output is thus an f32 MMA chain over K units in order
// within each segment, then the segments' sums in order: the cut depends on M, K, P and the type's block shape only,
// so a column's bits do not depend on N. (They are not the int8 kernels' bits: decode and verify agree only if both
// take this kernel.)
//
// Stages: each warp copies its own rows of a stage with cp.async (16 bytes a lane), and starts the next copy into a
// stage as soon as it is done with it; the activations of a stage (one bulk copy, counted on the stage's mbarrier)
// are refilled by the last warp to finish with it. A row's unit is copied from the 16-byte boundary at or before
// its first byte (Q6_K's 210-byte units start at any even byte), so it sits in shared memory at that offset.

#pragma once

#include "qmatmul_stream.cuh"
#include "qmatmul_half.cuh"
#include "qmatmul_wgmma.cuh"
#include "unary.cuh"

#include <type_traits>

// x gating up (ggml_qmatmul_fused, ggml_qmatmul_sigmoid_gated, the GLU form below) by ggml-cuda's own expressions:
// its silu or sigmoid of x times up, as its gated-op kernels compute them (the same bits)
static __device__ __forceinline__ float qmm_gated(float x, float up, int gate) {
    const float act = gate == GGML_EXT_QMATMUL_GATE_SIGMOID ? 1.0f / (1.0f + expf(-x)) : ggml_cuda_op_silu_single(x);
    return act * up;
}

// A weight type's K unit: its bytes; and the 16-byte chunks a row's U units are copied in (from the boundary at or
// before their first byte: Q4_K rows and units start at 16-byte boundaries, Q6_K's at even bytes)
template <ggml_type type> struct qmh_type;
template <> struct qmh_type<GGML_TYPE_Q4_K> {
    static constexpr int bytes = sizeof(block_q4_K);
    static constexpr bool aligned = true;
};
template <> struct qmh_type<GGML_TYPE_Q6_K> {
    static constexpr int bytes = sizeof(block_q6_K);
    static constexpr bool aligned = false;
};
template <> struct qmh_type<GGML_TYPE_BF16> {   // 256 values of a row (K a multiple of 256: rows 16-byte aligned)
    static constexpr int bytes = QMM_UNIT * 2;
    static constexpr bool aligned = true;
};

template <ggml_type type> __host__ __device__ constexpr int qmh_chunks(int U) {
    return (U * qmh_type<type>::bytes + (qmh_type<type>::aligned ? 0 : 14) + 15) / 16;
}

// Shared-memory bytes per weight row of a stage (U units): its chunks, rounded up to a multiple of 16 whose word
// count is 8 or 24 modulo 32 (the 8-byte loads of a warp's 4 row groups then hit distinct banks)
template <ggml_type type> __host__ __device__ constexpr int qmh_pitch(int U) {
    int p = 16 * qmh_chunks<type>(U);
    while ((p / 4) % 32 != 8 && (p / 4) % 32 != 24) {
        p += 16;
    }
    return p;
}

// Bytes of one K unit's activations for npad columns (qmatmul_half.cuh)
__host__ __device__ constexpr int qmh_act_bytes(int npad) {
    return npad * QMH_HALF_PITCH * (int) sizeof(half);
}

// QMH_TRACE (tools/qmm_lab.cu only): each CUDA block's global times (QMH_TRACE_EVENTS: entry, first copies asked,
// first stage's weights in, its activations in, last item computed, exit; and in a cut tile's hand-off a later
// segment's count, the finisher's count seen and its sums added), for where a call's time goes
#ifdef QMH_TRACE
#define QMH_TRACE_EVENTS 9
static __device__ unsigned long long qmh_trace[QMH_TRACE_EVENTS * 1024];
#define QMH_TRACE_AT(i) do { if (threadIdx.x == 0 && threadIdx.y == 0) { unsigned long long t_; \
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t_)); qmh_trace[QMH_TRACE_EVENTS * blockIdx.x + (i)] = t_; } } while (0)
// ... and each warp's last item done (up to 16 warps a block)
static __device__ unsigned long long qmh_trace_warp[16 * 1024];
#define QMH_TRACE_WARP_DONE() do { if (threadIdx.x == 0) { unsigned long long t_; \
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t_)); qmh_trace_warp[16 * blockIdx.x + threadIdx.y] = t_; } } while (0)
#else
#define QMH_TRACE_AT(i) do { } while (0)
#define QMH_TRACE_WARP_DONE() do { } while (0)
#endif

struct qmh_args {
    const char * W;
    const half * x;         // the activations, ggml-ext.h's prepared layout: [K / 256][npad QMH_HALF_PITCH]
    float * dst;
    int nb, K, M, N, npad, stride_col_dst;
    const float * add;      // ggml_qmatmul_fused's added tensor, or null
    int stride_col_add;
    float * ws;             // partial sums: qmh_ws_floats
    bool early_launch;      // let the next kernel launch once every block has computed its items
    half * glu_out;         // the GLU form (qmm_half_shared): silu(gate) * up, prepared; else null
    int F;                  // the GLU form: gate rows 0..F-1, up rows F..2F-1 (M = 2F)
    bool glu_sums;          // the GLU form: the run sums written (else zeros: a Q6_K reader never reads them)
};

// Segments counted per row tile: zero between calls (each tile's finisher puts its count back). One array per
// device and translation unit; calls of this kernel on one device must not overlap: ggml runs a graph's nodes in
// order on one stream, and a call launched early (programmatic dependent launch) touches the counters only after
// ggml_cuda_pdl_sync, when the kernel before it, and so every earlier one, has ended.
#define QMH_MAX_TILES 8192
static __device__ int qmh_counters[QMH_MAX_TILES];

template <int NT, int RT, int NW> struct qmh_shape {
    static constexpr int warp_rows = QMM_MMA_ROWS * RT;           // RT 16-row tiles per warp
    static constexpr int rows      = NW * warp_rows;              // per CUDA block
    static constexpr int frag      = NW * RT * NT * 4 * WARP_SIZE;// floats of a block's partial sums
};

// The item range of CUDA block p, and which block holds item j (in 32 bits where they fit: a block's first steps)
static __device__ __forceinline__ int64_t qmh_first_item(int64_t p, int64_t items, int P) {
    if ((uint64_t) p * (uint64_t) items < (1ull << 32)) {
        return (uint32_t) p * (uint32_t) items / (uint32_t) P;
    }
    return p * items / P;
}

static __device__ __forceinline__ int qmh_block_of(int64_t j, int64_t items, int P) {
    return (int) (((j + 1) * P - 1) / items);
}

// A cut tile's hand-off between blocks: a later segment's block stores its partial sums, meets its own barrier,
// and one thread counts with release semantics (its fence orders the whole block's stores, which the barrier put
// before it); the finishing block's one thread waits for the count with acquire loads, then its barrier lets every
// thread read the sums. (Was a __threadfence by every thread on both sides: 0.5-1 us a call on the H100's small
// matrices, docs/benchmarks.md, thirty-second session.)
static __device__ __forceinline__ void qmh_count_release(int * counter) {
    asm volatile("fence.acq_rel.gpu;\n\tred.relaxed.gpu.global.add.s32 [%0], 1;" : : "l"(counter) : "memory");
}

static __device__ __forceinline__ int qmh_load_acquire(const int * counter) {
    int v;
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(counter) : "memory");
    return v;
}

static __device__ __forceinline__ void qmh_cp16(char * smem, const char * gmem) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" : : "r"(qms_smem_addr(smem)), "l"(gmem) : "memory");
}

// NW warps of RT 16-row tiles each, a ring of STAGES stages of U K units (a row tile's last stage: what is left of
// K), MINB CUDA blocks per SM (the grid: at most MINB per SM, qmh_grid_of). K: a multiple of 256.
//
// GLU (ggml_qmatmul_swiglu_prepared; Q4_K): W's rows are F gate rows, then F up rows, and a warp's 16-row tile takes 8
// pairs: rows g of the MMA tile are gate rows, rows g + 8 the up rows of the same index, so that the thread storing
// an output holds both; a block's tile is NW * 8 pairs (a multiple of 32, F too: a run of 32 pairs, whose sum the
// prepared layout holds, is four warps of one block). The tile's finisher writes silu(gate) * up rounded to f16 into
// p.glu_out (ggml-ext.h's prepared layout; the run sums where p.glu_sums) and no f32 outputs.
template <ggml_type type, int NT, int RT, int NW, int STAGES, int U, int MINB, bool GLU = false, bool WG = false>
static __global__ void __launch_bounds__(NW * WARP_SIZE, MINB)
qmm_half_shared(const qmh_args p) {
    using shape = qmh_shape<NT, RT, NW>;
    static_assert(!GLU || (type == GGML_TYPE_Q4_K && RT == 1 && NW % 4 == 0),
                  "the GLU form: Q4_K (16-byte aligned units), one 16-row tile a warp, whole runs of 32 pairs");
    constexpr int RW      = shape::warp_rows;
    constexpr int ub      = qmh_type<type>::bytes;     // bytes of a K unit in a row
    constexpr int pitch   = qmh_pitch<type>(U);
    constexpr int w_bytes = shape::rows * pitch;
    constexpr int CH      = qmh_chunks<type>(U);       // 16-byte chunks of a row's stage
    constexpr int KC      = (RW * CH + WARP_SIZE - 1) / WARP_SIZE;   // chunks per lane
    extern __shared__ __align__(128) char qmh_smem[];
    __shared__ uint64_t full[STAGES];   // a stage's activations have landed
    __shared__ int done[STAGES];        // warps done with a stage
    // the GLU form: a column tile's rounded values [warp][g][8 columns] (one tile at a time: at 6 column tiles the
    // stages leave ~11 KB of an H100 SM's shared memory)
    __shared__ float glu_vals[GLU ? NW * 8 * 8 : 1];
    QMH_TRACE_AT(0);

    const int lane = threadIdx.x, warp = threadIdx.y, t4 = lane % 4, g = lane / 4;
    const int units    = p.K / QMM_UNIT;               // per row
    const int n_stages = (units + U - 1) / U;          // per row tile
    auto stage_units = [&](int st) { return min(U, units - U * st); };
    const int n_tiles  = (p.M + shape::rows - 1) / shape::rows;
    const int items = n_tiles * n_stages;        // (< 2^31: at most QMH_MAX_TILES tiles)
    const int P = gridDim.x;
    const int j0 = (int) qmh_first_item(blockIdx.x, items, P), j1 = (int) qmh_first_item(blockIdx.x + 1, items, P);
    const int64_t row_bytes = (int64_t) p.nb * ub, total = row_bytes * p.M;
    const int unit_act_bytes = qmh_act_bytes(p.npad);
    const int stage_bytes    = w_bytes + U * unit_act_bytes;

    auto stage_of = [&](int j) { return (j - j0) % STAGES; };
    // where unit u of row `row` starts in W
    auto unit_at = [&](int row, int u) { return (int64_t) row * row_bytes + (int64_t) u * ub; };
    // the GLU form's W row at row lr of a block's tile (its 16-row MMA tile lr / 16, row lr % 16), or -1 past F
    auto glu_row = [&](int tile, int lr) {
        const int q = tile * (shape::rows / 2) + 8 * (lr / QMM_MMA_ROWS) + lr % 8;
        return q < p.F ? q + (lr % QMM_MMA_ROWS >= 8 ? p.F : 0) : -1;
    };
    // this warp's rows of the next item it has not asked for (one commit group per item, empty past the block's last
    // item; items are asked for in order, so a cursor, not a division, says which tile and stage); chunk i = lane +
    // 32 k of them is row i / CH's 16 bytes at 16 (i % CH) from its units' boundary (a warp's copy: ~500 contiguous
    // bytes of W; 16 rows x 32 bytes a copy was ~10% slower, docs/benchmarks.md, thirtieth session).
    int ask_j = j0, ask_tile = j0 / n_stages, ask_st = j0 % n_stages;
    // a warp's rows from its first: r row_bytes apart, or in the GLU form (8 gate rows, then the 8 up rows of the
    // same pairs) (r % 8) row_bytes, plus F row_bytes for r >= 8; the last one's offset, and whether every chunk's
    // offset from the first row's boundary fits in 32 bits (the copies' fast path)
    const int64_t last_off = GLU ? (int64_t) (p.F + 7) * row_bytes : (int64_t) (RW - 1) * row_bytes;
    const bool offsets_32 = last_off + 16 * CH + 16 <= INT32_MAX;
    auto ask_weights = [&]() {
        if (ask_j < j1) {
            const int ch = stage_units(ask_st) == U ? CH : qmh_chunks<type>(stage_units(ask_st));
            char * wstage = qmh_smem + stage_of(ask_j) * stage_bytes + warp * RW * pitch;
            // the warp's first row (the others at the offsets above from it)
            const int row0 = GLU ? ask_tile * (shape::rows / 2) + 8 * warp : ask_tile * shape::rows + warp * RW;
            const int64_t base = unit_at(row0, U * ask_st);
            // as a rule: a whole stage of rows all in the matrix, none near its end, offsets in 32 bits (a uniform test)
            if (ch == CH && (GLU ? row0 + 8 <= p.F : row0 + RW <= p.M) && offsets_32 &&
                (qmh_type<type>::aligned || base + last_off + 16 * CH <= total)) {
                const char * from = p.W + (base & ~(int64_t) 15);
                const uint32_t mis = (uint32_t) (base & 15), rb = (uint32_t) row_bytes;
                const uint32_t up = GLU ? (uint32_t) p.F * rb : 0u;
#pragma unroll
                for (int k = 0; k < KC; ++k) {
                    const int i = lane + WARP_SIZE * k, r = i / CH, c = i % CH;
                    if ((RW * CH) % WARP_SIZE == 0 || i < RW * CH) {
                        const uint32_t roff = GLU ? (r % 8) * rb + (r >= 8 ? up : 0u) : r * rb;
                        const uint32_t off  = (qmh_type<type>::aligned ? roff : (mis + roff) & ~15u) + 16 * c;
                        qmh_cp16(wstage + r * pitch + 16 * c, from + off);
                    }
                }
            } else {   // a row tile's short last stage, the matrix's last rows (its last bytes past a 16-byte boundary)
#pragma unroll
                for (int k = 0; k < KC; ++k) {
                    const int i = lane + WARP_SIZE * k, r = i / CH, c = i % CH;
                    const int row = GLU ? glu_row(ask_tile, warp * RW + r) : row0 + r;
                    if (i < RW * CH && (GLU ? row >= 0 : row < p.M) && c < ch) {
                        const int64_t at = (unit_at(row, U * ask_st) & ~(int64_t) 15) + 16 * c;
                        char * to = wstage + r * pitch + 16 * c;
                        if (qmh_type<type>::aligned || at + 16 <= total) {
                            qmh_cp16(to, p.W + at);
                        } else {
                            for (int64_t b = at; b < total; ++b) {
                                to[b - at] = p.W[b];
                            }
                        }
                    }
                }
            }
        }
        asm volatile("cp.async.commit_group;" : : : "memory");
        ++ask_j;
        if (++ask_st == n_stages) {
            ask_st = 0;
            ++ask_tile;
        }
    };
    // the activations of item j, stage st of its tile (one bulk copy by one thread; they come from the previous kernel)
    auto ask_acts = [&](int j, int st) {
        uint64_t * bar = &full[stage_of(j)];
        const int bytes = stage_units(st) * unit_act_bytes;
        qms_bar_expect(bar, bytes);
        qms_bulk_copy(qmh_smem + stage_of(j) * stage_bytes + w_bytes,
                      (const char *) p.x + (size_t) U * st * unit_act_bytes, bytes, bar);
    };
    // the first stage's weights at once (they do not depend on the previous kernel, nor on the barriers), then its
    // activations and the next stages': the copies a warp asks for are accepted at about the DRAM's pace, and the
    // activations asked for after every stage's weights landed ~1 us after the first stage's weights (H100 trace,
    // qmm_lab)
    ask_weights();
    QMH_TRACE_AT(1);
    if (lane == 0 && warp == 0) {
        for (int s = 0; s < STAGES; ++s) {
            qms_bar_init(&full[s]);
            done[s] = 0;
        }
    }
    __syncthreads();
    ggml_cuda_pdl_sync();
    int tile = j0 / n_stages, st = j0 % n_stages;   // the item computed next
    if (lane == 0 && warp == 0) {
        for (int j = j0, t = st; j < min(j0 + STAGES, j1); ++j, t = t + 1 == n_stages ? 0 : t + 1) {
            ask_acts(j, t);
        }
    }
    for (int s = 1; s < STAGES; ++s) {
        ask_weights();
    }

    float acc[RT][NT][4] = {};
    for (int j = j0; j < j1; ++j, st = st + 1 == n_stages ? 0 : st + 1, tile += st == 0) {
        const int s = stage_of(j);
        const char * stage = qmh_smem + s * stage_bytes;
        asm volatile("cp.async.wait_group %0;" : : "n"(STAGES - 1) : "memory");
        __syncwarp();   // the other lanes' copies of this warp's rows
        if (j == j0) {
            QMH_TRACE_AT(2);
        }
        qms_bar_wait(&full[s], (int) ((j - j0) / STAGES) & 1);
        if (j == j0) {
            QMH_TRACE_AT(3);
        }

        const char * rows[RT][2];   // this thread's rows' units in the stage
#pragma unroll
        for (int r = 0; r < RT; ++r) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int lr = warp * RW + QMM_MMA_ROWS * r + 8 * h + g;
                rows[r][h] = stage + lr * pitch;
                if (!qmh_type<type>::aligned) {
                    rows[r][h] += (int) (unit_at(tile * shape::rows + lr, U * st) & 15);
                }
            }
        }
#pragma unroll 1
        for (int uu = 0; uu < stage_units(st); ++uu) {
            const qmh_cols_half<NT> x = {(const half *) (stage + w_bytes + uu * unit_act_bytes)};
            if constexpr (WG) {   // Hopper's wgmma (qmatmul_wgmma.cuh; qmh_launch: QMH_WG_MIN_TILES)
                static_assert(type == GGML_TYPE_Q4_K && RT == 1 && NW % 4 == 0, "wgmma: Q4_K, whole warpgroups");
                const char * const r2[2] = {rows[0][0], rows[0][1]};
                qmh_unit_q4_k_wg<NT>(r2, qms_smem_addr(x.q), p.npad, t4, warp / 4, acc[0]);
            } else if constexpr (type == GGML_TYPE_Q4_K) {
                qmh_unit_q4_k<NT, RT>(rows, x, t4, acc);
            } else if constexpr (type == GGML_TYPE_Q6_K) {
                qmh_unit_q6_k<NT, RT>(rows, x, t4, acc);
            } else {
                qmh_unit_bf16<NT, RT>(rows, x, t4, acc);
            }
#pragma unroll
            for (int r = 0; r < RT; ++r) {
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    rows[r][h] += ub;
                }
            }
        }
        if (j == j1 - 1) {
            QMH_TRACE_AT(4);
            QMH_TRACE_WARP_DONE();
            if (p.early_launch) {
                ggml_cuda_pdl_lc();   // the next kernel's blocks may take their places (they wait for our end)
            }
        }
        // this warp is done with the stage: its own rows refill at once, the shared activations once every warp is
        // (by the last warp to finish)
        __syncwarp();
        ask_weights();   // item j + STAGES
        if (lane == 0) {
            __threadfence_block();
            if (atomicAdd(&done[s], 1) == NW - 1) {
                done[s] = 0;
                if (j + STAGES < j1) {
                    asm volatile("fence.proxy.async.shared::cta;" : : : "memory");   // our reads before the TMA's writes
                    int st_next = st + STAGES;
                    while (st_next >= n_stages) {
                        st_next -= n_stages;
                    }
                    ask_acts(j + STAGES, st_next);
                }
            }
        }

        if (st != n_stages - 1 && j != j1 - 1) {
            continue;
        }
        // the segment [first item of this tile in this block, j] is done
        const int t0 = tile * n_stages, t1 = t0 + n_stages;
        const int pb0 = qmh_block_of(t0, items, P), pb1 = qmh_block_of(t1 - 1, items, P);
        const int r0 = tile * shape::rows + warp * RW;
        // f(r, t, i) for each of this thread's accumulators (of column tiles c0 .. c1 - 1)
        auto each_output_in = [&](int c0, int c1, auto && f) {
#pragma unroll
            for (int r = 0; r < RT; ++r) {
#pragma unroll
                for (int t = c0; t < c1; ++t) {
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        f(r, t, i);
                    }
                }
            }
        };
        auto each_output = [&](auto && f) { each_output_in(0, NT, f); };
        // acc to dst (plus add's values, asked for before the first store: the compiler cannot tell add from dst,
        // so a load after each store was one L2 round trip per output, ~8 us a call on the 27B's residual products),
        // and acc zeroed; at most 16 values held at once (more spilled at 6 column tiles and 128 registers)
        auto store_acc = [&]() {
            constexpr int TC = RT * NT * 4 <= 16 ? NT : (NT + 1) / 2;   // column tiles a pass
            auto at_out = [&](int r, int t, int i, int & row, int & col) {
                row = r0 + QMM_MMA_ROWS * r + 8 * (i / 2) + g;
                col = 8 * t + 2 * t4 + i % 2;
                return row < p.M && col < p.N;
            };
#pragma unroll
            for (int c0 = 0; c0 < NT; c0 += TC) {
                const int c1 = min(c0 + TC, NT);
                float plus[RT][TC][4];
                if (p.add != nullptr) {
                    each_output_in(c0, c1, [&](int r, int t, int i) {
                        int row, col;
                        plus[r][t - c0][i] =
                            at_out(r, t, i, row, col) ? p.add[(size_t) col * p.stride_col_add + row] : 0.0f;
                    });
                }
                each_output_in(c0, c1, [&](int r, int t, int i) {
                    int row, col;
                    if (at_out(r, t, i, row, col)) {
                        p.dst[(size_t) col * p.stride_col_dst + row] =
                            p.add != nullptr ? __fadd_rn(acc[r][t][i], plus[r][t - c0][i]) : acc[r][t][i];
                    }
                    acc[r][t][i] = 0.0f;
                });
            }
        };
        // the GLU form's store: pair q = tile * (rows / 2) + 8 warp + g, columns 8 t + 2 t4 + e, its gate acc[0][t][e]
        // and up acc[0][t][2 + e]: qmm_gated's value rounded to f16 (what qmm_quantize_x makes of those f32 outputs),
        // and per run of 32 pairs the sum of the rounded values, in the order of qmm_quantize_block's butterfly over
        // lanes 0-31 = 8 (warp % 4) + g: first across the four warps (lane bits 4, then 3), then across g (bits 2,
        // 1, 0: lane bits 4, 3, 2 here); without p.glu_sums zeros in their place, and no block barriers. Every column of
        // npad is written: a padding column's values are zeros.
        auto store_glu = [&]() {
            const int q = tile * (shape::rows / 2) + 8 * warp + g;
            half * unit = p.glu_out + (size_t) (q / QMM_UNIT) * p.npad * QMH_HALF_PITCH;   // (ggml-ext.h's layout)
            const int v = q % QMM_UNIT, run = v / QK8_1;
            // this thread's column's run sum (and the zero beside it that wgmma's k slots 8-15 read), where the run's
            // first warp (lane g 0) writes it
            auto put_run_sum = [&](int col, float sum) {
                unit[GGML_EXT_QMATMUL_HALF_AT(QMM_UNIT + run, col, p.npad)] = __float2half_rn(sum);
                unit[GGML_EXT_QMATMUL_HALF_ZERO_AT(run, col, p.npad)] = __float2half_rn(0.0f);
            };
            const bool sums_here = warp % 4 == 0 && q - g < p.F;
            float * vals = glu_vals + (8 * warp + g) * 8;
#pragma unroll
            for (int t = 0; t < NT; ++t) {
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int col = 8 * t + 2 * t4 + e;
                    const half h = __float2half_rn(qmm_gated(acc[0][t][e], acc[0][t][2 + e], GGML_EXT_QMATMUL_GATE_SILU));
                    if (q < p.F) {
                        unit[GGML_EXT_QMATMUL_HALF_AT(v, col, p.npad)] = h;
                    }
                    if (p.glu_sums) {
                        vals[2 * t4 + e] = __half2float(h);
                    } else if (sums_here && g == 0) {
                        put_run_sum(col, 0.0f);
                    }
                    acc[0][t][e] = acc[0][t][2 + e] = 0.0f;
                }
                if (!p.glu_sums) {   // (uniform: no block barrier taken or skipped by a part of the block)
                    continue;
                }
                __syncthreads();
                if (sums_here) {   // the run's first warp sums it
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const int c = 2 * t4 + e;
                        float sum = __fadd_rn(__fadd_rn(vals[c], vals[2 * 64 + c]),
                                              __fadd_rn(vals[64 + c], vals[3 * 64 + c]));
                        sum += __shfl_xor_sync(0xFFFFFFFFu, sum, 16);
                        sum += __shfl_xor_sync(0xFFFFFFFFu, sum, 8);
                        sum += __shfl_xor_sync(0xFFFFFFFFu, sum, 4);
                        if (g == 0) {
                            put_run_sum(8 * t + c, sum);
                        }
                    }
                }
                __syncthreads();   // (the values read before the next column tile's are written)
            }
        };
        auto store = [&]() {
            if constexpr (GLU) {
                store_glu();
            } else {
                store_acc();
            }
        };
        if (pb0 == pb1) {   // the whole tile is this block's
            store();
            continue;
        }
        // a block's partial sums: those of the tile its run starts in, the only one where it can be a later segment
        // (a tile that starts before a block's first item is the tile of that item)
        auto slot = [&](int pb) -> float * { return p.ws + (size_t) pb * shape::frag; };
        auto at = [&](int r, int t, int i) { return (((warp * RT + r) * NT + t) * 4 + i) * WARP_SIZE + lane; };
        if (blockIdx.x != pb0) {   // a later segment: its sums for the tile's first block, counted
            float * mine = slot(blockIdx.x);
            each_output([&](int r, int t, int i) {
                mine[at(r, t, i)] = acc[r][t][i];
                acc[r][t][i] = 0.0f;
            });
            __syncthreads();
            if (lane == 0 && warp == 0) {
                qmh_count_release(&qmh_counters[tile]);
            }
            QMH_TRACE_AT(6);
            continue;
        }
        // the tile's first segment: this block finishes the tile. Its other segments start the runs of the blocks
        // after it (done early), while this one ends its run: wait for their count (at once, as a rule), then add
        // their sums to ours in segment (K) order. The loads of SEG segments are all asked for before the first of
        // their additions (one L2 round trip for them: a segment's loads, then its adds, was one trip each, ~0.5 us
        // a segment on the H100; output by output, a 5,120-row matrix cut over ~8 blocks a tile took ~40 us), SEG
        // as many as a thread's registers hold beside the rest (more spilled in the 16-warp LM head's whole run, which
        // was then 20% slower from 3 column tiles on; its tiles are cut in two at most).
        // The block never waits on a block that waits on it (waits point to later blocks only), and every block of
        // the grid is resident at once (qmh_grid: no more blocks than the SMs hold; earlier kernels end, and the
        // next one launches early only once all of ours are running).
        if (lane == 0 && warp == 0) {
            while (qmh_load_acquire(&qmh_counters[tile]) != pb1 - pb0) {
            }
            qmh_counters[tile] = 0;
        }
        __syncthreads();   // (the other segments' sums, stored before their blocks counted, are visible to all)
        QMH_TRACE_AT(7);
        constexpr int regs = 65536 / (NW * WARP_SIZE * MINB);   // a thread's registers (an H100 SM's 64 K)
        constexpr int fit = (regs >= 255 ? 48 : regs >= 168 ? 24 : 12) / (RT * NT * 4);   // segments' values
        constexpr int SEG = fit > 4 ? 4 : fit;
        if constexpr (SEG <= 1) {   // (each value added as it comes: no registers for a segment's values)
            for (int pb = pb0 + 1; pb <= pb1; ++pb) {
                const float * from = slot(pb);
                each_output([&](int r, int t, int i) { acc[r][t][i] = __fadd_rn(acc[r][t][i], __ldcg(from + at(r, t, i))); });
            }
        } else {
            for (int pb = pb0 + 1; pb <= pb1; pb += SEG) {
                float part[SEG][RT][NT][4];
#pragma unroll
                for (int k = 0; k < SEG; ++k) {
                    if (pb + k <= pb1) {
                        const float * from = slot(pb + k);
                        each_output([&](int r, int t, int i) { part[k][r][t][i] = __ldcg(from + at(r, t, i)); });
                    }
                }
#pragma unroll
                for (int k = 0; k < SEG; ++k) {
                    if (pb + k <= pb1) {
                        each_output([&](int r, int t, int i) { acc[r][t][i] = __fadd_rn(acc[r][t][i], part[k][r][t][i]); });
                    }
                }
            }
        }
        QMH_TRACE_AT(8);
        store();
    }
#ifdef QMH_TRACE
    __syncthreads();
    QMH_TRACE_AT(5);
#endif
}

// Shared memory of a CUDA block
template <ggml_type type, int NT, int RT, int NW, int STAGES, int U> constexpr size_t qmh_smem_bytes() {
    return (size_t) STAGES * (qmh_shape<NT, RT, NW>::rows * qmh_pitch<type>(U) + U * qmh_act_bytes(8 * NT));
}

// The shape ggml_qmatmul runs, from the H100 sweeps of tools/qmm_lab.cu (docs/benchmarks.md, "An f16 kernel for
// verify", "Fewer instructions around the f16 kernel's items" and the twentieth and twenty-first sessions): 2
// stages; Q4_K 2 K units a stage (a row's stage one 288-byte read; 16 warps of one unit were 1-18% slower), one block
// per SM, 12 warps (192-row tiles) for matrices of QMH_Q4_K_WIDE_ROWS rows or more (the FFN gate/up: 2-5% faster at
// 9-48 columns than 8), else 8; Q6_K one unit, 16 warps and one block per SM for matrices of QMH_Q6_K_NARROW_ROWS rows
// or more (the LM head), else 6 warps and two blocks per SM (the FFN down: 3-6% faster at 9-48 columns than 8 warps,
// 2-5% than 16 warps at one block); BF16 8 warps, one unit, one block per SM (two stages of 256 rows of 512-byte
// units would not fit). Chosen by type and M only: never by N.
#define QMH_RUN_RT     1
#define QMH_RUN_STAGES 2
#define QMH_Q4_K_WIDE_ROWS   24576
#define QMH_Q6_K_NARROW_ROWS 32768

template <ggml_type type> constexpr int qmh_run_units() {
    return type == GGML_TYPE_Q4_K ? 2 : 1;
}

template <int V> using qmh_int = std::integral_constant<int, V>;

// f(warps, blocks per SM) (as qmh_int constants) of the shape for M rows: the one place that maps type and M to it
template <ggml_type type, typename F> static auto qmh_with_shape(int M, F && f) {
    if constexpr (type == GGML_TYPE_Q6_K) {
        if (M < QMH_Q6_K_NARROW_ROWS) {
            return f(qmh_int<6>{}, qmh_int<2>{});
        }
        return f(qmh_int<16>{}, qmh_int<1>{});
    } else if constexpr (type == GGML_TYPE_Q4_K) {
        if (M >= QMH_Q4_K_WIDE_ROWS) {
            return f(qmh_int<12>{}, qmh_int<1>{});
        }
        return f(qmh_int<8>{}, qmh_int<1>{});
    } else {
        return f(qmh_int<8>{}, qmh_int<1>{});
    }
}

template <ggml_type type> static int qmh_run_warps(int M) {
    return qmh_with_shape<type>(M, [](auto nw, auto) { return decltype(nw)::value; });
}

// Row tiles of the f16 kernel for M rows (at most QMH_MAX_TILES)
template <ggml_type type> static int qmh_tiles(int M) {
    const int rows = QMM_MMA_ROWS * QMH_RUN_RT * qmh_run_warps<type>(M);
    return (M + rows - 1) / rows;
}

// Blocks of a shape that an SM holds at once (at most its MINB): the occupancy of its widest instantiation (6 column
// tiles, the most shared memory), so the same for every N. A cut tile's first block waits for the others' count
// (qmm_half_shared), so every block of a grid must be resident at once.
template <ggml_type type, int NW, int MINB, bool GLU> static int qmh_occupancy(int device) {
    constexpr int U = qmh_run_units<type>();
    constexpr auto kernel = qmm_half_shared<type, 6, QMH_RUN_RT, NW, QMH_RUN_STAGES, U, MINB, GLU>;
    constexpr size_t smem = qmh_smem_bytes<type, 6, QMH_RUN_RT, NW, QMH_RUN_STAGES, U>();
    static int blocks[GGML_CUDA_MAX_DEVICES] = {};
    if (blocks[device] == 0) {
        int n = 0;
        ggml_ext_cuda_allow_smem<kernel>(smem, device);   // (the occupancy query counts on it)
        CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, NW * WARP_SIZE, smem));
        GGML_ASSERT(n >= 1 && "ggml_qmatmul: the f16 kernel does not fit on an SM");
        blocks[device] = std::min(n, MINB);
    }
    return blocks[device];
}

template <ggml_type type, bool GLU = false> static int qmh_per_sm(int M, int device) {
    return qmh_with_shape<type>(M, [&](auto nw, auto minb) {
        return qmh_occupancy<type, decltype(nw)::value, decltype(minb)::value, GLU>(device);
    });
}

// CUDA blocks of its grid: the fewest that give no block more items than the SMs' worth of blocks would
// (qmh_per_sm: all resident at once), and every block at least QMH_MIN_BLOCK_ITEMS: a block's run starts with its
// pipeline's fill (~2.5 us to the first stage on the H100) and a cut tile ends with its fix-up, so on a small
// matrix one item a block is slower than two (lab, docs/benchmarks.md "twenty-seventh session": the attention's V,
// 1,024 Q6_K rows, 18.5 us at 23 columns on 220 blocks against 13.2 on 110), and on the GDN/attention output (480
// items) 120 blocks of 4 items beat 132 of 3-4. Depends on the shape and the GPU, never on N.
#define QMH_MIN_BLOCK_ITEMS 2

static int qmh_grid_of(int64_t items, int64_t slots) {   // (slots: the blocks the SMs hold at once)
    const int64_t per_block = std::max<int64_t>(QMH_MIN_BLOCK_ITEMS, (items + slots - 1) / slots);
    return (int) std::min<int64_t>(slots, (items + per_block - 1) / per_block);
}

template <ggml_type type> static int qmh_grid(int M, int K, int n_sm, int per_sm) {
    constexpr int U = qmh_run_units<type>();
    return qmh_grid_of((int64_t) qmh_tiles<type>(M) * ((K / QMM_UNIT + U - 1) / U), (int64_t) n_sm * per_sm);
}

// Workspace floats for nt column tiles and a grid of P blocks
template <ggml_type type> static size_t qmh_ws_floats(int nt, int P, int M) {
    return (size_t) P * qmh_run_warps<type>(M) * QMH_RUN_RT * nt * 4 * WARP_SIZE;
}

// Every column-tile count launches with the shared memory of the widest (6 column tiles), so that an SM holds no
// more of its blocks than qmh_occupancy planned the grid for. With fewer registers and less shared memory an SM could
// hold more: a call launched early (programmatic dependent launch) then put its blocks two to an SM beside the
// previous call's last ones, and ran ~40% slower on the SMs that held two while others idled (the 8-warp Q4_K shape
// at 1-16 columns, H100: GDN input 31.8 / 37.4 us at 2 / 16 columns against 24.2 / 26.2 without early launches;
// docs/benchmarks.md, thirty-first session). Checked once per instantiation and device.
template <ggml_type type, int NT, int NW, int MINB, bool GLU, bool WG> static void qmh_launch_as(const qmh_args & p,
                                                                                            int device, int P,
                                                                                            cudaStream_t stream) {
    constexpr int U = qmh_run_units<type>();
    constexpr auto kernel = qmm_half_shared<type, NT, QMH_RUN_RT, NW, QMH_RUN_STAGES, U, MINB, GLU, WG>;
    constexpr size_t smem = qmh_smem_bytes<type, 6, QMH_RUN_RT, NW, QMH_RUN_STAGES, U>();
    static_assert(qmh_smem_bytes<type, NT, QMH_RUN_RT, NW, QMH_RUN_STAGES, U>() <= smem, "the widest shape's stages");
    static bool checked[GGML_CUDA_MAX_DEVICES] = {};
    ggml_ext_cuda_allow_smem<kernel>(smem, device);
    if (!checked[device]) {
        int n = 0;
        CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, NW * WARP_SIZE, smem));
        const int planned = qmh_occupancy<type, NW, MINB, GLU>(device);
        if (n != planned) {
            GGML_ABORT("ggml_qmatmul: an SM holds %d blocks of the f16 kernel at %d column tiles%s, its grid is planned "
                       "for %d", n, NT, WG ? " (wgmma)" : "", planned);
        }
        checked[device] = true;
    }
    ggml_cuda_kernel_launch(kernel, ggml_cuda_kernel_launch_params(dim3(P), dim3(WARP_SIZE, NW), smem, stream), p);
}

// Q4_K from QMH_WG_MIN_TILES column tiles on takes its MMAs as wgmma (qmatmul_wgmma.cuh) where the build has them
// (GGML_EXT_WGMMA: compiled for sm_90a): the same bits as mma.sync's; H100 lab, every 8-warp and 12-warp Q4_K shape:
// 7-12% faster at 48 columns, 0-6% faster at 40 but on the GDN input (1% slower), at 32 slower on all but the FFN
// gate/up (level), slower below (docs/benchmarks.md, thirty-first and thirty-third sessions)
#define QMH_WG_MIN_TILES 5

template <ggml_type type, int NT, int NW, int MINB, bool GLU> static void qmh_launch(const qmh_args & p, int device,
                                                                                     int P, cudaStream_t stream) {
#ifdef GGML_EXT_WGMMA
    if constexpr (type == GGML_TYPE_Q4_K && NT >= QMH_WG_MIN_TILES && NW % 4 == 0) {
        // (the device runs the sm_90a code: not a later GPU running other code of the build)
        if (ggml_cuda_highest_compiled_arch(ggml_cuda_info().devices[device].cc) == GGML_CUDA_CC_HOPPER) {
            qmh_launch_as<type, NT, NW, MINB, GLU, true>(p, device, P, stream);
            return;
        }
    }
#endif
    qmh_launch_as<type, NT, NW, MINB, GLU, false>(p, device, P, stream);
}

template <ggml_type type, int NT, bool GLU> static void qmh_launch(const qmh_args & p, int device, int P,
                                                                   cudaStream_t stream) {
    qmh_with_shape<type>(p.M, [&](auto nw, auto minb) {
        qmh_launch<type, NT, decltype(nw)::value, decltype(minb)::value, GLU>(p, device, P, stream);
    });
}

// W * X (Q4_K, Q6_K or BF16, K a multiple of 256) through the f16 kernel: p.x in qmatmul_half.cuh's layout (bf16 for
// BF16), p.npad = 8 nt, p.ws of qmh_ws_floats<type>(nt, P, M) floats, P = qmh_grid<type>(M, K, SMs,
// qmh_per_sm<type, GLU>(M)). GLU (p.glu_out set; Q4_K, 8 or 12 warps): the GLU form of qmm_half_shared.
template <ggml_type type, bool GLU = false> static void qmh_run(const qmh_args & p, int device, int P, cudaStream_t stream) {
    switch (p.npad / 8) {
        case 1: qmh_launch<type, 1, GLU>(p, device, P, stream); break;
        case 2: qmh_launch<type, 2, GLU>(p, device, P, stream); break;
        case 3: qmh_launch<type, 3, GLU>(p, device, P, stream); break;
        case 4: qmh_launch<type, 4, GLU>(p, device, P, stream); break;
        case 5: qmh_launch<type, 5, GLU>(p, device, P, stream); break;
        case 6: qmh_launch<type, 6, GLU>(p, device, P, stream); break;
        default: GGML_ABORT("ggml_qmatmul: %d column tiles", p.npad / 8);
    }
}
