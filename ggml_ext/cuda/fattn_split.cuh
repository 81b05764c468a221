#pragma once

// Split-KV flash attention ("flash decoding") for a few query tokens over a long cache: the pieces shared by the
// TQ3_0 kernels (tq3_0_fattn.cu) and the f16 one below (used by fattn_split.cu), header-only so that a lab can
// time them without the rest of ggml.
//
// Work split: a CUDA block takes one KV head, a tile of the query rows that share it (row r of KV head hk is
// token r / G of query head hk G + r % G, G the GQA ratio: a 23-token tree verify of the 27B shape has 138 rows
// per KV head) and one slice of the keys, and leaves a partial result per row: (max, sum of weights,
// unnormalised output); fa_split_merge combines the slices.
//
// Why an f16 kernel of our own: at a tree verify's size ggml's tensor-core kernel runs 8 tokens x 8 GQA columns
// a tile (2 of 8 empty at ratio 6) with a stream-k fix-up, ~35 us a layer over 768 cells whose K and V are
// read in ~1 us (docs/benchmarks.md). Here: 16-row m-tiles, one warp per (m-tile, part of the output columns),
// K and V tiles of 32 keys copied asynchronously into a ring of shared-memory stages.

#include "common.cuh"

#include <cuda_fp16.h>
#include <cstring>

struct fa_split_params {
    const char * q; const char * k; const char * v; const char * mask;
    float * partial;                // [rows out][n_splits][D + 2]: max (natural log units), sum, output
    int64_t nbq1, nbq2, nbq3;       // bytes
    int64_t nbk1, nbk2, nbk3;
    int64_t nbv1, nbv2, nbv3;
    int64_t nbm1, nbm2, nbm3;
    int n_q, n_head, n_head_kv, n_kv, n_seq, mask_ne2, mask_ne3;
    int n_tiles, n_splits, keys_per_split;
    uint3 group_div;                // fastdiv values of the GQA ratio n_head / n_head_kv (the f16 kernel's plan)
    float scale, softcap;           // with a softcap, scale is divided by it: softcap * tanh(scale/softcap * q.k)
};

// The parameters of a GGML_OP_FLASH_ATTN_EXT node (Q, K, V, mask as its sources; strides in bytes), before any
// kernel's tiles and slices.
static fa_split_params fa_split_params_of(const ggml_tensor * dst) {
    const ggml_tensor * Q    = dst->src[0];
    const ggml_tensor * K    = dst->src[1];
    const ggml_tensor * V    = dst->src[2];
    const ggml_tensor * mask = dst->src[3];
    fa_split_params p = {};
    p.q = (const char *) Q->data; p.k = (const char *) K->data; p.v = (const char *) V->data;
    p.mask = mask ? (const char *) mask->data : nullptr;
    p.nbq1 = Q->nb[1]; p.nbq2 = Q->nb[2]; p.nbq3 = Q->nb[3];
    p.nbk1 = K->nb[1]; p.nbk2 = K->nb[2]; p.nbk3 = K->nb[3];
    p.nbv1 = V->nb[1]; p.nbv2 = V->nb[2]; p.nbv3 = V->nb[3];
    if (mask) {
        p.nbm1 = mask->nb[1]; p.nbm2 = mask->nb[2]; p.nbm3 = mask->nb[3];
        p.mask_ne2 = (int) mask->ne[2]; p.mask_ne3 = (int) mask->ne[3];
    } else {
        p.mask_ne2 = 1; p.mask_ne3 = 1;
    }
    p.n_q = (int) Q->ne[1]; p.n_head = (int) Q->ne[2]; p.n_head_kv = (int) K->ne[2];
    p.n_kv = (int) K->ne[1]; p.n_seq = (int) Q->ne[3];
    memcpy(&p.scale,   (const float *) dst->op_params + 0, sizeof(float));
    memcpy(&p.softcap, (const float *) dst->op_params + 2, sizeof(float));
    if (p.softcap != 0.0f) {
        p.scale /= p.softcap; // as upstream
    }
    return p;
}

// --- tensor-core and copy primitives (Ampere and newer) -------------------------------------------------------

static __device__ __forceinline__ void fa_mma(float c[4], const uint32_t a[4], const uint32_t b0, const uint32_t b1) {
#if __CUDA_ARCH__ >= GGML_CUDA_CC_AMPERE
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
    GGML_UNUSED(c); GGML_UNUSED(a); GGML_UNUSED(b0); GGML_UNUSED(b1);
    NO_DEVICE_CODE;
#endif
}

// Four 8x8 f16 matrices from shared memory; lane l gives the address of row l % 8 of matrix l / 8.
static __device__ __forceinline__ void fa_ldmatrix(uint32_t r[4], const half * row) {
#if __CUDA_ARCH__ >= GGML_CUDA_CC_TURING
    const uint32_t addr = (uint32_t) __cvta_generic_to_shared(row);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr) : "memory");
#else
    GGML_UNUSED(r); GGML_UNUSED(row);
    NO_DEVICE_CODE;
#endif
}

// The same, each matrix transposed (for V: rows in memory are keys, the mma wants them along k).
static __device__ __forceinline__ void fa_ldmatrix_trans(uint32_t r[4], const half * row) {
#if __CUDA_ARCH__ >= GGML_CUDA_CC_TURING
    const uint32_t addr = (uint32_t) __cvta_generic_to_shared(row);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr) : "memory");
#else
    GGML_UNUSED(r); GGML_UNUSED(row);
    NO_DEVICE_CODE;
#endif
}

static __device__ __forceinline__ uint32_t fa_h2u(const half2 h) {
    return *(const uint32_t *) &h;
}

static __device__ __forceinline__ uint32_t fa_pack(const float lo, const float hi) {
    return fa_h2u(__floats2half2_rn(lo, hi)); // lo in the low 16 bits: the lower column of an mma fragment
}

// 16 bytes from global to shared memory, asynchronously; zeros where !valid (src must still be a valid address).
static __device__ __forceinline__ void fa_cp_async_16(half * dst, const void * src, const bool valid) {
#if __CUDA_ARCH__ >= GGML_CUDA_CC_AMPERE
    const uint32_t addr = (uint32_t) __cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" :: "r"(addr), "l"(src), "r"(valid ? 16 : 0) : "memory");
#else
    GGML_UNUSED(dst); GGML_UNUSED(src); GGML_UNUSED(valid);
    NO_DEVICE_CODE;
#endif
}

static __device__ __forceinline__ void fa_cp_async_commit() {
#if __CUDA_ARCH__ >= GGML_CUDA_CC_AMPERE
    asm volatile("cp.async.commit_group;" ::: "memory");
#endif
}

// Wait until at most N of this thread's committed groups are still in flight.
template <int N>
static __device__ __forceinline__ void fa_cp_async_wait() {
#if __CUDA_ARCH__ >= GGML_CUDA_CC_AMPERE
    asm volatile("cp.async.wait_group %0;" :: "n"(N) : "memory");
#endif
}

// --- the online softmax of a key tile, shared by the f16 and TQ3_0 tensor-core kernels -----------------------

// One tile's step for this thread's two rows (h = 0: fragment row g, 1: row g + 8) of an m16 tile: S holds the
// tile's NK n-tiles of 8 scores in log2 units, masked keys at -inf. The rows' running max M moves to the tile's
// (over the quad's 4 threads), L and the output accumulators O (NO n-tiles) are rescaled to it, and P gets the
// weights as the A operand of P.V, one k-step of 16 keys per P[j]: (g, keys 2t4..), (g+8, keys 2t4..), (g, keys
// 8+2t4..), (g+8, keys 8+2t4..). L adds the weights as rounded to f16, which is what V is weighed by.
template <int NK, int NO>
static __device__ __forceinline__ void fa_online_softmax(const float (&S)[NK][4], float (&M)[2], float (&L)[2],
                                                         float (&O)[NO][4], uint32_t (&P)[NK/2][4]) {
    static_assert(NK % 2 == 0, "whole k-steps of 16 keys");
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int n = 0; n < NK; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            mx[e / 2] = fmaxf(mx[e / 2], S[n][e]);
        }
    }
    float alpha[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffff, mx[h], 1)); // the 4 threads of a row
        mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffff, mx[h], 2));
        const float m_new = fmaxf(M[h], mx[h]);
        alpha[h] = m_new == -INFINITY ? 1.0f : exp2f(M[h] - m_new); // 0 on the first unmasked key
        M[h] = m_new;
        L[h] *= alpha[h];
    }
#pragma unroll
    for (int n = 0; n < NK; ++n) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const float p0 = M[h] == -INFINITY ? 0.0f : exp2f(S[n][2*h]     - M[h]);
            const float p1 = M[h] == -INFINITY ? 0.0f : exp2f(S[n][2*h + 1] - M[h]);
            P[n/2][2*(n % 2) + h] = fa_pack(p0, p1);
            const half2 ph = *(const half2 *) &P[n/2][2*(n % 2) + h];
            L[h] += __low2float(ph) + __high2float(ph);
        }
    }
    if (__any_sync(0xffffffff, alpha[0] != 1.0f || alpha[1] != 1.0f)) { // deep in the context the max rarely moves
#pragma unroll
        for (int n = 0; n < NO; ++n) {
            O[n][0] *= alpha[0]; O[n][1] *= alpha[0];
            O[n][2] *= alpha[1]; O[n][3] *= alpha[1];
        }
    }
}

// A slice's partial result for this thread's row h (after fa_online_softmax's last tile): the quad's sums of L
// (every thread of the quad must call this, row past the end or not), then, where out is not null (the row's
// partial, [D + 2] floats), the max in natural units and the sum (by the thread that write_ml says) and this
// thread's output columns, from col0 on.
template <int NO>
static __device__ __forceinline__ void fa_store_partial(float * out, const float (&M)[2], float (&L)[2],
                                                        const float (&O)[NO][4], const int h, const int t4,
                                                        const bool write_ml, const int col0) {
    constexpr float LOG2E = 1.4426950408889634f;
    L[h] += __shfl_xor_sync(0xffffffff, L[h], 1);
    L[h] += __shfl_xor_sync(0xffffffff, L[h], 2);
    if (out == nullptr) {
        return;
    }
    if (write_ml) {
        out[0] = M[h] == -INFINITY ? -INFINITY : M[h] / LOG2E; // the merge works in natural units
        out[1] = L[h];
    }
#pragma unroll
    for (int n = 0; n < NO; ++n) {
        *(float2 *) &out[2 + col0 + 8*n + 2*t4] = make_float2(O[n][2*h], O[n][2*h + 1]);
    }
}

// --- merge -----------------------------------------------------------------------------------------------------

// One CUDA block per output row: merge the slices (max, sum, output) into softmax(...) V. dst rows are
// (seq, token, head), D floats each, as ggml_flash_attn_ext's [D, H, n_q, n_seq] result. The slices' loads are
// spread over the threads and issued FA_MERGE_UNROLL at a time: a loop of one dependent load per slice would wait
// on the L2 once per slice and cost more than the attention itself.
#define FA_MERGE_CHUNK  256
#define FA_MERGE_UNROLL 8

template <int D>
static __global__ void __launch_bounds__(D) fa_split_merge(const float * partial, float * dst, const int n_splits) {
    static_assert(D % WARP_SIZE == 0 && D <= FA_MERGE_CHUNK, "one thread per output column");
    ggml_cuda_pdl_sync(); // the partials are the attention's output (a programmatic launch may start before its end)
    __shared__ float s_w[FA_MERGE_CHUNK];    // a chunk of slices' weights exp(m_i - m)
    __shared__ float s_red[D / WARP_SIZE];
    const int64_t row = blockIdx.x;
    const float * part = partial + row*n_splits*(D + 2);
    const int tid = threadIdx.x;

    // the largest slice max, then the sum of the slices' sums at that scale
    float m = -INFINITY;
    for (int i = tid; i < n_splits; i += D) {
        m = fmaxf(m, part[i*(D + 2)]);
    }
    m = warp_reduce_max(m);
    if (tid % WARP_SIZE == 0) {
        s_red[tid / WARP_SIZE] = m;
    }
    __syncthreads();
    m = s_red[0];
#pragma unroll
    for (int w = 1; w < D / WARP_SIZE; ++w) {
        m = fmaxf(m, s_red[w]);
    }
    __syncthreads();
    float sum = 0.0f;
    for (int i = tid; i < n_splits; i += D) {
        const float mi = part[i*(D + 2)];
        sum += mi == -INFINITY ? 0.0f : expf(mi - m)*part[i*(D + 2) + 1];
    }
    sum = warp_reduce_sum(sum);
    if (tid % WARP_SIZE == 0) {
        s_red[tid / WARP_SIZE] = sum;
    }
    __syncthreads();
    sum = 0.0f;
#pragma unroll
    for (int w = 0; w < D / WARP_SIZE; ++w) {
        sum += s_red[w];
    }

    float a = 0.0f;
    for (int i0 = 0; i0 < n_splits; i0 += FA_MERGE_CHUNK) {
        const int n = min(FA_MERGE_CHUNK, n_splits - i0);
        __syncthreads(); // the previous chunk's weights are consumed
        for (int i = tid; i < n; i += D) {
            const float mi = part[(i0 + i)*(D + 2)];
            s_w[i] = mi == -INFINITY ? 0.0f : expf(mi - m); // an empty slice's output is zeros: weight 0 is exact
        }
        __syncthreads();
        int i = 0;
        for (; i + FA_MERGE_UNROLL <= n; i += FA_MERGE_UNROLL) {
            float x[FA_MERGE_UNROLL];
#pragma unroll
            for (int u = 0; u < FA_MERGE_UNROLL; ++u) {
                x[u] = part[(i0 + i + u)*(D + 2) + 2 + tid];
            }
#pragma unroll
            for (int u = 0; u < FA_MERGE_UNROLL; ++u) {
                a = fmaf(s_w[i + u], x[u], a);
            }
        }
        for (; i < n; ++i) {
            a = fmaf(s_w[i], part[(i0 + i)*(D + 2) + 2 + tid], a);
        }
    }
    dst[row*D + tid] = sum == 0.0f ? 0.0f : a / sum; // a fully masked row gives 0, as on the CPU
}

// --- the f16 kernel ----------------------------------------------------------------------------------------

#define FA_SPLIT_KT 32 // keys per tile

// Shared memory of k_fa_split_f16<D, MT, DS, ST, SQ>: the block's query rows, then ST stages of a K tile, a V tile
// and the rows' mask tile; with SQ, the warps' partial scores.
template <int D, int MT, int DS, int ST, bool SQ>
static constexpr size_t fa_split_f16_smem() {
    return ((size_t) (16*MT + 2*ST*FA_SPLIT_KT) * (D + 8) + (size_t) ST*16*MT*FA_SPLIT_KT) * sizeof(half) +
           (SQ ? (size_t) MT*DS*16*FA_SPLIT_KT*sizeof(float) : 0);
}

// MT m-tiles of 16 query rows, DS warps per m-tile, each taking the P.V product for D/DS of the output columns (fewer
// accumulators per thread) and, with SQ, the scores' sums over D/DS of the head dimensions (without, each warp
// computes the m-tile's scores in full); ST stages of K and V in flight.
template <int D, int MT, int DS, int ST, bool SQ>
static __global__ void __launch_bounds__(MT*DS*WARP_SIZE)
k_fa_split_f16(const fa_split_params p) {
#if __CUDA_ARCH__ >= GGML_CUDA_CC_AMPERE
    constexpr int NT = MT*DS*WARP_SIZE;
    constexpr int RB = 16*MT;      // query rows per block
    constexpr int KT = FA_SPLIT_KT;
    constexpr int LD = D + 8;      // row stride in halves: 16-byte rows, conflict-free ldmatrix
    constexpr int DW = D/DS;       // output columns per warp
    static_assert(DW % 16 == 0 && ST >= 2, "bad shape");

    extern __shared__ __align__(16) unsigned char fa_smem[];
    half (*sQ)[LD]      = (half (*)[LD]) fa_smem;
    half (*sK)[KT][LD]  = (half (*)[KT][LD]) (fa_smem + RB*LD*sizeof(half));
    half (*sV)[KT][LD]  = sK + ST;
    half (*sM)[RB][KT]  = (half (*)[RB][KT]) (sV + ST);
    float (*sS)[DS][KT/2][WARP_SIZE] = (float (*)[DS][KT/2][WARP_SIZE]) (sM + ST); // SQ: [m-tile][warp][value][lane]

    ggml_cuda_pdl_sync(); // Q and this batch's K/V rows are the previous kernels' output

    const int lane = threadIdx.x % WARP_SIZE;
    const int warp = threadIdx.x / WARP_SIZE;
    const int mt   = warp / DS;    // this warp's m-tile
    const int ds   = warp % DS;    // and its part of the output columns
    const int g    = lane / 4;     // mma fragment coordinates
    const int t4   = lane % 4;

    const int tile  = blockIdx.x % p.n_tiles;
    const int hk    = (blockIdx.x / p.n_tiles) % p.n_head_kv;
    const int seq   = blockIdx.x / (p.n_tiles * p.n_head_kv);
    const int split = blockIdx.y;
    const int group = p.n_head / p.n_head_kv;
    const int n_rows = group * p.n_q;
    // query row r of this KV head: token r / group of head hk group + r % group
    auto token_of = [&](const int r) { return (int) fastdiv((uint32_t) r, p.group_div); };

    const int k_begin = split * p.keys_per_split;
    const int k_end   = min(k_begin + p.keys_per_split, p.n_kv);
    const int n_key_tiles = (k_end - k_begin + KT - 1) / KT;
    const char * kbase = p.k + hk*p.nbk2 + seq*p.nbk3;
    const char * vbase = p.v + hk*p.nbv2 + seq*p.nbv3;

    // K and V rows of key tile `it` into stage it % ST, in 16-byte pieces, keys past the slice as zeros (a zero V
    // row, not whatever follows in memory: P = 0 times a NaN would still be NaN); and the mask of the block's rows
    // (rows past n_rows: the last row's). One commit per call, also past the last tile, so that the group count
    // the loop waits on stays in step. fa_split_f16_applies: rows and the mask's rows 16-byte aligned, n_kv a
    // multiple of 8, so a piece is wholly in or out of the slice.
    auto load_tile = [&](const int it) {
        if (it < n_key_tiles) {
            const int k0 = k_begin + it*KT;
            const int s  = it % ST;
            constexpr int PIECES = KT*D/8;
#pragma unroll
            for (int j = 0; j < (PIECES + NT - 1)/NT; ++j) {
                const int i = threadIdx.x + j*NT;
                if (PIECES % NT == 0 || i < PIECES) {
                    const int  key = i / (D/8);
                    const int  c   = (i % (D/8)) * 8;
                    const bool ok  = k0 + key < k_end;
                    const int  kk  = ok ? k0 + key : k_begin;
                    fa_cp_async_16(&sK[s][key][c], kbase + (int64_t) kk*p.nbk1 + c*sizeof(half), ok);
                    fa_cp_async_16(&sV[s][key][c], vbase + (int64_t) kk*p.nbv1 + c*sizeof(half), ok);
                }
            }
            if (p.mask) {
                constexpr int MPIECES = RB*KT/8;
#pragma unroll
                for (int j = 0; j < (MPIECES + NT - 1)/NT; ++j) {
                    const int i = threadIdx.x + j*NT;
                    if (MPIECES % NT == 0 || i < MPIECES) {
                        const int  rr = i / (KT/8);
                        const int  c  = (i % (KT/8)) * 8;
                        const int  r  = min(tile*RB + rr, n_rows - 1);
                        const bool ok = k0 + c < k_end;
                        const int  t  = token_of(r);
                        const char * mrow = p.mask + t*p.nbm1 + ((hk*group + r - t*group) % p.mask_ne2)*p.nbm2 +
                                            (seq % p.mask_ne3)*p.nbm3;
                        fa_cp_async_16(&sM[s][rr][c], mrow + (int64_t) (ok ? k0 + c : k_begin)*sizeof(half), ok);
                    }
                }
            }
        }
        fa_cp_async_commit();
    };
#pragma unroll
    for (int it = 0; it < ST - 1; ++it) {
        load_tile(it);
    }

    // query rows of this block, scaled by scale * log2(e) (the softmax runs in powers of 2), as f16; rows past
    // n_rows are zeros (their scores are finite and never written out). All loads first, then the stores: one
    // wait on the memory, not one per piece.
    constexpr float LOG2E = 1.4426950408889634f;
    {
        constexpr int QPIECES = RB*D/4;
        constexpr int QPT     = (QPIECES + NT - 1)/NT;
        float4 x[QPT];
#pragma unroll
        for (int j = 0; j < QPT; ++j) {
            const int i  = threadIdx.x + j*NT;
            const int rr = i / (D/4);
            const int c  = (i % (D/4)) * 4;
            const int r  = tile*RB + rr;
            x[j] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            if ((QPIECES % NT == 0 || i < QPIECES) && r < n_rows) {
                const int t = token_of(r);
                x[j] = *(const float4 *) ((const float *) (p.q + t*p.nbq1 + (hk*group + r - t*group)*p.nbq2 +
                                                           seq*p.nbq3) + c);
            }
        }
        const float f = p.scale * LOG2E;
#pragma unroll
        for (int j = 0; j < QPT; ++j) {
            const int i = threadIdx.x + j*NT;
            if (QPIECES % NT == 0 || i < QPIECES) {
                const int rr = i / (D/4);
                const int c  = (i % (D/4)) * 4;
                *(half2 *) &sQ[rr][c]     = __floats2half2_rn(x[j].x*f, x[j].y*f);
                *(half2 *) &sQ[rr][c + 2] = __floats2half2_rn(x[j].z*f, x[j].w*f);
            }
        }
    }

    float M[2] = {-INFINITY, -INFINITY}; // running max of the rows, log2 units
    float L[2] = {0.0f, 0.0f};           // this thread's part of the running sums
    float O[DW/8][4];                    // output n-tiles of 8 columns: (g, 2 t4 + {0,1}), (g + 8, ...)
#pragma unroll
    for (int n = 0; n < DW/8; ++n) {
        O[n][0] = O[n][1] = O[n][2] = O[n][3] = 0.0f;
    }

    for (int it = 0; it < n_key_tiles; ++it) {
        const int s = it % ST;
        fa_cp_async_wait<ST - 2>(); // this thread's pieces of tile it are in ...
        __syncthreads();            // ... and everyone's; every warp is done with tile it - 1 (and sQ is written)
        load_tile(it + ST - 1);     // into the stage tile it - 1 used

        // S = Q K^T: 16 rows x 32 keys, four n-tiles of 8 keys (four independent mma chains). SQ: each warp of the
        // m-tile takes D/DS of the head dimensions and the partial scores are summed through shared memory, in the
        // same order by every warp (so all of them hold the same bits); otherwise each warp computes all of them.
        constexpr int KD = SQ ? D/DS : D;
        float S[KT/8][4];
#pragma unroll
        for (int n = 0; n < KT/8; ++n) {
            S[n][0] = S[n][1] = S[n][2] = S[n][3] = 0.0f;
        }
#pragma unroll
        for (int kb = (SQ ? ds*KD : 0); kb < (SQ ? ds*KD : 0) + KD; kb += 16) {
            uint32_t a[4];
            fa_ldmatrix(a, &sQ[mt*16 + lane % 16][kb + (lane / 16)*8]);
#pragma unroll
            for (int np = 0; np < KT/16; ++np) {
                // matrices: keys 0-7 at kb, keys 0-7 at kb+8, keys 8-15 at kb, keys 8-15 at kb+8 (of 16 np ..)
                uint32_t b[4];
                fa_ldmatrix(b, &sK[s][16*np + lane % 8 + (lane / 16)*8][kb + ((lane / 8) % 2)*8]);
                fa_mma(S[2*np],     a, b[0], b[1]);
                fa_mma(S[2*np + 1], a, b[2], b[3]);
            }
        }
        if constexpr (SQ && DS > 1) {
#pragma unroll
            for (int n = 0; n < KT/8; ++n) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    sS[mt][ds][4*n + e][lane] = S[n][e];
                }
            }
            asm volatile("bar.sync %0, %1;" :: "r"(1 + mt), "r"(DS*WARP_SIZE) : "memory"); // the m-tile's warps
#pragma unroll
            for (int n = 0; n < KT/8; ++n) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    float x = sS[mt][0][4*n + e][lane];
#pragma unroll
                    for (int w = 1; w < DS; ++w) {
                        x += sS[mt][w][4*n + e][lane];
                    }
                    S[n][e] = x;
                }
            }
        }

        // mask and keys past the slice, then the online softmax (log2 units)
        const int k0 = k_begin + it*KT;
#pragma unroll
        for (int n = 0; n < KT/8; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int key = k0 + 8*n + 2*t4 + e % 2;
                if (key >= k_end) {
                    S[n][e] = -INFINITY;
                } else if (p.mask) {
                    S[n][e] = fmaf(__half2float(sM[s][mt*16 + g + 8*(e / 2)][8*n + 2*t4 + e % 2]), LOG2E, S[n][e]);
                }
            }
        }
        uint32_t P[KT/16][4];
        fa_online_softmax(S, M, L, O, P);

        // O += P V over this warp's columns: per 16 columns, matrices keys 0-7 / keys 8-15 at column c, then
        // the same at c + 8
#pragma unroll
        for (int j = 0; j < KT/16; ++j) {
#pragma unroll
            for (int c = 0; c < DW; c += 16) {
                uint32_t b[4];
                fa_ldmatrix_trans(b, &sV[s][16*j + lane % 16][ds*DW + c + (lane / 16)*8]);
                fa_mma(O[c/8],     P[j], b[0], b[1]);
                fa_mma(O[c/8 + 1], P[j], b[2], b[3]);
            }
        }
    }
    fa_cp_async_wait<0>(); // no copy outlives the block (and no early trigger for the merge here: measured slower,
                           // docs/benchmarks.md, twenty-ninth session)

    // this block's partial result of its slice
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int r = tile*RB + mt*16 + g + 8*h;
        float * out = nullptr;
        if (r < n_rows) {
            const int t = token_of(r);
            const int64_t row_out = ((int64_t) seq*p.n_q + t)*p.n_head + hk*group + r - t*group;
            out = p.partial + (row_out*p.n_splits + split)*(D + 2);
        }
        fa_store_partial(out, M, L, O, h, t4, t4 == 0 && ds == 0, ds*DW);
    }
#else
    GGML_UNUSED(p);
    NO_DEVICE_CODE;
#endif
}

// Tiles and slices for k_fa_split_f16<D, MT, ...>: row tiles of 16 MT rows; slices of whole key tiles, as many as
// make `target_blocks` blocks in all, each at least `min_tiles` key tiles long. Sets p.n_tiles, p.n_splits,
// p.keys_per_split and p.group_div; returns the grid.
template <int MT>
static dim3 fa_split_f16_plan(fa_split_params & p, const int target_blocks, const int min_tiles) {
    const int KT = FA_SPLIT_KT;
    const int n_rows = (p.n_head / p.n_head_kv) * p.n_q;
    p.group_div = init_fastdiv_values(p.n_head / p.n_head_kv);
    p.n_tiles = (n_rows + 16*MT - 1) / (16*MT);
    const int blocks_x = p.n_tiles * p.n_head_kv * p.n_seq;
    const int key_tiles = (p.n_kv + KT - 1) / KT;
    int n_splits = std::max(1, std::min((target_blocks + blocks_x - 1) / blocks_x, key_tiles / std::max(min_tiles, 1)));
    p.keys_per_split = (key_tiles + n_splits - 1) / n_splits * KT;
    p.n_splits = (p.n_kv + p.keys_per_split - 1) / p.keys_per_split;
    return dim3(blocks_x, p.n_splits);
}
