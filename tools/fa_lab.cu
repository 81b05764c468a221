// A kernel lab for the split-KV f16 flash attention (ggml_ext/cuda/fattn_split.cuh), without building pydflash:
// one nvcc call on the GPU machine (seconds), then the kernel in several shapes (m-tiles per block, warps per
// m-tile, stages; blocks aimed at; key tiles a slice at least) at the 27B model's attention (D 256, 24 query heads
// over 4 KV heads) for a few query counts and cache lengths, each checked against a plain f32 kernel (worst
// relative error of an output row) and timed with its merge, both launched as ggml_ext launches them (programmatic
// dependent launch unless GGML_CUDA_PDL=0).
//
//   nvcc -std=c++17 -O3 -arch=sm_90 -o /tmp/fa_lab tools/fa_lab.cu -DGGML_USE_CUDA \
//        -Iggml_ext/include -Iggml_ext/cuda -I$GGML/include -I$GGML/src -I$GGML/src/ggml-cuda
//   /tmp/fa_lab [n_q,n_kv ...]      (default: 23,768 23,2048 23,8192 1,768 8,2048 42,2048)
//
// K and V sit as in the model's cache (cells of [D x 4 heads] f16 rows), the mask is a tree verify's: every query
// sees the context and a random ~half of the last n_q cells, itself included. K, V and the mask come in enough
// copies (>= 160 MB) that each timed call reads DRAM, as a verify does between weight matrices. Timed: the
// attention alone and with its merge, each in a CUDA graph of one call a copy, the median over repetitions.

#include "fattn_split.cuh"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "lab_ggml_stubs.cuh"

constexpr int D = 256, H = 24, HKV = 4;

// the reference: one block per output row (token, head), f32 throughout, Q unrounded
static __global__ void k_reference(const fa_split_params p, float * dst) {
    extern __shared__ float sc[]; // n_kv scores
    __shared__ float red[2];
    const int t = blockIdx.x / p.n_head, h = blockIdx.x % p.n_head, hk = h / (p.n_head / p.n_head_kv);
    const float * q = (const float *) (p.q + t*p.nbq1 + h*p.nbq2);
    const half * mrow = (const half *) (p.mask + t*p.nbm1);
    for (int j = threadIdx.x; j < p.n_kv; j += blockDim.x) {
        const half * k = (const half *) (p.k + hk*p.nbk2 + (int64_t) j*p.nbk1);
        float s = 0.0f;
        for (int d = 0; d < D; ++d) s += q[d] * __half2float(k[d]);
        sc[j] = s * p.scale + __half2float(mrow[j]);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        float m = -INFINITY, l = 0.0f;
        for (int j = 0; j < p.n_kv; ++j) m = fmaxf(m, sc[j]);
        for (int j = 0; j < p.n_kv; ++j) l += expf(sc[j] - m);
        red[0] = m; red[1] = l;
    }
    __syncthreads();
    const int d = threadIdx.x;
    float a = 0.0f;
    for (int j = 0; j < p.n_kv; ++j) {
        if (sc[j] != -INFINITY) {
            a += expf(sc[j] - red[0]) * __half2float(((const half *) (p.v + hk*p.nbv2 + (int64_t) j*p.nbv1))[d]);
        }
    }
    dst[(int64_t) blockIdx.x*D + d] = a / red[1];
}

static uint64_t rng = 0x9E3779B97F4A7C15ull;
static uint32_t rnd() { rng ^= rng << 13; rng ^= rng >> 7; rng ^= rng << 17; return (uint32_t) rng; }
static float unif() { return (rnd() >> 8) * (1.0f / 16777216.0f); }

struct inputs {
    int n_q, n_kv, mask_rows;
    std::vector<char *> k, v, mask; // copies
    float * q;
    size_t bytes_kv;
};

static inputs make_inputs(int n_q, int n_kv) {
    inputs in;
    in.n_q = n_q; in.n_kv = n_kv;
    in.mask_rows = (n_q + 63) / 64 * 64;
    std::vector<half> hk((size_t) n_kv * HKV * D), hv(hk.size());
    for (auto & x : hk) x = __float2half(2.0f * unif() - 1.0f);
    for (auto & x : hv) x = __float2half(2.0f * unif() - 1.0f);
    std::vector<float> hq((size_t) n_q * H * D);
    for (auto & x : hq) x = 6.0f * (unif() - 0.5f);   // scores spread over a few units
    std::vector<half> hm((size_t) in.mask_rows * n_kv, __float2half(-INFINITY));
    const int ctx = n_kv - n_q;
    for (int t = 0; t < n_q; ++t) {
        for (int j = 0; j < ctx; ++j) hm[(size_t) t*n_kv + j] = __float2half(0.0f);
        for (int j = 0; j < t; ++j) if (rnd() % 2) hm[(size_t) t*n_kv + ctx + j] = __float2half(0.0f);
        hm[(size_t) t*n_kv + ctx + t] = __float2half(0.0f);
    }
    in.bytes_kv = hk.size() * sizeof(half);
    const int copies = std::max<int>(1, (int) ((160u << 20) / (2 * in.bytes_kv)) + 1);
    for (int c = 0; c < copies; ++c) {
        char *k, *v, *m;
        CK(cudaMalloc(&k, in.bytes_kv)); CK(cudaMalloc(&v, in.bytes_kv)); CK(cudaMalloc(&m, hm.size() * sizeof(half)));
        CK(cudaMemcpy(k, hk.data(), in.bytes_kv, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(v, hv.data(), in.bytes_kv, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(m, hm.data(), hm.size() * sizeof(half), cudaMemcpyHostToDevice));
        in.k.push_back(k); in.v.push_back(v); in.mask.push_back(m);
    }
    CK(cudaMalloc(&in.q, hq.size() * sizeof(float)));
    CK(cudaMemcpy(in.q, hq.data(), hq.size() * sizeof(float), cudaMemcpyHostToDevice));
    return in;
}

static fa_split_params params_of(const inputs & in, int copy) {
    fa_split_params p = {};
    p.q = (const char *) in.q; p.k = in.k[copy]; p.v = in.v[copy]; p.mask = in.mask[copy];
    // q: [D, n_q, H] view of [D, H, n_q]; K/V: [D, n_kv, HKV] views of cells of [D, HKV]; mask [n_kv, rows]
    p.nbq1 = (int64_t) H * D * 4; p.nbq2 = D * 4; p.nbq3 = p.nbq1 * in.n_q;
    p.nbk1 = p.nbv1 = (int64_t) HKV * D * 2; p.nbk2 = p.nbv2 = D * 2; p.nbk3 = p.nbv3 = p.nbk1 * in.n_kv;
    p.nbm1 = (int64_t) in.n_kv * 2; p.nbm2 = p.nbm3 = p.nbm1 * in.mask_rows;
    p.n_q = in.n_q; p.n_head = H; p.n_head_kv = HKV; p.n_kv = in.n_kv; p.n_seq = 1; p.mask_ne2 = p.mask_ne3 = 1;
    p.scale = 1.0f / sqrtf((float) D);
    return p;
}

// the attention and (with_merge) its merge, launched as ggml_ext launches them (programmatic dependent launch
// unless GGML_CUDA_PDL=0)
template <int MT, int DS, int ST, bool SQ>
static void launch_pair(const fa_split_params & p, dim3 grid, size_t smem, int rows_out, float * out, bool with_merge,
                        cudaStream_t st) {
    ggml_cuda_kernel_launch(k_fa_split_f16<D, MT, DS, ST, SQ>, ggml_cuda_kernel_launch_params(grid, MT*DS*WARP_SIZE, smem, st), p);
    if (with_merge) {
        ggml_cuda_kernel_launch(fa_split_merge<D>, ggml_cuda_kernel_launch_params(dim3(rows_out), D, 0, st),
                                (const float *) p.partial, out, p.n_splits);
    }
}

template <int MT, int DS, int ST, bool SQ>
static void run_config(const inputs & in, const float * ref, int target_mult, int min_tiles, float * partial, float * out,
                       int nsm) {
    auto kern = k_fa_split_f16<D, MT, DS, ST, SQ>;
    const size_t smem = fa_split_f16_smem<D, MT, DS, ST, SQ>();
    CK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int) smem));
    int per_sm = 0;
    CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kern, MT*DS*WARP_SIZE, smem));
    const int target = target_mult > 0 ? target_mult * nsm : per_sm * nsm;
    fa_split_params p0 = params_of(in, 0);
    const dim3 grid = fa_split_f16_plan<MT>(p0, target, min_tiles);
    const int rows_out = in.n_q * H;
    cudaStream_t st;
    CK(cudaStreamCreate(&st));
    // check copy 0
    p0.partial = partial;
    launch_pair<MT, DS, ST, SQ>(p0, grid, smem, rows_out, out, true, st);
    CK(cudaStreamSynchronize(st));
    CK(cudaGetLastError());
    std::vector<float> h((size_t) rows_out * D);
    CK(cudaMemcpy(h.data(), out, h.size() * 4, cudaMemcpyDeviceToHost));
    double worst = 0.0;
    for (int r = 0; r < rows_out; ++r) {
        double e = 0.0, n = 0.0;
        for (int d = 0; d < D; ++d) {
            const double x = h[(size_t) r*D + d], y = ref[(size_t) r*D + d];
            e += (x - y) * (x - y); n += y * y;
        }
        worst = std::max(worst, std::sqrt(e / std::max(n, 1e-30)));
    }
    // time: a graph of one call per copy, the attention alone and with its merge
    double us[2];
    for (int with_merge = 0; with_merge < 2; ++with_merge) {
        us[with_merge] = time_graph([&](int c) {
            fa_split_params p = params_of(in, c);
            fa_split_f16_plan<MT>(p, target, min_tiles);
            p.partial = partial;
            launch_pair<MT, DS, ST, SQ>(p, grid, smem, rows_out, out, with_merge, st);
        }, (int) in.k.size(), st, 30);
    }
    printf("  MT=%d DS=%d ST=%d SQ=%d target=%-4d min_tiles=%d: %3d x %2d blocks (%d/SM), %4d keys a slice: %6.2f us, "
           "with merge %6.2f (worst row err %.1e)%s\n", MT, DS, ST, (int) SQ, target, min_tiles, grid.x, grid.y, per_sm,
           p0.keys_per_split, us[0], us[1], worst, worst > 1e-2 ? "  WRONG" : "");
    CK(cudaStreamDestroy(st));
}

int main(int argc, char ** argv) {
    std::vector<std::pair<int, int>> cases;
    for (int i = 1; i < argc; ++i) {
        int a, b;
        if (sscanf(argv[i], "%d,%d", &a, &b) == 2) cases.push_back({a, b});
    }
    if (cases.empty()) cases = {{23, 768}, {23, 2048}, {23, 8192}, {1, 768}, {8, 2048}, {42, 2048}};
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    const int nsm = prop.multiProcessorCount;
    printf("%s, %d SMs\n", prop.name, nsm);
    for (auto [n_q, n_kv] : cases) {
        inputs in = make_inputs(n_q, n_kv);
        const int rows_out = n_q * H;
        float *ref, *out, *partial;
        CK(cudaMalloc(&ref, (size_t) rows_out * D * 4));
        CK(cudaMalloc(&out, (size_t) rows_out * D * 4));
        CK(cudaMalloc(&partial, (size_t) rows_out * (n_kv / FA_SPLIT_KT + 1) * (D + 2) * 4));
        fa_split_params p = params_of(in, 0);
        CK(cudaFuncSetAttribute(k_reference, cudaFuncAttributeMaxDynamicSharedMemorySize, n_kv * 4));
        k_reference<<<rows_out, D, n_kv * 4>>>(p, ref);
        CK(cudaDeviceSynchronize());
        std::vector<float> href((size_t) rows_out * D);
        CK(cudaMemcpy(href.data(), ref, href.size() * 4, cudaMemcpyDeviceToHost));
        printf("n_q=%d n_kv=%d (%zu copies; K+V %.2f MB a call)\n", n_q, n_kv, in.k.size(), 2.0 * in.bytes_kv / 1e6);
        // blocks aimed at: 0 = as many as fit the GPU at once, else that many times its SMs; slices >= 1 key tile
        for (int target : {0, 1, 2}) {
            const int min_tiles = 1;
            run_config<3, 2, 2, false>(in, href.data(), target, min_tiles, partial, out, nsm);
            run_config<3, 2, 2, true>(in, href.data(), target, min_tiles, partial, out, nsm);
            run_config<3, 4, 2, true>(in, href.data(), target, min_tiles, partial, out, nsm);
            run_config<2, 4, 2, true>(in, href.data(), target, min_tiles, partial, out, nsm);
            run_config<3, 2, 3, true>(in, href.data(), target, min_tiles, partial, out, nsm); // ggml_ext's (target 1)
            run_config<5, 2, 2, true>(in, href.data(), target, min_tiles, partial, out, nsm);
            run_config<1, 4, 3, true>(in, href.data(), target, min_tiles, partial, out, nsm);
            run_config<1, 4, 3, false>(in, href.data(), target, min_tiles, partial, out, nsm);
        }
        CK(cudaFree(ref)); CK(cudaFree(out)); CK(cudaFree(partial));
        for (size_t c = 0; c < in.k.size(); ++c) { cudaFree(in.k[c]); cudaFree(in.v[c]); cudaFree(in.mask[c]); }
        cudaFree(in.q);
    }
    return 0;
}
