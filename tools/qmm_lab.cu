// A kernel lab for ggml_qmatmul's one-column path, without building pydflash: one nvcc call on the GPU machine
// (seconds, where the whole build takes minutes), then the streaming kernel (ggml_ext/cuda/qmatmul_stream.cuh) at
// several of its shapes (warps per block, stages per warp) against the tensor-core
// kernel it must match to the bit (qmatmul_mma.cuh) and against a plain read of the same bytes. Set
// QMM_LAB_PROFILE=1 to run each kernel once, untimed, under Nsight Compute.
//
//   nvcc -std=c++17 -O3 -arch=sm_90a -o /tmp/qmm_lab tools/qmm_lab.cu -DGGML_USE_CUDA \
//        -Iggml_ext/include -Iggml_ext/cuda -I$GGML/include -I$GGML/src -I$GGML/src/ggml-cuda
//   /tmp/qmm_lab [shape ...]        (shapes: the names in SHAPES below; default all)
//
// QMM_LAB_SHARED=1 with QMM_LAB_COLS: the f16 kernel of qmatmul_shared.cuh (Q4_K and Q6_K shapes) at each column
// count, in the shape ggml_qmatmul runs and two others (warps, stages, K units a stage, blocks per SM), beside the
// best of qmm_mma / its staged form (and the streaming kernel at one column), on the same activation values rounded
// to f16; checking that its column 0 has the same bits at every N and how far it is from qmm_mma's result (the f16
// roundings of the weights and activations); and where one call's time goes (QMH_TRACE: the CUDA blocks' start,
// first stage in, last item done, exit, and each warp's last item, us from the first start: median and latest).
// QMM_LAB_WARPS=1 also times tiles of 8 and 6 warps at two blocks an SM and of 12 and 10 at one, QMM_LAB_STAGES=1
// tiles of 6, 8 and 12 warps with three stages at one block an SM, QMM_LAB_UNITS1=1 8-warp tiles of one K unit a
// stage in 3 or 4 stages;
// QMM_LAB_WG=1 (Q4_K; built with -arch=sm_90a) the run shape with its MMAs as wgmma at every column count
// (qmatmul_wgmma.cuh; checked for the run's bits); QMM_LAB_RT2=1 the run shape's block rows as two 16-row tiles a
// warp in half the warps (the same cut: a column's bits are the run shape's, checked). With QMM_LAB_ADD=1 the shape
// ggml_qmatmul runs is also timed with a residual added as its outputs are stored (checked: the sum of the plain
// result and the residual, bit for bit). QMM_LAB_GLU=1 also times that shape's GLU form (Q4_K matrices of 2F rows, F a multiple of
// 256: ggml_qmatmul_swiglu_prepared's gate/up product) with and without the run sums, untested for its values here
// (tests/test_qmatmul_prepared.py). QMM_LAB_PREFETCH=1 times the run shape launched as ggml_ext launches it
// (programmatic dependent launch, each call letting the next launch early), alone, with an idle kernel node before
// each call, and with a node that asks the L2 for the call's first stages of weights while the previous call ends
// (docs/benchmarks.md, twenty-ninth session: the prefetch made every shape slower).
//
// QMM_LAB_COLS=1,8,23,48 times the tensor-core kernel instead, at those column counts and each row-tile count,
// checking that a column's result does not depend on how many columns come with it (and from 9 columns, at 1 and 2
// row tiles, the staged kernel of qmatmul_staged.cuh beside it, checked against its bits); built with
// -DQMM_LAB_BASELINE='"old.cuh"' (an earlier qmatmul_mma.cuh with qmm_ renamed qmmold_ and mma_s8_ mmaold_s8_) it
// also runs that kernel beside it and checks the two agree to the bit.
//
// Weights are random bytes with sane f16 scales (the kernels' speed does not depend on the values), tiled over
// enough copies (>= 400 MB) that every timed call reads DRAM, not the 50 MB L2; each kernel runs in a CUDA graph
// of one launch per copy; the time is the median over repetitions, per launch.

#include "qmatmul_staged.cuh"
#define QMH_TRACE   // the f16 kernel records when each CUDA block starts, gets its first stage, ends its items, exits
#include "qmatmul_shared.cuh"
#ifdef QMM_LAB_BASELINE
#include QMM_LAB_BASELINE
#endif

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "lab_ggml_stubs.cuh"

#define QMM_LAB_SMEM_OPTIN (227 * 1024)   // the shared memory an H100 (or H200) block may opt in to

struct shape { const char * name; int K, M; ggml_type type; };
static const shape SHAPES[] = {
    {"ffn_gate_up", 5120, 34816, GGML_TYPE_Q4_K},
    {"gdn_qkv_z_ba", 5120, 16480, GGML_TYPE_Q4_K},
    {"attn_qk",     5120, 13312, GGML_TYPE_Q4_K},
    {"gdn_out",     6144,  5120, GGML_TYPE_Q4_K},
    {"ffn_down",   17408,  5120, GGML_TYPE_Q6_K},
    {"lm_head",     5120, 248320, GGML_TYPE_Q6_K},
    {"attn_v",      5120,  1024, GGML_TYPE_Q6_K},
    {"ffn_up_q5k",  5120, 17408, GGML_TYPE_Q5_K},
};

static bool profile = getenv("QMM_LAB_PROFILE") != nullptr;   // one call per kernel, no timing (for ncu)

static uint64_t rng = 0x9E3779B97F4A7C15ull;
static uint32_t rnd() { rng ^= rng << 13; rng ^= rng >> 7; rng ^= rng << 17; return (uint32_t) rng; }

static int block_bytes(ggml_type t) {
    return t == GGML_TYPE_Q4_K ? 144 : t == GGML_TYPE_Q5_K ? 176 : 210;
}

static void fill_weights(std::vector<char> & w, ggml_type t, size_t n_blocks) {
    const int bs = block_bytes(t);
    uint32_t * p = (uint32_t *) w.data();
    for (size_t i = 0; i < w.size() / 4; ++i) p[i] = rnd();
    for (size_t b = 0; b < n_blocks; ++b) {
        char * blk = w.data() + b * bs;
        const half d = __float2half(0.001f + 0.01f * (rnd() % 1000) / 1000.0f);
        const half m = __float2half(0.001f + 0.01f * (rnd() % 1000) / 1000.0f);
        if (t == GGML_TYPE_Q6_K) {
            memcpy(blk + 208, &d, 2);
        } else {
            memcpy(blk, &d, 2);
            memcpy(blk + 2, &m, 2);
        }
    }
}

// the shape's weights, random, in enough copies (>= 400 MB) that every timed call reads DRAM
static std::vector<const char *> weight_copies(const shape & sh, size_t & bytes) {
    const int nb = sh.K / QK_K;
    bytes = (size_t) sh.M * nb * block_bytes(sh.type);
    std::vector<char> hw(bytes);
    fill_weights(hw, sh.type, (size_t) sh.M * nb);
    std::vector<const char *> Ws(std::max<size_t>(1, (400u << 20) / bytes + 1));
    for (const char * & w : Ws) {
        char * d;
        CK(cudaMalloc(&d, bytes));
        CK(cudaMemcpy(d, hw.data(), bytes, cudaMemcpyHostToDevice));
        w = d;
    }
    return Ws;
}

// quantised activations as qmm_quantize_x lays them out, npad columns of which the first n_cols random (the rest 0)
static void random_activations(int K, int npad, int n_cols, int8_t * & yq, float2 * & yds) {
    std::vector<int8_t> hq((size_t) npad * K, 0);
    std::vector<float2> hds((size_t) K / QK8_1 * npad, make_float2(0, 0));
    for (int col = 0; col < n_cols; ++col) {
        for (int kb = 0; kb < K / QK8_1; ++kb) {
            int s = 0;
            for (int i = 0; i < QK8_1; ++i) {
                const int v = (int) (rnd() % 255) - 127;
                hq[(size_t) col * K + kb * QK8_1 + i] = (int8_t) v;
                s += v;
            }
            const float d = 0.001f + 0.05f * (rnd() % 1000) / 1000.0f;
            hds[(size_t) kb * npad + col] = make_float2(d, d * s);
        }
    }
    CK(cudaMalloc(&yq, hq.size()));
    CK(cudaMalloc(&yds, hds.size() * sizeof(float2)));
    CK(cudaMemcpy(yq, hq.data(), hq.size(), cudaMemcpyHostToDevice));
    CK(cudaMemcpy(yds, hds.data(), hds.size() * sizeof(float2), cudaMemcpyHostToDevice));
}

// One shape's test bench: its weight copies, npad activation columns (qmm_quantize_x's layout) of which the first
// n_cols random, and an output buffer of npad columns; freed with it
struct lab_case {
    size_t bytes;                       // of one weight copy
    std::vector<const char *> Ws;
    int npad;
    int8_t * yq;
    float2 * yds;
    float * dst;
    const shape & sh;
    cudaStream_t st;

    lab_case(const shape & sh_, int npad_, int n_cols, cudaStream_t st_) : npad(npad_), sh(sh_), st(st_) {
        Ws = weight_copies(sh, bytes);
        random_activations(sh.K, npad, n_cols, yq, yds);
        CK(cudaMalloc(&dst, (size_t) sh.M * 4 * npad));
    }
    ~lab_case() {
        for (const char * w : Ws) CK(cudaFree((void *) w));
        CK(cudaFree(yq));
        CK(cudaFree(yds));
        CK(cudaFree(dst));
    }

    // the first N columns launch() writes into dst (poisoned before)
    template <typename F> std::vector<float> output(int N, F launch) const {
        CK(cudaMemset(dst, 0xFF, (size_t) sh.M * 4 * npad));
        launch();
        CK(cudaStreamSynchronize(st));
        CK(cudaGetLastError());
        std::vector<float> out((size_t) sh.M * N);
        CK(cudaMemcpy(out.data(), dst, out.size() * 4, cudaMemcpyDeviceToHost));
        return out;
    }
};

static __global__ void read_kernel(const uint4 * p, size_t n, unsigned * out) {
    unsigned x = 0;
    for (size_t i = blockIdx.x * (size_t) blockDim.x + threadIdx.x; i < n; i += (size_t) gridDim.x * blockDim.x) {
        const uint4 v = p[i];
        x ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (x == 0x12345678u) out[0] = x;   // keeps the loads
}

struct candidate { std::string name; double us; bool same; };

// the streaming kernel: NW warps per block (a ring of S stages each), persistent
template <ggml_type type, int NW, int S>
static void run_stream(const qms_args & a, int n_sm, cudaStream_t st) {
    const size_t smem = qms_smem_bytes<NW, S>(a);
    int per_sm = 0;
    CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, qms_gemv<type, NW, S>, WARP_SIZE * NW, smem));
    const int n_groups = (a.M + QMS_WARP_ROWS - 1) / QMS_WARP_ROWS;
    const int grid = std::min((n_groups + NW - 1) / NW, std::max(1, per_sm) * n_sm);
    qms_gemv<type, NW, S><<<grid, WARP_SIZE * NW, smem, st>>>(a);
}

template <ggml_type type, int NW, int S>
static void try_stream(std::vector<candidate> & out, qms_args a, const std::vector<const char *> & Ws, float * dst,
                      const std::vector<float> & ref, int n_sm, cudaStream_t st) {
    a.chunk = 8;
    a.pitch = qms_pitch<type>(8);
    const size_t smem = qms_smem_bytes<NW, S>(a);
    if (smem > 227 * 1024) return;
    CK(cudaFuncSetAttribute(qms_gemv<type, NW, S>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int) smem));
    int per_sm = 0;
    CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, qms_gemv<type, NW, S>, WARP_SIZE * NW, smem));
    char name[96];
    snprintf(name, sizeof name, "W%d S%d (%d/SM, %zu KB)", NW, S, per_sm, smem / 1024);
    CK(cudaMemset(dst, 0, ref.size() * 4));
    a.W = Ws[0];
    run_stream<type, NW, S>(a, n_sm, st);
    CK(cudaStreamSynchronize(st));
    CK(cudaGetLastError());
    std::vector<float> got(ref.size());
    CK(cudaMemcpy(got.data(), dst, got.size() * 4, cudaMemcpyDeviceToHost));
    const bool same = memcmp(got.data(), ref.data(), got.size() * 4) == 0;
    const double us = profile ? 0.0 : time_graph([&](int c) {
        qms_args b = a; b.W = Ws[c]; run_stream<type, NW, S>(b, n_sm, st);
    }, (int) Ws.size(), st);
    out.push_back({name, us, same});
}

// the tensor-core kernel (old: the baseline's, when built with one)
template <ggml_type type, int NT, int RT> static void mma_launch(const qmm_args & q, bool old, cudaStream_t st) {
    const dim3 grid((q.M + QMM_MMA_ROWS * RT - 1) / (QMM_MMA_ROWS * RT)), block(WARP_SIZE, QMM_MMA_WARPS);
#ifdef QMM_LAB_BASELINE
    if (old) {
        qmmold_mma<type, NT, RT><<<grid, block, 0, st>>>(q.W, q.yq, q.yds, q.dst, q.nb, q.K, q.M, q.N, q.npad,
                                                         q.stride_col_dst);
        return;
    }
#endif
    GGML_UNUSED(old);
    qmm_mma<type, NT, RT><<<grid, block, 0, st>>>(q.W, q.yq, q.yds, q.dst, q.nb, q.K, q.M, q.N, q.npad,
                                                  q.stride_col_dst, nullptr, 0);
}

template <ggml_type type> static void run_shape(const shape & sh, int n_sm, double read_gbs, cudaStream_t st) {
    const int nb = sh.K / QK_K;
    const lab_case lc(sh, 8, 1, st);
    const std::vector<const char *> & Ws = lc.Ws;
    const size_t bytes = lc.bytes;
    const int copies = (int) Ws.size(), npad = lc.npad;
    int8_t * const yq = lc.yq;
    float2 * const yds = lc.yds;
    float * const dst = lc.dst;

    // the reference: the tensor-core kernel at one column tile, one row tile
    qmm_args m = {Ws[0], yq, yds, dst, nb, sh.K, sh.M, 1, npad, sh.M};
    auto mma = [&](const qmm_args & q) { mma_launch<type, 1, 1>(q, false, st); };
    const std::vector<float> ref = lc.output(1, [&] { mma(m); });
    std::vector<candidate> cands;
    cands.push_back({"read (same bytes)", time_graph([&](int c) {
        read_kernel<<<n_sm * 8, 256, 0, st>>>((const uint4 *) Ws[c], bytes / 16, (unsigned *) dst);
    }, copies, st), true});
    cands.push_back({"mma", profile ? 0.0 : time_graph([&](int c) { qmm_args q = m; q.W = Ws[c]; mma(q); }, copies, st), true});
    qms_args a = {Ws[0], yq, yds, dst, nb, sh.M, npad, 8, 0};
    // (W, S): warps per block, stages per warp
    try_stream<type, 2, 3>(cands, a, Ws, dst, ref, n_sm, st);
    try_stream<type, 3, 2>(cands, a, Ws, dst, ref, n_sm, st);
    try_stream<type, 4, 2>(cands, a, Ws, dst, ref, n_sm, st);
    try_stream<type, 4, 3>(cands, a, Ws, dst, ref, n_sm, st);
    try_stream<type, 6, 2>(cands, a, Ws, dst, ref, n_sm, st);
    try_stream<type, 6, 3>(cands, a, Ws, dst, ref, n_sm, st);
    try_stream<type, 8, 2>(cands, a, Ws, dst, ref, n_sm, st);
    try_stream<type, 10, 2>(cands, a, Ws, dst, ref, n_sm, st);
    try_stream<type, 12, 2>(cands, a, Ws, dst, ref, n_sm, st);
    try_stream<type, 16, 2>(cands, a, Ws, dst, ref, n_sm, st);
    printf("%s %dx%d %s, %.1f MB, %d copies (read bandwidth %.0f GB/s):\n", sh.name, sh.M, sh.K,
           type == GGML_TYPE_Q4_K ? "Q4_K" : type == GGML_TYPE_Q5_K ? "Q5_K" : "Q6_K", bytes / 1e6, copies, read_gbs);
    for (const candidate & c : cands) {
        printf("  %-14s %8.1f us %7.0f GB/s %5.1f%% of read  %s\n", c.name.c_str(), c.us, bytes / c.us / 1e3,
               100.0 * bytes / c.us / 1e3 / read_gbs, c.same ? "bit-identical" : "DIFFERS");
    }
    fflush(stdout);
}

// --- Several columns: the tensor-core kernel ----------------------------------------------------------------------

template <ggml_type type, int NT> static void mma_rt(const qmm_args & q, int rt, bool old, cudaStream_t st) {
    rt == 1 ? mma_launch<type, NT, 1>(q, old, st) : rt == 2 ? mma_launch<type, NT, 2>(q, old, st)
            : mma_launch<type, NT, 4>(q, old, st);
}

template <ggml_type type> static void mma_any(const qmm_args & q, int rt, bool old, cudaStream_t st) {
    switch ((q.N + 7) / 8) {
        case 1: mma_rt<type, 1>(q, rt, old, st); break;
        case 2: mma_rt<type, 2>(q, rt, old, st); break;
        case 3: mma_rt<type, 3>(q, rt, old, st); break;
        case 4: mma_rt<type, 4>(q, rt, old, st); break;
        case 5: mma_rt<type, 5>(q, rt, old, st); break;
        default: mma_rt<type, 6>(q, rt, old, st); break;
    }
}

// the activations' first 8 nt columns in the staged kernel's layout (qmatmul_staged.cuh; qmm_quantize_x with halves)
struct staged_x { int8_t * yqh; float2 * yds; };
static staged_x staged_layout(const int8_t * yq, const float2 * yds, int K, int npad, int nt) {
    std::vector<int8_t> h((size_t) npad * K), o((size_t) 8 * nt * K);
    std::vector<float2> hd((size_t) K / QK8_1 * npad), od((size_t) K / QK8_1 * 8 * nt);
    CK(cudaMemcpy(h.data(), yq, h.size(), cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(hd.data(), yds, hd.size() * sizeof(float2), cudaMemcpyDeviceToHost));
    for (int kb = 0; kb < K / QK8_1; ++kb) {
        for (int c = 0; c < 8 * nt; ++c) {
            memcpy(&o[((size_t) (kb / 4) * 8 * nt + c) * 128 + 32 * ((kb % 4 + c) % 4)], &h[(size_t) c * K + kb * 32], 32);
            od[(size_t) kb * 8 * nt + c] = hd[(size_t) kb * npad + c];
        }
    }
    staged_x d;
    CK(cudaMalloc(&d.yqh, o.size()));
    CK(cudaMalloc(&d.yds, od.size() * sizeof(float2)));
    CK(cudaMemcpy(d.yqh, o.data(), o.size(), cudaMemcpyHostToDevice));
    CK(cudaMemcpy(d.yds, od.data(), od.size() * sizeof(float2), cudaMemcpyHostToDevice));
    return d;
}

// the staged kernel at q.N columns (q.yq, q.yds: in its layout) and rt row tiles
template <ggml_type type> static void staged_run(const qmm_args & q, int rt, cudaStream_t st) {
    qmm_staged_run<type>(q, (q.N + 7) / 8, rt, 0, st);
}

template <ggml_type type> static void run_cols(const shape & sh, const std::vector<int> & cols, cudaStream_t st) {
    const int nb = sh.K / QK_K;
    const lab_case lc(sh, 48, 48, st);   // a call with N columns reads the first N (npad stays 48)
    const std::vector<const char *> & Ws = lc.Ws;
    const size_t bytes = lc.bytes;
    const int copies = (int) Ws.size(), npad = lc.npad;
    int8_t * const yq = lc.yq;
    float2 * const yds = lc.yds;
    float * const dst = lc.dst;
    auto result = [&](const qmm_args & q, int rt, bool old) {
        return lc.output(q.N, [&] { mma_any<type>(q, rt, old, st); });
    };
    const qmm_args one = {Ws[0], yq, yds, dst, nb, sh.K, sh.M, 1, npad, sh.M};
    const std::vector<float> col0 = result(one, 1, false);   // column 0 alone: every other call must give its bits
    printf("%s %dx%d %s, %.1f MB, %d copies (us per call; bits: column 0 as alone%s)\n", sh.name, sh.M, sh.K,
           type == GGML_TYPE_Q4_K ? "Q4_K" : type == GGML_TYPE_Q5_K ? "Q5_K" : "Q6_K", bytes / 1e6, copies,
#ifdef QMM_LAB_BASELINE
           ", every column as the baseline's"
#else
           ""
#endif
    );
    for (int N : cols) {
        staged_x sx = {};   // the staged kernel's activations (N > 8), laid out once per column count
        if (N > 8) {
            sx = staged_layout(yq, yds, sh.K, npad, (N + 7) / 8);
        }
        for (int rt : {1, 2, 4}) {
            const qmm_args q = {Ws[0], yq, yds, dst, nb, sh.K, sh.M, N, npad, sh.M};
            const std::vector<float> got = result(q, rt, false);
            bool same = memcmp(got.data(), col0.data(), col0.size() * 4) == 0;
            double old_us = 0.0;
#ifdef QMM_LAB_BASELINE
            const std::vector<float> base = result(q, rt, true);
            same = same && memcmp(got.data(), base.data(), got.size() * 4) == 0;
            old_us = time_graph([&](int c) { qmm_args b = q; b.W = Ws[c]; mma_any<type>(b, rt, true, st); }, copies, st);
#endif
            const double us = time_graph([&](int c) { qmm_args b = q; b.W = Ws[c]; mma_any<type>(b, rt, false, st); }, copies, st);
            printf("  N=%2d rt=%d  %8.1f us", N, rt, us);
            if (old_us > 0.0) printf("  (baseline %8.1f us)", old_us);
            printf("  %s\n", same ? "bit-identical" : "DIFFERS");
            if (N > 8 && rt <= 2) {   // the staged kernel (qmatmul_staged.cuh), with the same row tiles
                qmm_args sq = q;
                sq.yq   = sx.yqh;
                sq.yds  = sx.yds;
                sq.npad = 8 * ((N + 7) / 8);
                const std::vector<float> sg = lc.output(N, [&] { staged_run<type>(sq, rt, st); });
                const bool ssame = memcmp(sg.data(), got.data(), got.size() * 4) == 0;
                const double sus = time_graph([&](int c) { qmm_args b = sq; b.W = Ws[c]; staged_run<type>(b, rt, st); }, copies, st);
                printf("         staged  %8.1f us  %s\n", sus, ssame ? "bit-identical" : "DIFFERS");
            }
        }
        if (N > 8) {
            CK(cudaFree(sx.yqh));
            CK(cudaFree(sx.yds));
        }
    }
    fflush(stdout);
}

// QMM_LAB_PREFETCH=1: a small kernel between two calls that may run beside the first one's last blocks (launched
// programmatically, which the f16 kernel's blocks, filling an SM's registers, cannot) and asks the L2 for the next
// call's first `stages` items of weights, block by block as the f16 kernel cuts them (prefetch false: the same node
// doing nothing, for what the node itself costs). Its end implies the end of the kernel before it, so the call after
// it, waiting on it, still waits for that one.
static __global__ void prefetch_first_stages(const char * W, int64_t row_bytes, int ub, int rows, int U, int units,
                                             int M, int P, int stages, bool prefetch) {
    ggml_cuda_pdl_lc();   // the call after us may launch at once
    if (prefetch) {
        const int n_stages = (units + U - 1) / U;
        const int items = (M + rows - 1) / rows * n_stages;
        const int64_t total = (M * row_bytes) & ~(int64_t) 15;
        const int j0 = (int) qmh_first_item(blockIdx.x, items, P), j1 = (int) qmh_first_item(blockIdx.x + 1, items, P);
        for (int j = j0; j < min(j0 + stages, j1); ++j) {
            const int tile = j / n_stages, st = j % n_stages, su = min(U, units - U * st);
            for (int r = threadIdx.x; r < rows && tile * rows + r < M; r += blockDim.x) {
                const int64_t at = (tile * rows + r) * row_bytes + (int64_t) st * U * ub;
                const int64_t a0 = at & ~(int64_t) 15, a1 = min(total, (at + su * ub + 15) & ~(int64_t) 15);
                if (a1 > a0) {
                    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" : : "l"(W + a0), "r"((int) (a1 - a0)) : "memory");
                }
            }
        }
    }
    ggml_cuda_pdl_sync();
}

// --- Several columns: the f16 kernel of qmatmul_shared.cuh against the best of the others -------------------

template <ggml_type type, int NT, int RT, int NW, int S, int U, int MB, bool GLU = false, bool WG = false>
static void shared_launch(const qmh_args & a, int P, cudaStream_t st) {
    constexpr size_t smem = qmh_smem_bytes<type, NT, RT, NW, S, U>();
    if (smem > QMM_LAB_SMEM_OPTIN) {
        printf("(%zu bytes of shared memory: not run) ", smem);
        return;
    }
    static bool set = false;
    if (!set) {
        CK(cudaFuncSetAttribute(qmm_half_shared<type, NT, RT, NW, S, U, MB, GLU, WG>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int) smem));
        set = true;
    }
    qmm_half_shared<type, NT, RT, NW, S, U, MB, GLU, WG><<<P, dim3(WARP_SIZE, NW), smem, st>>>(a);
}

template <ggml_type type, int RT, int NW, int S, int U, int MB, bool GLU = false, bool WG = false>
static void shared_any(const qmh_args & a, int P, cudaStream_t st) {
    switch (a.npad / 8) {
        case 1: shared_launch<type, 1, RT, NW, S, U, MB, GLU, WG>(a, P, st); break;
        case 2: shared_launch<type, 2, RT, NW, S, U, MB, GLU, WG>(a, P, st); break;
        case 3: shared_launch<type, 3, RT, NW, S, U, MB, GLU, WG>(a, P, st); break;
        case 4: shared_launch<type, 4, RT, NW, S, U, MB, GLU, WG>(a, P, st); break;
        case 5: shared_launch<type, 5, RT, NW, S, U, MB, GLU, WG>(a, P, st); break;
        default: shared_launch<type, 6, RT, NW, S, U, MB, GLU, WG>(a, P, st); break;
    }
}

// the int8 activations (yq, yds as qmm_quantize_x lays them out) as the f16 ones of qmatmul_half.cuh: the same
// values d * q, rounded to f16, and their sub-block sums, for the first 8 nt columns
static half * half_layout(const int8_t * yq, const float2 * yds, int K, int npad, int nt) {
    std::vector<int8_t> h((size_t) npad * K);
    std::vector<float2> hd((size_t) K / QK8_1 * npad);
    CK(cudaMemcpy(h.data(), yq, h.size(), cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(hd.data(), yds, hd.size() * sizeof(float2), cudaMemcpyDeviceToHost));
    const int np = 8 * nt;
    std::vector<half> o((size_t) K / QK_K * np * QMH_HALF_PITCH, __float2half(0.0f));
    for (int u = 0; u < K / QK_K; ++u) {
        half * unit = &o[(size_t) u * np * QMH_HALF_PITCH];   // (ggml-ext.h's prepared layout)
        for (int c = 0; c < np; ++c) {
            for (int s = 0; s < 8; ++s) {
                const int kb = 8 * u + s;
                float sum = 0.0f;
                for (int i = 0; i < 32; ++i) {
                    const half v = __float2half(hd[(size_t) kb * npad + c].x * h[(size_t) c * K + kb * 32 + i]);
                    unit[GGML_EXT_QMATMUL_HALF_AT(32 * s + i, c, np)] = v;
                    sum += __half2float(v);
                }
                unit[GGML_EXT_QMATMUL_HALF_AT(QK_K + s, c, np)] = __float2half(sum);
            }
        }
    }
    half * d;
    CK(cudaMalloc(&d, o.size() * sizeof(half)));
    CK(cudaMemcpy(d, o.data(), o.size() * sizeof(half), cudaMemcpyHostToDevice));
    return d;
}

template <ggml_type type> static void run_shared(const shape & sh, const std::vector<int> & cols, int n_sm, cudaStream_t st) {
    static_assert(type == GGML_TYPE_Q4_K || type == GGML_TYPE_Q6_K, "the f16 kernel's types");
    const int nb = sh.K / QK_K;
    const lab_case lc(sh, 48, 48, st);
    const std::vector<const char *> & Ws = lc.Ws;
    const size_t bytes = lc.bytes;
    const int copies = (int) Ws.size(), npad = lc.npad;
    int8_t * const yq = lc.yq;
    float2 * const yds = lc.yds;
    float * const dst = lc.dst;
    float * ws;
    CK(cudaMalloc(&ws, (size_t) 2 * n_sm * 2 * 16 * 2 * 6 * 4 * WARP_SIZE * sizeof(float)));
    const double gb = bytes / 1e3;
    printf("%s %dx%d %s, %.1f MB, %d copies (us per call, GB/s of weights)\n", sh.name, sh.M, sh.K,
           type == GGML_TYPE_Q4_K ? "Q4_K" : type == GGML_TYPE_Q5_K ? "Q5_K" : "Q6_K", bytes / 1e6, copies);
    std::vector<std::vector<float>> col0(16);   // the shared kernel's column 0 at N = 1, per variant
    for (int N : cols) {
        const int nt = (N + 7) / 8;
        // the best of the others
        double best = 1e30;
        const char * best_name = "";
        std::vector<float> ref;
        for (int rt : {1, 2, 4}) {
            const qmm_args q = {Ws[0], yq, yds, dst, nb, sh.K, sh.M, N, npad, sh.M};
            if (ref.empty()) ref = lc.output(N, [&] { mma_any<type>(q, rt, false, st); });
            const double us = profile ? 0.0 : time_graph([&](int c) { qmm_args b = q; b.W = Ws[c]; mma_any<type>(b, rt, false, st); }, copies, st);
            if (us < best) { best = us; best_name = rt == 1 ? "mma rt1" : rt == 2 ? "mma rt2" : "mma rt4"; }
        }
        staged_x sx = staged_layout(yq, yds, sh.K, npad, nt);
        if (nt >= 2) {
            for (int rt : {1, 2}) {
                qmm_args sq = {Ws[0], sx.yqh, sx.yds, dst, nb, sh.K, sh.M, N, 8 * nt, sh.M};
                const double us = profile ? 0.0 : time_graph([&](int c) { qmm_args b = sq; b.W = Ws[c]; staged_run<type>(b, rt, st); }, copies, st);
                if (us < best) { best = us; best_name = rt == 1 ? "staged rt1" : "staged rt2"; }
            }
        } else {
            qmm_args q = {Ws[0], yq, yds, dst, nb, sh.K, sh.M, 1, npad, sh.M};
            const double us = profile ? 0.0 : time_graph([&](int c) { qmm_args b = q; b.W = Ws[c]; qms_run<type>(b, 0, st); }, copies, st);
            if (us < best) { best = us; best_name = "stream"; }
        }
        printf("  N=%2d  best other %-10s %7.1f us %5.0f GB/s\n", N, best_name, best, gb / best);
        int v = 0;
        half * hx = half_layout(yq, yds, sh.K, npad, nt);
        auto variant = [&](const char * name, int per_sm, int block_rows, int U, auto launch) {
            qmh_args a = {Ws[0], hx, dst, nb, sh.K, sh.M, N, 8 * nt, sh.M, nullptr, 0, ws};
            const int P = qmh_grid_of((int64_t) (sh.M + block_rows - 1) / block_rows * (sh.K / QK_K / U),
                                      (int64_t) n_sm * per_sm);   // (as ggml_qmatmul's grid)
            const std::vector<float> got = lc.output(N, [&] { launch(a, P); });
            if (N == cols[0]) col0[v] = std::vector<float>(got.begin(), got.begin() + sh.M);
            const bool same = memcmp(got.data(), col0[v].data(), (size_t) sh.M * 4) == 0;
            double maxdiff = 0.0, maxref = 0.0;
            for (size_t i = 0; i < got.size(); ++i) {
                const double d = fabs((double) got[i] - ref[i]);
                if (!(d <= maxdiff)) maxdiff = d;   // (NaN counts)
                maxref = std::max(maxref, fabs((double) ref[i]));
            }
            const double maxrel = maxdiff / maxref;
            const double us = profile ? 0.0 : time_graph([&](int c) { qmh_args b = a; b.W = Ws[c]; launch(b, P); }, copies, st);
            printf("        shared %-9s %7.1f us %5.0f GB/s  %.2fx best  col0 %s  max |diff| / max |mma| %.1e%s\n", name, us,
                   gb / us, us / best, same ? "same bits" : "DIFFERS", maxrel,
                   v > 0 && memcmp(got.data(), col0[0].data(), (size_t) sh.M * 4) == 0 ? "  (the run's bits)" : "");
            if (v == 0 && getenv("QMM_LAB_ADD") != nullptr) {   // with a residual added as the outputs are stored
                std::vector<float> r((size_t) sh.M * N);
                for (float & e : r) e = (float) (rnd() % 2001) / 1000.0f - 1.0f;
                float * radd;
                CK(cudaMalloc(&radd, r.size() * 4));
                CK(cudaMemcpy(radd, r.data(), r.size() * 4, cudaMemcpyHostToDevice));
                qmh_args b = a;
                b.add = radd;
                b.stride_col_add = sh.M;
                const std::vector<float> with = lc.output(N, [&] { launch(b, P); });
                bool exact = true;
                for (size_t i = 0; i < r.size(); ++i) exact &= with[i] == got[i] + r[i];
                const double aus = profile ? 0.0 : time_graph([&](int c) { qmh_args e = b; e.W = Ws[c]; launch(e, P); }, copies, st);
                printf("        shared %-9s %7.1f us with a residual added (%s)\n", name, aus,
                       exact ? "= the sum, bit for bit" : "DIFFERS from the sum");
                CK(cudaFree(radd));
            }
            if (v == 0) {   // one call traced, after another on a different weight copy (as in the timed graph)
                constexpr int E = QMH_TRACE_EVENTS;
                std::vector<unsigned long long> tr(E * 1024, 0);
                CK(cudaMemcpyToSymbol(qmh_trace, tr.data(), tr.size() * 8));
                qmh_args b = a;
                b.W = Ws[copies - 1];
                launch(b, P);
                b.W = Ws[0];
                launch(b, P);
                CK(cudaStreamSynchronize(st));
                CK(cudaMemcpyFromSymbol(tr.data(), qmh_trace, tr.size() * 8));
                unsigned long long t0 = ~0ull;
                for (int i = 0; i < P; ++i) t0 = std::min(t0, tr[E * i]);
                static const char * names[E] = {"start", "asked", "weights in", "acts in", "items done", "exit",
                                                "counted", "count seen", "sums added"};
                printf("          trace (us from the first start; median / latest):");
                for (int e = 0; e < E; ++e) {
                    std::vector<double> ev;   // (the hand-off's events: the blocks that have them)
                    for (int i = 0; i < P; ++i) {
                        if (tr[E * i + e] != 0) ev.push_back((tr[E * i + e] - t0) / 1e3);
                    }
                    std::sort(ev.begin(), ev.end());
                    if (!ev.empty()) {
                        printf("  %s %.1f / %.1f", names[e], ev[ev.size() / 2], ev.back());
                    }
                    if (e == 5) {
                        printf("\n          hand-off:");
                    }
                }
                printf("\n");
                // each block's warps: its last warp's last item, and how far after its first warp's
                const int nw = std::min(16, block_rows / 16);
                std::vector<unsigned long long> tw(16 * 1024, 0);
                CK(cudaMemcpyFromSymbol(tw.data(), qmh_trace_warp, tw.size() * 8));
                std::vector<double> last(P), spread(P);
                for (int i = 0; i < P; ++i) {
                    unsigned long long lo = ~0ull, hi = 0;
                    for (int w = 0; w < nw; ++w) {
                        lo = std::min(lo, tw[16 * i + w]);
                        hi = std::max(hi, tw[16 * i + w]);
                    }
                    last[i] = (hi - t0) / 1e3;
                    spread[i] = (hi - lo) / 1e3;
                }
                std::sort(last.begin(), last.end());
                std::sort(spread.begin(), spread.end());
                printf("          warps: a block's last warp done %.1f / %.1f, after its first %.2f / %.2f\n", last[P / 2],
                       last[P - 1], spread[P / 2], spread[P - 1]);
            }
            ++v;
        };
        // (row tiles per warp, warps, stages, blocks per SM): the shape ggml_qmatmul runs for this M (qmh_with_shape),
        // and beside it 8 warps at one block an SM, one K unit a stage in 16 warps, and on request the other widths
        constexpr int RU = qmh_run_units<type>();
        qmh_with_shape<type>(sh.M, [&](auto nw, auto minb) {
            constexpr int NW = decltype(nw)::value, MB = decltype(minb)::value;
            char run_name[32];
            snprintf(run_name, sizeof run_name, "run w%d s%d u%d x%d", NW, QMH_RUN_STAGES, RU, MB);
            variant(run_name, MB, 16 * NW, RU,
                    [&](const qmh_args & a, int P) { shared_any<type, 1, NW, QMH_RUN_STAGES, RU, MB>(a, P, st); });
            if constexpr (NW % 2 == 0) {   // QMM_LAB_RT2: the same block rows as two 16-row tiles a warp in half the warps
                if (getenv("QMM_LAB_RT2") != nullptr) {
                    snprintf(run_name, sizeof run_name, "rt2 w%d x%d", NW / 2, MB);
                    variant(run_name, MB, 16 * NW, RU,
                            [&](const qmh_args & a, int P) { shared_any<type, 2, NW / 2, QMH_RUN_STAGES, RU, MB>(a, P, st); });
                }
            }
            if constexpr (type == GGML_TYPE_Q4_K && NW % 4 == 0) {   // QMM_LAB_WG: the run shape through wgmma
                if (getenv("QMM_LAB_WG") != nullptr) {
                    snprintf(run_name, sizeof run_name, "wgmma w%d", NW);
                    variant(run_name, MB, 16 * NW, RU, [&](const qmh_args & a, int P) {
                        shared_any<type, 1, NW, QMH_RUN_STAGES, RU, MB, false, true>(a, P, st);
                    });
                }
            }
            if (getenv("QMM_LAB_PREFETCH") != nullptr) {   // launched as ggml_ext launches it, each call early
                constexpr size_t smem = qmh_smem_bytes<type, 6, 1, NW, QMH_RUN_STAGES, RU>();
                const int P = qmh_grid_of((int64_t) (sh.M + 16 * NW - 1) / (16 * NW) * (sh.K / QK_K / RU),
                                          (int64_t) n_sm * MB);
                const qmh_args a = {Ws[0], hx, dst, nb, sh.K, sh.M, N, 8 * nt, sh.M, nullptr, 0, ws, true};
                auto call = [&](int c) {
                    qmh_args b = a;
                    b.W = Ws[c];
                    switch (nt) {
#define QMM_LAB_PDL_CASE(T) case T: { constexpr auto k = qmm_half_shared<type, T, 1, NW, QMH_RUN_STAGES, RU, MB, false>; \
                        CK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, (int) smem)); \
                        ggml_cuda_kernel_launch(k, ggml_cuda_kernel_launch_params(dim3(P), dim3(WARP_SIZE, NW), smem, st), b); \
                        break; }
                        QMM_LAB_PDL_CASE(1) QMM_LAB_PDL_CASE(2) QMM_LAB_PDL_CASE(3)
                        QMM_LAB_PDL_CASE(4) QMM_LAB_PDL_CASE(5) QMM_LAB_PDL_CASE(6)
#undef QMM_LAB_PDL_CASE
                    }
                };
                const int64_t row_bytes = (int64_t) nb * block_bytes(type);
                for (int mode = 0; mode < 3; ++mode) {   // plain, with an idle node, with the prefetching node
                    const double us = profile ? 0.0 : time_graph([&](int c) {
                        if (mode > 0) {
                            ggml_cuda_kernel_launch(prefetch_first_stages, ggml_cuda_kernel_launch_params(dim3(P), dim3(128), 0, st),
                                                    (const char *) Ws[c], row_bytes, block_bytes(type), 16 * NW, RU, nb,
                                                    sh.M, P, QMH_RUN_STAGES, mode == 2);
                        }
                        call(c);
                    }, copies, st);
                    printf("        shared %-9s %7.1f us %5.0f GB/s  (programmatic launches, early; %s)\n", "run pdl", us,
                           gb / us, mode == 0 ? "alone" : mode == 1 ? "an idle node before each" : "L2 prefetch node before each");
                }
            }
            // QMM_LAB_BLOCK_ITEMS=1,2,3,...: the run shape on a grid of at most items / b blocks (b items a block at
            // least; qmh_grid_of takes QMH_MIN_BLOCK_ITEMS), for small matrices, whose grid of one item a block is all
            // pipeline start and fix-up
            if (const char * env = getenv("QMM_LAB_BLOCK_ITEMS")) {
                const int64_t items = (int64_t) ((sh.M + 16 * NW - 1) / (16 * NW)) * (sh.K / QK_K / RU);
                for (const char * e = env; *e; e += strspn(e, ",")) {
                    const int b = atoi(e);
                    e += strcspn(e, ",");
                    const int P = (int) std::min<int64_t>((int64_t) n_sm * MB, (items + b - 1) / b);
                    qmh_args a = {Ws[0], hx, dst, nb, sh.K, sh.M, N, 8 * nt, sh.M, nullptr, 0, ws};
                    const double us = profile ? 0.0 : time_graph([&](int c) {
                        qmh_args q = a;
                        q.W = Ws[c];
                        shared_any<type, 1, NW, QMH_RUN_STAGES, RU, MB>(q, P, st);
                    }, copies, st);
                    printf("        shared %-9s %7.1f us %5.0f GB/s  (%d blocks for %lld items: >= %d a block)\n", "run items",
                           us, gb / us, P, (long long) items, b);
                }
            }
        });
        if constexpr (type == GGML_TYPE_Q4_K) {   // QMM_LAB_GLU=1: the run shape's GLU form (ggml_qmatmul_swiglu_prepared)
            if (getenv("QMM_LAB_GLU") != nullptr && sh.M % 512 == 0) {
                qmh_with_shape<type>(sh.M, [&](auto nw, auto minb) {
                    constexpr int NW = decltype(nw)::value, MB = decltype(minb)::value;
                    half * glu;
                    CK(cudaMalloc(&glu, (size_t) (sh.M / 2 / QK_K) * qmh_act_bytes(8 * nt)));
                    const int P = qmh_grid_of((int64_t) (sh.M + 16 * NW - 1) / (16 * NW) * (sh.K / QK_K / RU),
                                              (int64_t) n_sm * MB);
                    for (const bool sums : {true, false}) {   // with the run sums (a Q4_K down), without (Q6_K)
                        const qmh_args a = {Ws[0], hx, nullptr, nb, sh.K, sh.M, N, 8 * nt, 0, nullptr, 0, ws, false, glu,
                                            sh.M / 2, sums};
                        const double us = profile ? 0.0 : time_graph([&](int c) {
                            qmh_args b = a;
                            b.W = Ws[c];
                            shared_any<type, 1, NW, QMH_RUN_STAGES, RU, MB, true>(b, P, st);
                        }, copies, st);
                        printf("        shared %-9s %7.1f us %5.0f GB/s  (the GLU form: silu(gate) * up written prepared%s)\n",
                               sums ? "run glu" : "glu nosum", us, gb / us, sums ? ", run sums" : ", no run sums");
                    }
                    CK(cudaFree(glu));
                });
            }
        }
        variant("f16 w8 s2", 1, 128, RU, [&](const qmh_args & a, int P) { shared_any<type, 1, 8, 2, RU, 1>(a, P, st); });
        variant("f16 w16 s2 u1", 1, 256, 1, [&](const qmh_args & a, int P) { shared_any<type, 1, 16, 2, 1, 1>(a, P, st); });
        if (getenv("QMM_LAB_WARPS") != nullptr) {   // other tile heights (item counts per block), two blocks an SM
            variant("f16 w8 s2 x2", 2, 128, RU, [&](const qmh_args & a, int P) { shared_any<type, 1, 8, 2, RU, 2>(a, P, st); });
            variant("f16 w12 s2", 1, 192, RU, [&](const qmh_args & a, int P) { shared_any<type, 1, 12, 2, RU, 1>(a, P, st); });
            variant("f16 w6 s2 x2", 2, 96, RU, [&](const qmh_args & a, int P) { shared_any<type, 1, 6, 2, RU, 2>(a, P, st); });
            variant("f16 w10 s2", 1, 160, RU, [&](const qmh_args & a, int P) { shared_any<type, 1, 10, 2, RU, 1>(a, P, st); });
        }
        if (getenv("QMM_LAB_UNITS1") != nullptr) {   // one K unit a stage in 3 or 4 stages, 8 warps, one block an SM
            variant("f16 w8 s3 u1", 1, 128, 1, [&](const qmh_args & a, int P) { shared_any<type, 1, 8, 3, 1, 1>(a, P, st); });
            variant("f16 w8 s4 u1", 1, 128, 1, [&](const qmh_args & a, int P) { shared_any<type, 1, 8, 4, 1, 1>(a, P, st); });
        }
        if (getenv("QMM_LAB_STAGES") != nullptr) {   // three stages a block, one block an SM
            variant("f16 w6 s3", 1, 96, RU, [&](const qmh_args & a, int P) { shared_any<type, 1, 6, 3, RU, 1>(a, P, st); });
            variant("f16 w8 s3", 1, 128, RU, [&](const qmh_args & a, int P) { shared_any<type, 1, 8, 3, RU, 1>(a, P, st); });
            variant("f16 w12 s3", 1, 192, RU, [&](const qmh_args & a, int P) { shared_any<type, 1, 12, 3, RU, 1>(a, P, st); });
        }
        fflush(stdout);
        CK(cudaFree(hx));
        CK(cudaFree(sx.yqh));
        CK(cudaFree(sx.yds));
    }
    CK(cudaFree(ws));
}

int main(int argc, char ** argv) {
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    printf("device: %s, %d SMs\n", prop.name, prop.multiProcessorCount);
    cudaStream_t st;
    CK(cudaStreamCreate(&st));

    // the card's read bandwidth: a plain streaming read of 1 GB in 4 buffers; and a device-to-device copy
    const size_t rb = 256u << 20;
    std::vector<const char *> bufs(4);
    for (auto & b : bufs) { char * d; CK(cudaMalloc(&d, rb)); CK(cudaMemset(d, 1, rb)); b = d; }
    unsigned * sink;
    CK(cudaMalloc(&sink, 4));
    const double read_us = time_graph([&](int c) {
        read_kernel<<<prop.multiProcessorCount * 8, 256, 0, st>>>((const uint4 *) bufs[c], rb / 16, sink);
    }, 4, st);
    const double read_gbs = rb / read_us / 1e3;
    char * cdst;
    CK(cudaMalloc(&cdst, rb));
    const double copy_us = time_graph([&](int c) {
        CK(cudaMemcpyAsync(cdst, bufs[c], rb, cudaMemcpyDeviceToDevice, st));
    }, 4, st);
    printf("read %.0f GB/s; device copy %.0f GB/s read (+ as much written)\n\n", read_gbs, rb / copy_us / 1e3);
    for (auto & b : bufs) CK(cudaFree((void *) b));
    CK(cudaFree(cdst));

    std::vector<int> cols;   // QMM_LAB_COLS: the several-column mode
    if (const char * e = getenv("QMM_LAB_COLS")) {
        for (const char * c = e; *c; ) {
            cols.push_back(atoi(c));
            while (*c && *c != ',') ++c;
            if (*c == ',') ++c;
        }
    }
    for (const shape & sh : SHAPES) {
        bool want = argc < 2;
        for (int i = 1; i < argc; ++i) want |= strcmp(argv[i], sh.name) == 0;
        if (!want) continue;
        if (!cols.empty() && getenv("QMM_LAB_SHARED") != nullptr) {
            switch (sh.type) {
                case GGML_TYPE_Q4_K: run_shared<GGML_TYPE_Q4_K>(sh, cols, prop.multiProcessorCount, st); break;
                case GGML_TYPE_Q6_K: run_shared<GGML_TYPE_Q6_K>(sh, cols, prop.multiProcessorCount, st); break;
                default: break;
            }
            continue;
        }
        if (!cols.empty()) {
            switch (sh.type) {
                case GGML_TYPE_Q4_K: run_cols<GGML_TYPE_Q4_K>(sh, cols, st); break;
                case GGML_TYPE_Q5_K: run_cols<GGML_TYPE_Q5_K>(sh, cols, st); break;
                case GGML_TYPE_Q6_K: run_cols<GGML_TYPE_Q6_K>(sh, cols, st); break;
                default: break;
            }
            continue;
        }
        switch (sh.type) {
            case GGML_TYPE_Q4_K: run_shape<GGML_TYPE_Q4_K>(sh, prop.multiProcessorCount, read_gbs, st); break;
            case GGML_TYPE_Q5_K: run_shape<GGML_TYPE_Q5_K>(sh, prop.multiProcessorCount, read_gbs, st); break;
            case GGML_TYPE_Q6_K: run_shape<GGML_TYPE_Q6_K>(sh, prop.multiProcessorCount, read_gbs, st); break;
            default: break;
        }
    }
    return 0;
}
