// Hopper's warpgroup MMA (wgmma) for the Q4_K f16 kernel of qmatmul_shared.cuh (from QMH_WG_MIN_TILES column tiles,
// in builds for sm_90a: GGML_EXT_WGMMA). Where mma.sync takes a warp's 16 rows times 8 columns a k16 step, each lane
// loading its B values from shared memory, one wgmma.m64nNk16 takes a warpgroup's 64 rows times all N columns, A (each
// warp's 16 rows) from the registers the unit's decode fills as for mma.sync, B read by the tensor cores from shared
// memory through a matrix descriptor. Its results have mma.sync's bits (the same products, summed in the same k16
// order into f32; H100, every column count and 27B Q4_K shape of the lab), so a column's bits do not depend on which
// of the two ran.
//
// B: ggml-ext.h's prepared layout, whose chunks (npad columns x 8 K values, 16 bytes a column) are wgmma's 8 x 8 core
// matrices of a K-major B: k16 step st of sub-block s takes chunk 4 s + 2 st (k slots 0-7) and the next (8-15), the
// minimum's step the sums' chunk and the zeros after it.

#pragma once

#include "qmatmul_half.cuh"

#define QMH_WG_SUMS GGML_EXT_QMATMUL_HALF_CHUNK(QMM_UNIT)   // the chunk of the sub-block sums (the zeros' before it)
static_assert(QMH_WG_SUMS + 1 == GGML_EXT_QMATMUL_HALF_ZEROS, "the minimum's k slots 8-15 read the zeros");

// d (this warp's 16 rows x 8 NT columns, the m16n8 accumulator layout per column tile) += A B, one k16 step: the
// instruction of each N (sm_90a code only: qmh_wgmma)
template <int NT> static __device__ __forceinline__ void qmh_wgmma_n(float (&d)[NT][4], const uint32_t (&a)[4], uint64_t desc);

template <> __device__ __forceinline__ void qmh_wgmma_n<1>(float (&d)[1][4], const uint32_t (&a)[4], uint64_t desc) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %9, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n8k16.f32.f16.f16 {%0, %1, %2, %3}, "
                 "{%4, %5, %6, %7}, %8, p, 1, 1, 0;\n}"
                 : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1) : "memory");
}

template <> __device__ __forceinline__ void qmh_wgmma_n<2>(float (&d)[2][4], const uint32_t (&a)[4], uint64_t desc) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %13, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n16k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7}, "
                 "{%8, %9, %10, %11}, %12, p, 1, 1, 0;\n}"
                 : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1) : "memory");
}

template <> __device__ __forceinline__ void qmh_wgmma_n<3>(float (&d)[3][4], const uint32_t (&a)[4], uint64_t desc) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %17, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n24k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11}, "
                 "{%12, %13, %14, %15}, %16, p, 1, 1, 0;\n}"
                 : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1) : "memory");
}

template <> __device__ __forceinline__ void qmh_wgmma_n<4>(float (&d)[4][4], const uint32_t (&a)[4], uint64_t desc) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n32k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, "
                 "{%16, %17, %18, %19}, %20, p, 1, 1, 0;\n}"
                 : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1) : "memory");
}

template <> __device__ __forceinline__ void qmh_wgmma_n<5>(float (&d)[5][4], const uint32_t (&a)[4], uint64_t desc) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %25, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n40k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19}, "
                 "{%20, %21, %22, %23}, %24, p, 1, 1, 0;\n}"
                 : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1) : "memory");
}

template <> __device__ __forceinline__ void qmh_wgmma_n<6>(float (&d)[6][4], const uint32_t (&a)[4], uint64_t desc) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %29, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n48k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23}, "
                 "{%24, %25, %26, %27}, %28, p, 1, 1, 0;\n}"
                 : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1) : "memory");
}

template <int NT> static __device__ __forceinline__ void qmh_wgmma(float (&d)[NT][4], const uint32_t (&a)[4],
                                                                uint64_t desc) {
#ifdef __CUDA_ARCH_FEAT_SM90_ALL
    qmh_wgmma_n<NT>(d, a, desc);
#else
    GGML_UNUSED_VARS(d, a, desc);
    NO_DEVICE_CODE;
#endif
}

// The descriptor of B for one k16 step: chunk `chunk` of the unit at shared address `act` (npad columns): start
// address, leading byte offset (to the chunk of k slots 8-15: npad 16 bytes), stride byte offset (to the next 8
// columns: 128 bytes), no swizzle; addresses and offsets in 16-byte units
static __device__ __forceinline__ uint64_t qmh_wg_desc(uint32_t act, int chunk, int npad) {
    const uint32_t start = act + (uint32_t) (chunk * npad * 16);
    const uint32_t lbo = npad * 16, sbo = 128;
    return (uint64_t) ((start >> 4) & 0x3FFF) | ((uint64_t) ((lbo >> 4) & 0x3FFF)) << 16 |
           ((uint64_t) ((sbo >> 4) & 0x3FFF)) << 32;
}

// (sm_90a only: elsewhere these compile to nothing, and the kernel's WG form is never launched there)
static __device__ __forceinline__ void qmh_wg_fence() {
#ifdef __CUDA_ARCH_FEAT_SM90_ALL
    asm volatile("wgmma.fence.sync.aligned;" : : : "memory");
#endif
}

static __device__ __forceinline__ void qmh_wg_commit() {
#ifdef __CUDA_ARCH_FEAT_SM90_ALL
    asm volatile("wgmma.commit_group.sync.aligned;" : : : "memory");
#endif
}

template <int N> static __device__ __forceinline__ void qmh_wg_wait() {
#ifdef __CUDA_ARCH_FEAT_SM90_ALL
    asm volatile("wgmma.wait_group.sync.aligned %0;" : : "n"(N) : "memory");
#endif
}

// the accumulators pinned after a wait (the compiler may not move their reads above it)
template <int NT> static __device__ __forceinline__ void qmh_wg_pin(float (&d)[NT][4]) {
#pragma unroll
    for (int t = 0; t < NT; ++t) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            asm volatile("" : "+f"(d[t][i]) : : "memory");
        }
    }
}

// whether every thread of this warp's warpgroup (128 threads, named barrier 1 + its index) has p
static __device__ __forceinline__ bool qmh_wg_all(bool p, int warpgroup) {
    uint32_t r;
    asm volatile("{\n.reg .pred q, o;\nsetp.ne.u32 q, %1, 0;\nbar.red.and.pred o, %2, 128, q;\nselp.u32 %0, 1, 0, o;\n}"
                 : "=r"(r) : "r"((uint32_t) p), "r"(1 + warpgroup) : "memory");
    return r != 0;
}

// registers pinned after a wait: the compiler may neither move their reads above it nor reuse them before it (an
// MMA still running reads its A registers and writes its accumulators)
template <int N> static __device__ __forceinline__ void qmh_wg_pin_u(uint32_t (&r)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) {
        asm volatile("" : "+r"(r[i]) : : "memory");
    }
}

// The Q4_K weights of a unit (RT = 1) and its minimum times B in the wgmma layout at shared address act: as
// qmh_q4_k_weights, a batch of 4 k16 steps (sub-blocks 2j, 2j + 1) decoded, then its MMAs issued together and left
// running while the next batch decodes; a batch's A registers pinned once the wait after the next batch says it is
// done, and the unit drained at its end
template <bool FOLD, int NT>
static __device__ __forceinline__ void qmh_q4_k_weights_wg(const char * const (&rows)[2], uint32_t act, int npad, int t4,
                                                           const uint32_t (&dsc)[2][4], uint32_t (&amin)[4],
                                                           float (&acc)[NT][4]) {
    uint32_t a[4][16];   // [j][4 (2 e + step) + register]
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        uint2 qs[2];
        uint32_t nms[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            qs[h]  = *(const uint2 *) (rows[h] + 16 + 32 * j + 8 * t4);
            nms[h] = qmh_q4_k_nms<FOLD>(dsc[h][j]);
        }
#pragma unroll
        for (int e = 0; e < 2; ++e) {
#pragma unroll
            for (int step = 0; step < 2; ++step) {
                uint32_t * as = &a[j][4 * (2 * e + step)];
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    qmh_q4_k_a<FOLD>(step ? qs[h].y : qs[h].x, e, dsc[h][j], nms[h], as[h], as[h + 2]);
                }
            }
        }
        qmh_wg_fence();
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const uint32_t (&ai)[4] = *(const uint32_t (*)[4]) &a[j][4 * i];
            qmh_wgmma<NT>(acc, ai, qmh_wg_desc(act, 8 * j + 2 * i, npad));   // sub-block 2j + i / 2, step i % 2
        }
        if (j == 3) {   // the minimum: -dmin * m (k slots 0-7) times the sub-block sums
            qmh_wgmma<NT>(acc, amin, qmh_wg_desc(act, QMH_WG_SUMS, npad));
        }
        qmh_wg_commit();
        if (j > 0) {
            qmh_wg_wait<1>();
            qmh_wg_pin_u(a[j - 1]);
        }
    }
    qmh_wg_wait<0>();
    qmh_wg_pin_u(a[3]);
    qmh_wg_pin_u(amin);
    qmh_wg_pin<NT>(acc);
}

// One Q4_K unit of this warp's 16 rows through wgmma (as qmh_unit_q4_k, RT = 1); every warp of the warpgroup calls it
template <int NT>
static __device__ __forceinline__ void qmh_unit_q4_k_wg(const char * const (&rows)[2], uint32_t act, int npad, int t4,
                                                        int warpgroup, float (&acc)[NT][4]) {
    uint32_t dsc[2][4];
    uint32_t amin[4] = {0u, 0u, 0u, 0u};   // (k slots 8-15 zero)
    bool small = true;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const half2 dm = qmh_q4_k_scales(rows[h], t4, dsc[h], amin[h]);
        small = small && fabsf(__low2float(dm)) < 1.0f;
    }
    if (qmh_wg_all(small, warpgroup)) {   // (wgmma: one path for the whole warpgroup)
        qmh_q4_k_weights_wg<true, NT>(rows, act, npad, t4, dsc, amin, acc);
    } else {
        qmh_q4_k_weights_wg<false, NT>(rows, act, npad, t4, dsc, amin, acc);
    }
}
