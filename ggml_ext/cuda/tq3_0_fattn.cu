// Flash attention over a TQ3_0 K/V cache for decode and tree verify, reading the 3.5-bit blocks directly (no f16
// copy of the cache).
//
// The query arrives rotated (pydflash/tq3.py), so scores are plain dot products with the dequantised rotated
// keys, and the output stays rotated until the graph un-rotates it. Work split ("flash decoding"): a CUDA block
// takes one KV head, some of the query rows that share it (the GQA heads times the query tokens) and one slice
// of the keys, and leaves (max, sum, unnormalised output) per row; a second kernel merges the slices.
// Two kernels: on Ampere and newer, a tensor-core kernel (k_tq3_0_fattn_mma, up to 256 rows per KV head); before,
// a scalar one (k_tq3_0_fattn_decode, up to 32 rows): its 4 warps take every 4th key of the slice, each lane
// dequantising the D/32 values j = lane + 32 b. Larger batches (prefill) go to upstream's kernels, which read
// TQ3_0 through the f16 converters, except over a long cache (ggml_ext_cuda_fattn_tq3_0_applies).

#include "fattn_split.cuh"
#include "ggml-ext-cuda.cuh"
#include "ggml-ext.h"

#include <cuda_fp16.h>

static __constant__ float tq3_0_fa_levels[8] = TQ3_0_LEVELS_INIT;

#define TQ3_0_FA_WARPS    4
#define TQ3_0_FA_NC       8    // query rows per CUDA block
#define TQ3_0_FA_MAX_ROWS 32   // query rows per KV head up to which this kernel is used

// The D/32 values of key/value row `row` that lane `lane` owns (j = lane + 32 b), dequantised.
template <int VPL>
static __device__ __forceinline__ void tq3_0_fa_load_row(const char * row, const int lane, float out[VPL]) {
    const block_tq3_0 * blocks = (const block_tq3_0 *) row;
#pragma unroll
    for (int b = 0; b < VPL; ++b) {
        const block_tq3_0 & blk = blocks[b];
        const int idx = ((blk.qs[lane % 8] >> (2*(lane / 8))) & 3) | (((blk.qh[lane / 8] >> (lane % 8)) & 1) << 2);
        out[b] = __half2float(__ushort_as_half(blk.d)) * tq3_0_fa_levels[idx];
    }
}

template <int D>
static __global__ void __launch_bounds__(TQ3_0_FA_WARPS*WARP_SIZE)
k_tq3_0_fattn_decode(const fa_split_params p) {
    constexpr int VPL = D / WARP_SIZE;
    constexpr int NC  = TQ3_0_FA_NC;
    const int lane = threadIdx.x % WARP_SIZE;
    const int warp = threadIdx.x / WARP_SIZE;

    const int tile  = blockIdx.x % p.n_tiles;
    const int hk    = (blockIdx.x / p.n_tiles) % p.n_head_kv;
    const int seq   = blockIdx.x / (p.n_tiles * p.n_head_kv);
    const int split = blockIdx.y;
    const int group = p.n_head / p.n_head_kv;
    const int n_rows = group * p.n_q;

    // query rows of this block: row r -> head hk*group + r % group, token r / group
    float q[NC][VPL];
    int   head[NC], tok[NC];
    bool  valid[NC];
#pragma unroll
    for (int c = 0; c < NC; ++c) {
        const int r = tile*NC + c;
        valid[c] = r < n_rows;
        head[c]  = hk*group + (valid[c] ? r % group : 0);
        tok[c]   = valid[c] ? r / group : 0;
        const float * qrow = (const float *) (p.q + tok[c]*p.nbq1 + head[c]*p.nbq2 + seq*p.nbq3);
#pragma unroll
        for (int b = 0; b < VPL; ++b) {
            q[c][b] = valid[c] ? qrow[lane + WARP_SIZE*b] * p.scale : 0.0f;
        }
    }

    float M[NC], S[NC], acc[NC][VPL];
#pragma unroll
    for (int c = 0; c < NC; ++c) {
        M[c] = -INFINITY;
        S[c] = 0.0f;
#pragma unroll
        for (int b = 0; b < VPL; ++b) {
            acc[c][b] = 0.0f;
        }
    }

    const int k_begin = split * p.keys_per_split;
    const int k_end   = min(k_begin + p.keys_per_split, p.n_kv);
    const char * kbase = p.k + hk*p.nbk2 + seq*p.nbk3;
    const char * vbase = p.v + hk*p.nbv2 + seq*p.nbv3;

    for (int key = k_begin + warp; key < k_end; key += TQ3_0_FA_WARPS) {
        float kv[VPL];
        tq3_0_fa_load_row<VPL>(kbase + key*p.nbk1, lane, kv);
        float s[NC];
        bool any = false;
#pragma unroll
        for (int c = 0; c < NC; ++c) {
            if (!valid[c]) { // uniform across the warp, so skipping the reduction is safe
                s[c] = -INFINITY;
                continue;
            }
            float dot = 0.0f;
#pragma unroll
            for (int b = 0; b < VPL; ++b) {
                dot += q[c][b] * kv[b];
            }
            dot = warp_reduce_sum(dot); // identical in every lane
            if (p.softcap != 0.0f) {
                dot = p.softcap * tanhf(dot);
            }
            if (p.mask) {
                const half * mrow = (const half *) (p.mask + tok[c]*p.nbm1 + (head[c] % p.mask_ne2)*p.nbm2 +
                                                    (seq % p.mask_ne3)*p.nbm3);
                dot += __half2float(mrow[key]);
            }
            s[c] = dot;
            any |= s[c] != -INFINITY;
        }
        if (!any) {
            continue;
        }
        float vv[VPL];
        tq3_0_fa_load_row<VPL>(vbase + key*p.nbv1, lane, vv);
#pragma unroll
        for (int c = 0; c < NC; ++c) {
            if (s[c] == -INFINITY) {
                continue;
            }
            if (s[c] > M[c]) {
                const float ms = expf(M[c] - s[c]); // 0 on the first key
                M[c] = s[c];
                S[c] = S[c]*ms + 1.0f;
#pragma unroll
                for (int b = 0; b < VPL; ++b) {
                    acc[c][b] = acc[c][b]*ms + vv[b];
                }
            } else {
                const float ps = expf(s[c] - M[c]);
                S[c] += ps;
#pragma unroll
                for (int b = 0; b < VPL; ++b) {
                    acc[c][b] += ps*vv[b];
                }
            }
        }
    }

    // merge the warps of the block, then write this slice's partial result per row
    __shared__ float sm_ms[TQ3_0_FA_WARPS][NC][2];
    __shared__ float sm_acc[TQ3_0_FA_WARPS][NC][D];
#pragma unroll
    for (int c = 0; c < NC; ++c) {
        if (lane == 0) {
            sm_ms[warp][c][0] = M[c];
            sm_ms[warp][c][1] = S[c];
        }
#pragma unroll
        for (int b = 0; b < VPL; ++b) {
            sm_acc[warp][c][lane + WARP_SIZE*b] = acc[c][b];
        }
    }
    __syncthreads();

    for (int c = warp; c < NC; c += TQ3_0_FA_WARPS) {
        const int r = tile*NC + c;
        if (r >= n_rows) {
            continue;
        }
        float m = -INFINITY;
        for (int w = 0; w < TQ3_0_FA_WARPS; ++w) {
            m = fmaxf(m, sm_ms[w][c][0]);
        }
        float f[TQ3_0_FA_WARPS];
        float sum = 0.0f;
        for (int w = 0; w < TQ3_0_FA_WARPS; ++w) {
            f[w] = sm_ms[w][c][0] == -INFINITY ? 0.0f : expf(sm_ms[w][c][0] - m);
            sum += f[w]*sm_ms[w][c][1];
        }
        const int h = hk*group + r % group;
        const int t = r / group;
        const int64_t row_out = ((int64_t) seq*p.n_q + t)*p.n_head + h;
        float * out = p.partial + (row_out*p.n_splits + split)*(D + 2);
        if (lane == 0) {
            out[0] = m;
            out[1] = sum;
        }
        for (int d = lane; d < D; d += WARP_SIZE) {
            float a = 0.0f;
            for (int w = 0; w < TQ3_0_FA_WARPS; ++w) {
                a += f[w]*sm_acc[w][c][d];
            }
            out[2 + d] = a;
        }
    }
}

// --- Ampere and newer: tensor cores --------------------------------------------------------------------------
//
// Why: the scalar kernel above reduces every dot product across a warp (5 shuffles per key per row) and
// dequantises each key once per warp-row pass; at depth it ran at ~2.5x f16 flash attention's time per key,
// although TQ3_0 reads 4.6x fewer bytes. Here each 16-key tile is dequantised once into shared memory as f16
// (K, then V into the same buffer) and consumed by mma.m16n8k16 (f16 in, f32 accumulate) for all query rows
// of the block: 16 rows per warp, 1, 2 or 4 warps over the rows (WR). Decode (6 rows per KV head) uses WR = 1
// and the block's 4 warps take every 4th tile of the slice, each with its own buffer; a tree verify (23 tokens
// x 6 heads = 138 rows) uses WR = 4, so 4 warps share one dequantised tile. Scores and the running softmax
// stay in registers (the accumulator layout of S is the A-operand layout of P); each warp (or group of WR
// warps) writes its own partial (max, sum, output), merged by fa_split_merge.

#define TQ3_0_FA_KT       16   // keys per tile: one k-step of the P.V mma
#define TQ3_0_FA_MMA_ROWS 256  // query rows per KV head up to which the tensor-core kernel is used ...
#define TQ3_0_FA_COPY_MIB 512  // ... and beyond, where upstream's f16 copy of K and V would be this large

// The raw sub-blocks of keys [k0, k0 + 16) of one head (rows nb1 bytes apart) that thread t of NT loads: one
// 14-byte sub-block (32 values) per step, read as 7 halfwords (a sub-block is only 2-byte aligned). Keys at or
// past k_end read as zeros (scale 0: they dequantise to zeros). Loading and decoding are apart so that a tile's
// loads can be in flight while the previous one is computed.
template <int D, int NT>
struct tq3_0_fa_raw {
    static constexpr int SPR   = D / TQ3_0_QK;                    // sub-blocks per row
    static constexpr int UNITS = TQ3_0_FA_KT * SPR;               // sub-blocks per tile
    static constexpr int UPT   = (UNITS + NT - 1) / NT;           // per thread
    uint16_t h[UPT][7];

    __device__ __forceinline__ void load(const char * base, const int64_t nb1, const int k0, const int k_end, const int t) {
#pragma unroll
        for (int i = 0; i < UPT; ++i) {
            const int u = t + i*NT;
            const int key = u / SPR;
            if (u < UNITS && k0 + key < k_end) {
                const uint16_t * w = (const uint16_t *) (base + (int64_t) (k0 + key)*nb1 + (u % SPR)*sizeof(block_tq3_0));
#pragma unroll
                for (int j = 0; j < 7; ++j) {
                    h[i][j] = __ldg(w + j);
                }
            } else {
#pragma unroll
                for (int j = 0; j < 7; ++j) {
                    h[i][j] = 0;
                }
            }
        }
    }

    // dequantise into tile[key][0..D) as f16. The 3-bit indices of 4 values are built at once, one per byte;
    // each pair of values then looks up both levels in one step (pair_lev[i | i' << 3] = (level i, level i'), f16)
    // and is scaled by d in f16.
    template <int LD>
    __device__ __forceinline__ void store(half (*tile)[LD], const half2 * pair_lev, const int t) const {
#pragma unroll
        for (int i = 0; i < UPT; ++i) {
            const int u = t + i*NT;
            if (u >= UNITS) {
                continue;
            }
            const half2    d2  = __half2half2(__ushort_as_half(h[i][0]));
            const uint32_t qs0 = h[i][1] | (uint32_t) h[i][2] << 16; // qs[0..3]
            const uint32_t qs1 = h[i][3] | (uint32_t) h[i][4] << 16; // qs[4..7]
            const uint32_t qh  = h[i][5] | (uint32_t) h[i][6] << 16; // bit j: high bit of value j
            uint32_t out[TQ3_0_QK/2];
#pragma unroll
            for (int c = 0; c < 4; ++c) { // values 8c .. 8c + 7: low bits at bits 2c, 2c+1 of qs[0..7]
                const uint32_t hb = qh >> 8*c;
                // bit r of a nibble to bit 2 of byte r: the four shifted copies (2 + 7r) do not overlap
                const uint32_t ia = ((qs0 >> 2*c) & 0x03030303u) | (((hb & 0xFu) * 0x00810204u) & 0x04040404u);
                const uint32_t ib = ((qs1 >> 2*c) & 0x03030303u) | ((((hb >> 4) & 0xFu) * 0x00810204u) & 0x04040404u);
                // bytes (r, r+1) of ia/ib -> r | (r+1) << 3: the upper byte shifted right by 5
                out[4*c + 0] = fa_h2u(__hmul2(d2, pair_lev[(ia | ia >> 5) & 63]));
                out[4*c + 1] = fa_h2u(__hmul2(d2, pair_lev[((ia >> 16) | (ia >> 21)) & 63]));
                out[4*c + 2] = fa_h2u(__hmul2(d2, pair_lev[(ib | ib >> 5) & 63]));
                out[4*c + 3] = fa_h2u(__hmul2(d2, pair_lev[((ib >> 16) | (ib >> 21)) & 63]));
            }
            uint4 * dst = (uint4 *) &tile[u / SPR][(u % SPR)*TQ3_0_QK];
#pragma unroll
            for (int j = 0; j < TQ3_0_QK/8; ++j) {
                dst[j] = make_uint4(out[4*j], out[4*j + 1], out[4*j + 2], out[4*j + 3]);
            }
        }
    }
};

template <int WR>
static __device__ __forceinline__ void tq3_0_fa_group_sync(const int kg) {
    if constexpr (WR == 1) {
        __syncwarp();
    } else {
        asm volatile("bar.sync %0, %1;" :: "r"(kg + 1), "r"(WR*WARP_SIZE) : "memory"); // barrier 0 is __syncthreads
    }
}

template <int D, int WR>
static __global__ void __launch_bounds__(TQ3_0_FA_WARPS*WARP_SIZE)
k_tq3_0_fattn_mma(const fa_split_params p) {
#if __CUDA_ARCH__ >= GGML_CUDA_CC_AMPERE
    constexpr int WK = TQ3_0_FA_WARPS / WR; // groups of warps that take every WK-th tile
    constexpr int RB = 16*WR;               // query rows per CUDA block
    constexpr int KT = TQ3_0_FA_KT;
    constexpr int LD = D + 8;               // row stride in halves: 16-byte rows, conflict-free ldmatrix
    static_assert(TQ3_0_FA_WARPS % WR == 0, "WR must divide the warps of a block");

    __shared__ __align__(16) half sQ[RB][LD];
    __shared__ __align__(16) half sKV[WK][KT][LD];
    __shared__ half2 sPairLev[64]; // (level i & 7, level i >> 3)

    const int lane = threadIdx.x % WARP_SIZE;
    const int warp = threadIdx.x / WARP_SIZE;
    const int rg   = warp % WR; // row group: rows 16 rg .. 16 rg + 15 of the block
    const int kg   = warp / WR; // key group
    const int g    = lane / 4;  // mma fragment coordinates
    const int t4   = lane % 4;

    const int tile  = blockIdx.x % p.n_tiles;
    const int hk    = (blockIdx.x / p.n_tiles) % p.n_head_kv;
    const int seq   = blockIdx.x / (p.n_tiles * p.n_head_kv);
    const int split = blockIdx.y;
    const int group = p.n_head / p.n_head_kv;
    const int n_rows = group * p.n_q;

    if (threadIdx.x < 64) {
        sPairLev[threadIdx.x] = __floats2half2_rn(tq3_0_fa_levels[threadIdx.x % 8], tq3_0_fa_levels[threadIdx.x / 8]);
    }
    // query rows of this block, scaled, as f16: row r -> head hk*group + r % group, token r / group; rows past
    // n_rows are zeros (their scores are finite and never written out)
    for (int i = threadIdx.x; i < RB*D; i += blockDim.x) {
        const int rr = i / D;
        const int c  = i % D;
        const int r  = tile*RB + rr;
        float x = 0.0f;
        if (r < n_rows) {
            x = ((const float *) (p.q + (r / group)*p.nbq1 + (hk*group + r % group)*p.nbq2 + seq*p.nbq3))[c] * p.scale;
        }
        sQ[rr][c] = __float2half(x);
    }
    __syncthreads();

    // the two rows of this thread's fragments (g and g + 8 of the warp's 16) and their mask rows
    const half * mrow[2] = {nullptr, nullptr};
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int r = min(tile*RB + rg*16 + g + 8*h, n_rows - 1); // rows past the end: any valid row's mask
        if (p.mask) {
            mrow[h] = (const half *) (p.mask + (r / group)*p.nbm1 + ((hk*group + r % group) % p.mask_ne2)*p.nbm2 +
                                      (seq % p.mask_ne3)*p.nbm3);
        }
    }

    constexpr float LOG2E = 1.4426950408889634f;
    float M[2] = {-INFINITY, -INFINITY}; // running max of the rows, log2 units
    float L[2] = {0.0f, 0.0f};           // this thread's part of the running sums
    float O[D/8][4];                     // output n-tiles of 8 columns: (g, 2 t4 + {0,1}), (g + 8, ...)
#pragma unroll
    for (int n = 0; n < D/8; ++n) {
        O[n][0] = O[n][1] = O[n][2] = O[n][3] = 0.0f;
    }

    const int k_begin = split * p.keys_per_split;
    const int k_end   = min(k_begin + p.keys_per_split, p.n_kv);
    const int n_key_tiles = (k_end - k_begin + KT - 1) / KT;
    const char * kbase = p.k + hk*p.nbk2 + seq*p.nbk3;
    const char * vbase = p.v + hk*p.nbv2 + seq*p.nbv3;
    half (*buf)[LD] = sKV[kg];
    const int gt = rg*WARP_SIZE + lane; // thread index within the key group

    // loads of the next tile are issued as soon as the current one is in shared memory, where registers allow
    // (one or two sub-blocks per thread for K and for V); otherwise V's loads are issued before Q.K
    using raw_t = tq3_0_fa_raw<D, WR*WARP_SIZE>;
    constexpr bool PREFETCH = raw_t::UPT <= 2;
    raw_t rk, rv;
    if (PREFETCH) {
        rk.load(kbase, p.nbk1, k_begin + kg*KT, k_end, gt);
        rv.load(vbase, p.nbv1, k_begin + kg*KT, k_end, gt);
    }

    for (int it = kg; it < n_key_tiles; it += WK) { // the same trip count for every warp of a group
        const int k0 = k_begin + it*KT;
        if (!PREFETCH) {
            rk.load(kbase, p.nbk1, k0, k_end, gt);
        }
        rk.template store<LD>(buf, sPairLev, gt);
        if (PREFETCH) {
            rk.load(kbase, p.nbk1, k0 + WK*KT, k_end, gt); // past the slice: zeros, never stored
        } else {
            rv.load(vbase, p.nbv1, k0, k_end, gt);
        }
        tq3_0_fa_group_sync<WR>(kg);

        // S = Q K^T: 16 rows x 16 keys as two n-tiles of 8 keys; even and odd k-steps accumulate apart (4
        // independent mma chains instead of 2: the chain's latency is what a tile waits on)
        float S[2][4], S2[2][4];
#pragma unroll
        for (int n = 0; n < 2; ++n) {
            S[n][0] = S[n][1] = S[n][2] = S[n][3] = 0.0f;
            S2[n][0] = S2[n][1] = S2[n][2] = S2[n][3] = 0.0f;
        }
#pragma unroll
        for (int kb = 0; kb < D; kb += 16) {
            uint32_t a[4], b[4];
            fa_ldmatrix(a, &sQ[rg*16 + lane % 16][kb + (lane / 16)*8]);
            // matrices: keys 0-7 at kb, keys 0-7 at kb+8, keys 8-15 at kb, keys 8-15 at kb+8
            fa_ldmatrix(b, &buf[lane % 8 + (lane / 16)*8][kb + ((lane / 8) % 2)*8]);
            float (*acc)[4] = (kb / 16) % 2 ? S2 : S;
            fa_mma(acc[0], a, b[0], b[1]);
            fa_mma(acc[1], a, b[2], b[3]);
        }
#pragma unroll
        for (int n = 0; n < 2; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                S[n][e] += S2[n][e];
            }
        }
        tq3_0_fa_group_sync<WR>(kg); // every warp of the group is done with K before V overwrites it
        rv.template store<LD>(buf, sPairLev, gt);
        if (PREFETCH) {
            rv.load(vbase, p.nbv1, k0 + WK*KT, k_end, gt);
        }

        // softcap, mask, keys past the slice, then the online softmax (log2 units)
#pragma unroll
        for (int n = 0; n < 2; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int key = k0 + 8*n + 2*t4 + e % 2;
                float x = S[n][e];
                if (p.softcap != 0.0f) {
                    x = p.softcap * tanhf(x);
                }
                if (key >= k_end) {
                    x = -INFINITY;
                } else if (p.mask) {
                    x += __half2float(mrow[e / 2][key]);
                }
                S[n][e] = x * LOG2E;
            }
        }
        uint32_t P[1][4];
        fa_online_softmax(S, M, L, O, P);
        tq3_0_fa_group_sync<WR>(kg); // V is in the buffer

        // O += P V: per 16 columns, matrices keys 0-7 / keys 8-15 at columns c, then the same at c + 8
#pragma unroll
        for (int c = 0; c < D; c += 16) {
            uint32_t b[4];
            fa_ldmatrix_trans(b, &buf[lane % 16][c + (lane / 16)*8]);
            fa_mma(O[c/8],     P[0], b[0], b[1]);
            fa_mma(O[c/8 + 1], P[0], b[2], b[3]);
        }
        tq3_0_fa_group_sync<WR>(kg); // done with V before the next tile's K
    }

    // this warp's partial result: slice index split*WK + kg
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int r = tile*RB + rg*16 + g + 8*h;
        float * out = nullptr;
        if (r < n_rows) {
            const int64_t row_out = ((int64_t) seq*p.n_q + r / group)*p.n_head + hk*group + r % group;
            out = p.partial + (row_out*p.n_splits + split*WK + kg)*(D + 2);
        }
        fa_store_partial(out, M, L, O, h, t4, t4 == 0, 0);
    }
#else
    GGML_UNUSED(p);
    NO_DEVICE_CODE;
#endif
}

// Tensor cores (Ampere and newer) on the current device, unless PYDFLASH_TQ3_FA_SCALAR=1 asks for the scalar
// kernel (to compare the two on one machine).
static bool tq3_0_fa_use_mma() {
    static const bool scalar = ggml_ext_env_switch("PYDFLASH_TQ3_FA_SCALAR", false);
    return !scalar && ampere_mma_available(ggml_cuda_info().devices[ggml_cuda_get_device()].cc);
}

// Launch the tensor-core kernel with WR warps over the rows: slices of the keys fill the GPU once.
template <int D, int WR>
static void tq3_0_fattn_mma_launch(ggml_backend_cuda_context & ctx, fa_split_params p, float * dst, const int64_t out_rows) {
    constexpr int WK = TQ3_0_FA_WARPS / WR;
    constexpr int KT = TQ3_0_FA_KT;
    const int n_rows = (p.n_head / p.n_head_kv) * p.n_q;
    p.n_tiles = (n_rows + 16*WR - 1) / (16*WR);
    const int blocks_x = p.n_tiles * p.n_head_kv * p.n_seq;
    int per_sm = 0;
    CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, k_tq3_0_fattn_mma<D, WR>, TQ3_0_FA_WARPS*WARP_SIZE, 0));
    const int nsm = ggml_cuda_info().devices[ctx.device].nsm;
    // as many blocks as run at once, each key group taking at least 2 tiles of its slice
    int n_splits = std::max(1, std::min((std::max(per_sm, 1)*nsm + blocks_x - 1) / blocks_x,
                                        (p.n_kv + 2*KT*WK - 1) / (2*KT*WK)));
    p.keys_per_split = (p.n_kv + n_splits - 1) / n_splits;
    p.keys_per_split = (p.keys_per_split + KT - 1) / KT * KT; // whole tiles
    n_splits = (p.n_kv + p.keys_per_split - 1) / p.keys_per_split;
    p.n_splits = n_splits * WK; // one partial per key group of each slice

    ggml_cuda_pool_alloc<float> partial(ctx.pool(), out_rows * p.n_splits * (D + 2));
    p.partial = partial.get();
    cudaStream_t stream = ctx.stream();
    k_tq3_0_fattn_mma<D, WR><<<dim3(blocks_x, n_splits), TQ3_0_FA_WARPS*WARP_SIZE, 0, stream>>>(p);
    fa_split_merge<D><<<out_rows, D, 0, stream>>>(p.partial, dst, p.n_splits);
}

template <int D>
static void tq3_0_fattn_mma(ggml_backend_cuda_context & ctx, const fa_split_params & p, float * dst, const int64_t out_rows) {
    const int n_rows = (p.n_head / p.n_head_kv) * p.n_q;
    if (n_rows <= 16) {
        tq3_0_fattn_mma_launch<D, 1>(ctx, p, dst, out_rows); // decode: 4 warps over the keys
    } else if (n_rows <= 32) {
        tq3_0_fattn_mma_launch<D, 2>(ctx, p, dst, out_rows);
    } else {
        tq3_0_fattn_mma_launch<D, 4>(ctx, p, dst, out_rows); // tree verify: 4 warps share each tile
    }
}

bool ggml_ext_cuda_fattn_tq3_0_applies(const ggml_tensor * dst) {
    const ggml_tensor * Q = dst->src[0];
    const ggml_tensor * K = dst->src[1];
    const ggml_tensor * V = dst->src[2];
    const ggml_tensor * mask = dst->src[3];
    if (K->type != GGML_TYPE_TQ3_0 || V->type != GGML_TYPE_TQ3_0 || Q->type != GGML_TYPE_F32) {
        return false;
    }
    if (K->ne[0] != V->ne[0] || Q->ne[0] != K->ne[0] || (K->ne[0] != 128 && K->ne[0] != 256)) {
        return false;
    }
    if (K->nb[0] != ggml_type_size(K->type) || V->nb[0] != ggml_type_size(V->type)) {
        return false; // rows are read whole
    }
    float max_bias = 0.0f;
    memcpy(&max_bias, (const float *) dst->op_params + 1, sizeof(float));
    if (max_bias != 0.0f || dst->src[4] != nullptr) {
        return false; // ALiBi and sinks: upstream's kernels
    }
    if (mask && (mask->type != GGML_TYPE_F16 || mask->nb[0] != sizeof(half))) {
        return false;
    }
    if (Q->ne[2] % K->ne[2] != 0 || Q->nb[0] != sizeof(float) || dst->type != GGML_TYPE_F32 || !ggml_is_contiguous(dst)) {
        return false;
    }
    if (K->nb[1] % 2 != 0 || K->nb[2] % 2 != 0 || K->nb[3] % 2 != 0 ||
        V->nb[1] % 2 != 0 || V->nb[2] % 2 != 0 || V->nb[3] % 2 != 0) {
        return false; // sub-blocks are read as halfwords
    }
    const int64_t rows_per_kv_head = Q->ne[1] * (Q->ne[2] / K->ne[2]);
    if (!tq3_0_fa_use_mma()) {
        return rows_per_kv_head <= TQ3_0_FA_MAX_ROWS;
    }
    // Past 256 rows (prefill micro-batches) upstream's kernels are the faster ones, but they read TQ3_0 through an
    // f16 copy of the whole K and V (1 GiB at 256K positions of the 27B shape, the largest transient of a long
    // prompt): from TQ3_0_FA_COPY_MIB of such a copy on (PYDFLASH_TQ3_FA_COPY_MIB, default 512; 0: always) the
    // tensor-core kernel takes any number of rows, tile by tile, reading the 3.5-bit blocks.
    const char * env = getenv("PYDFLASH_TQ3_FA_COPY_MIB");
    const int64_t copy_limit = (env ? atoll(env) : TQ3_0_FA_COPY_MIB) << 20;
    const int64_t copy_bytes = 2 * ggml_nelements(K) * (int64_t) sizeof(half);
    return rows_per_kv_head <= TQ3_0_FA_MMA_ROWS || copy_bytes >= copy_limit;
}

void ggml_ext_cuda_fattn_tq3_0(ggml_backend_cuda_context & ctx, ggml_tensor * dst) {
    const int D = (int) dst->src[1]->ne[0];
    fa_split_params p = fa_split_params_of(dst);

    const int64_t out_rows = (int64_t) p.n_seq * p.n_q * p.n_head;
    if (tq3_0_fa_use_mma()) {
        if (D == 128) {
            tq3_0_fattn_mma<128>(ctx, p, (float *) dst->data, out_rows);
        } else {
            tq3_0_fattn_mma<256>(ctx, p, (float *) dst->data, out_rows);
        }
        CUDA_CHECK(cudaGetLastError());
        return;
    }

    const int n_rows = (p.n_head / p.n_head_kv) * p.n_q;
    p.n_tiles = (n_rows + TQ3_0_FA_NC - 1) / TQ3_0_FA_NC;
    const int blocks_x = p.n_tiles * p.n_head_kv * p.n_seq;
    // enough slices to fill the GPU twice over, each at least 64 keys long
    const int nsm = ggml_cuda_info().devices[ctx.device].nsm;
    int n_splits = std::max(1, std::min((2*nsm + blocks_x - 1) / blocks_x, (p.n_kv + 63) / 64));
    p.keys_per_split = (p.n_kv + n_splits - 1) / n_splits;
    p.n_splits = n_splits = (p.n_kv + p.keys_per_split - 1) / p.keys_per_split;

    ggml_cuda_pool_alloc<float> partial(ctx.pool(), out_rows * n_splits * (D + 2));
    p.partial = partial.get();

    cudaStream_t stream = ctx.stream();
    const dim3 grid(blocks_x, n_splits);
    if (D == 128) {
        k_tq3_0_fattn_decode<128><<<grid, TQ3_0_FA_WARPS*WARP_SIZE, 0, stream>>>(p);
        fa_split_merge<128><<<out_rows, 128, 0, stream>>>(p.partial, (float *) dst->data, n_splits);
    } else {
        k_tq3_0_fattn_decode<256><<<grid, TQ3_0_FA_WARPS*WARP_SIZE, 0, stream>>>(p);
        fa_split_merge<256><<<out_rows, 256, 0, stream>>>(p.partial, (float *) dst->data, n_splits);
    }
    CUDA_CHECK(cudaGetLastError());
}
