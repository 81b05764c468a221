// ggml_sample_tokens / ggml_sample_probs on CUDA. Same rule and same searches as the CPU kernel (the top-k and top-p
// thresholds bit by bit on the float keys, from the highest bit the row's smallest and largest keys do not share),
// with the row split over the blocks of a thread-block cluster on Hopper and newer (SAMPLE_CLUSTER blocks per row,
// so 23 verify rows keep ~180 SMs' worth of blocks busy instead of 23), one block per row before. Each block keeps
// its slice of the row in shared memory, as float keys (global scratch when the slice does not fit), and penalises
// the history tokens that fall in it. Every pass ends in a row reduction: block partials are combined through distributed
// shared memory in a fixed order, so every block of the row sees the same value and a seed gives the same token
// on the same device. Sums are f32 here (f64 on the CPU): a draw within rounding of a boundary may differ.

#include "ggml-ext-cuda.cuh"
#include "ggml-ext.h"
#include "../src/sample-common.h"

#include <cooperative_groups.h>

#define SAMPLE_THREADS  512
#define SAMPLE_WARPS    (SAMPLE_THREADS / 32)
#define SAMPLE_CLUSTER  8                   // blocks per row on Hopper+ (the portable cluster size)
#define SAMPLE_SMEM_MAX (160 * 1024)        // the largest row slice kept in shared memory, bytes (96 KiB for 16
                                            // blocks per row, so that a 16-block cluster finds room in a GPC)

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= GGML_CUDA_CC_HOPPER && !defined(GGML_USE_HIP)
#define SAMPLE_HAS_CLUSTERS 1
#else
#define SAMPLE_HAS_CLUSTERS 0
#endif

// A barrier over the blocks of one row (C == 1: the block).
template <int C>
static __device__ __forceinline__ void sample_row_sync() {
#if SAMPLE_HAS_CLUSTERS
    if constexpr (C > 1) {
        cooperative_groups::this_cluster().sync();
        return;
    }
#endif
    __syncthreads();
}

// `slot` (a shared variable) as block `rank` of this row holds it.
template <int C, typename T>
static __device__ __forceinline__ T sample_peer(T * slot, int rank) {
#if SAMPLE_HAS_CLUSTERS
    if constexpr (C > 1) {
        return *cooperative_groups::this_cluster().map_shared_rank(slot, (unsigned int) rank);
    }
#endif
    return *slot;
}

template <typename T, typename Op>
static __device__ __forceinline__ T sample_warp_reduce(T v, Op op) {
    for (int o = 16; o > 0; o >>= 1) {
        v = op(v, __shfl_xor_sync(0xffffffff, v, o));
    }
    return v;
}

#define SAMPLE_TRIES GGML_EXT_SAMPLE_TRIES   // thresholds tried per pass of a search (sample-common.h)

// Shared scratch of the row reductions (up to SAMPLE_TRIES values at once). Slots and results are double-buffered
// (`parity`, the same in every thread, flips at each reduction): a block rewrites slot[p] only two reductions
// later, after a row barrier that every block passes only once done reading slot[p].
struct sample_reduce_smem {
    unsigned long long warp[SAMPLE_TRIES][SAMPLE_WARPS];
    unsigned long long slot[2][SAMPLE_TRIES];
    unsigned long long result[2][SAMPLE_TRIES];
};

// v[j] <- op over every thread's v[j] of the row's C blocks (identity: op's neutral value), the same value in
// every thread of the row.
template <int C, int N, typename T, typename Op>
static __device__ void sample_row_reduce(T (&v)[N], T identity, Op op, sample_reduce_smem & s, int & parity) {
    static_assert(sizeof(T) <= sizeof(unsigned long long) && N <= SAMPLE_TRIES, "reduction too large");
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int p = parity;
    parity ^= 1;
#pragma unroll
    for (int j = 0; j < N; ++j) {
        v[j] = sample_warp_reduce(v[j], op);
    }
    __syncthreads();          // the warp partials are read by the previous reduction
    if (lane == 0) {
#pragma unroll
        for (int j = 0; j < N; ++j) {
            reinterpret_cast<T *>(s.warp[j])[warp] = v[j];
        }
    }
    __syncthreads();
    if (warp == 0) {
#pragma unroll
        for (int j = 0; j < N; ++j) {
            const T w = sample_warp_reduce(lane < SAMPLE_WARPS ? reinterpret_cast<T *>(s.warp[j])[lane] : identity, op);
            if (lane == 0) {
                *reinterpret_cast<T *>(&s.slot[p][j]) = w;
            }
        }
    }
    sample_row_sync<C>();
    if (warp == 0) {
#pragma unroll
        for (int j = 0; j < N; ++j) {
            T * slot = reinterpret_cast<T *>(&s.slot[p][j]);
            const T w = sample_warp_reduce(lane < C ? sample_peer<C>(slot, lane) : identity, op);
            if (lane == 0) {
                *reinterpret_cast<T *>(&s.result[p][j]) = w;
            }
        }
    }
    __syncthreads();
#pragma unroll
    for (int j = 0; j < N; ++j) {
        v[j] = *reinterpret_cast<T *>(&s.result[p][j]);
    }
}

template <int C, typename T, typename Op>
static __device__ T sample_row_reduce1(T v, T identity, Op op, sample_reduce_smem & s, int & parity) {
    T a[1] = { v };
    sample_row_reduce<C>(a, identity, op, s, parity);
    return a[0];
}

template <int C, int N, typename T>
static __device__ void sample_row_sum(T (&v)[N], sample_reduce_smem & s, int & parity) {
    sample_row_reduce<C>(v, (T) 0, [](T a, T b) { return a + b; }, s, parity);
}

// Grid (C, n_rows): block blockIdx.x (its rank in the row's cluster) takes row slice [c0, c1).
template <int C>
static __global__ void __launch_bounds__(SAMPLE_THREADS, C > 8 ? 3 : 1)   // 16 per row: 3 blocks per SM
sample_kernel(const char * logits, size_t logits_nb1, const int32_t * hist, int n_hist, const float * par,
              const float * rand, uint32_t * scratch, bool slice_in_smem, int n, int slice, int32_t * tokens,
              char * probs, size_t probs_nb1) {
#if !SAMPLE_HAS_CLUSTERS
    if constexpr (C > 1) {
        __trap();          // the host launches clusters only where the device has them
    }
#endif
    extern __shared__ uint32_t smem_slice[];
    __shared__ sample_reduce_smem red;
    __shared__ float scan[SAMPLE_WARPS];

    const int rank = blockIdx.x, row = blockIdx.y, tid = threadIdx.x;
    const int c0 = min(n, rank * slice);
    const int len = min(n, c0 + slice) - c0;
    const float * l = (const float *) (logits + row * logits_nb1) + c0;
    const int32_t * h = hist + (size_t) row * n_hist;
    uint32_t * x = slice_in_smem ? smem_slice : scratch + (size_t) row * n + c0;    // the keys of the slice
    int parity = 0;

    ggml_cuda_pdl_sync();
    for (int i = tid; i < len; i += SAMPLE_THREADS) {
        x[i] = ggml_ext_sample_key(l[i]);
    }
    __syncthreads();
    const float repeat = par[GGML_EXT_SAMPLE_REPEAT_PENALTY];
    const float presence = par[GGML_EXT_SAMPLE_PRESENCE_PENALTY];
    const float frequency = par[GGML_EXT_SAMPLE_FREQUENCY_PENALTY];
    if (repeat != 1.0f || presence != 0.0f || frequency != 0.0f) {
        // at the history's ids only: each distinct token by one thread, in the block whose slice holds it
        for (int j = tid; j < n_hist; j += SAMPLE_THREADS) {
            const int tok = h[j];
            if (tok >= c0 && tok < c0 + len) {
                const int count = ggml_ext_sample_count(h, n_hist, j, n);
                if (count > 0) {
                    const float v = ggml_ext_sample_unkey(x[tok - c0]);
                    x[tok - c0] = ggml_ext_sample_key(ggml_ext_sample_penalise(v, count, repeat, presence, frequency));
                }
            }
        }
        __syncthreads();
    }

    // in one reduction: the largest key with its lowest index (packed: key high, inverted index low), and the
    // smallest key (inverted, so that both are maxima)
    unsigned long long ext[2] = { 0ull, 0ull };
    for (int i = tid; i < len; i += SAMPLE_THREADS) {
        const uint32_t key = x[i];
        ext[0] = max(ext[0], ((unsigned long long) key << 32) | (UINT32_MAX - (uint32_t) (c0 + i)));
        ext[1] = max(ext[1], (unsigned long long) (UINT32_MAX - key));
    }
    sample_row_reduce<C>(ext, 0ull, [](unsigned long long a, unsigned long long b) { return max(a, b); }, red,
                         parity);
    const uint32_t hi = (uint32_t) (ext[0] >> 32);
    const uint32_t lo = UINT32_MAX - (uint32_t) ext[1];
    const int best = (int) (UINT32_MAX - (uint32_t) ext[0]);
    const float m = ggml_ext_sample_unkey(hi);

    float * p = probs ? (float *) (probs + row * probs_nb1) + c0 : nullptr;
    const float temperature = par[GGML_EXT_SAMPLE_TEMPERATURE];
    if (!(temperature > 0.0f)) {
        if (p) {
            for (int i = tid; i < len; i += SAMPLE_THREADS) {
                p[i] = c0 + i == best ? 1.0f : 0.0f;
            }
        } else if (rank == 0 && tid == 0) {
            tokens[row] = best;
        }
        sample_row_sync<C>();      // no block leaves while another may still read its shared memory
        return;
    }

    uint32_t floor_key = 0;
    const int k = (int) par[GGML_EXT_SAMPLE_TOP_K];
    if (k > 0 && k < n) {
        uint32_t T;
        for (int b = ggml_ext_sample_search_start(lo, hi, &T); b >= 0; b -= 2) {
            uint32_t c[SAMPLE_TRIES];
            const int n_tries = ggml_ext_sample_tries(T, b, c);
            int count[SAMPLE_TRIES] = {};
            for (int i = tid; i < len; i += SAMPLE_THREADS) {
                const uint32_t key = x[i];
                if (key >= c[0]) {                      // most keys are below every candidate after a few passes
#pragma unroll
                    for (int j = 0; j < SAMPLE_TRIES; ++j) {
                        count[j] += key >= c[j];
                    }
                }
            }
            sample_row_sum<C>(count, red, parity);
            // the counts fall as the candidates rise: T takes the last of the passing ones, which come first
            bool pass = true;
#pragma unroll
            for (int j = 0; j < SAMPLE_TRIES; ++j) {
                pass = pass && j < n_tries && count[j] >= k;
                T = pass ? c[j] : T;
            }
        }
        floor_key = T;
    }
    const float top_p = par[GGML_EXT_SAMPLE_TOP_P];
    if (top_p < 1.0f) {
        float kept[1] = { 0.0f };
        for (int i = tid; i < len; i += SAMPLE_THREADS) {
            kept[0] += x[i] >= floor_key ? expf(ggml_ext_sample_unkey(x[i]) - m) : 0.0f;
        }
        sample_row_sum<C>(kept, red, parity);
        const float want = top_p * kept[0];
        uint32_t T;
        for (int b = ggml_ext_sample_search_start(max(floor_key, lo), hi, &T); b >= 0; b -= 2) {
            uint32_t c[SAMPLE_TRIES];
            const int n_tries = ggml_ext_sample_tries(T, b, c);
            float mass[SAMPLE_TRIES] = {};
            for (int i = tid; i < len; i += SAMPLE_THREADS) {
                const uint32_t key = x[i];
                if (key >= max(c[0], floor_key)) {      // the rest add nothing: no exp for them
                    const float e = expf(ggml_ext_sample_unkey(key) - m);
#pragma unroll
                    for (int j = 0; j < SAMPLE_TRIES; ++j) {
                        mass[j] += key >= max(c[j], floor_key) ? e : 0.0f;
                    }
                }
            }
            sample_row_sum<C>(mass, red, parity);
            // the masses fall as the candidates rise: T takes the last of the passing ones, which come first
            bool pass = true;
#pragma unroll
            for (int j = 0; j < SAMPLE_TRIES; ++j) {
                pass = pass && j < n_tries && mass[j] >= want;
                T = pass ? c[j] : T;
            }
        }
        floor_key = max(T, floor_key);
    }

    // each thread takes a contiguous piece of the block's slice, so piece sums scan into cumulative
    // probabilities by id: within the block by a block scan, across the row's blocks by their totals in rank order
    const float min_p = par[GGML_EXT_SAMPLE_MIN_P];
    const float inv_t = 1.0f / temperature;
    const int piece = (len + SAMPLE_THREADS - 1) / SAMPLE_THREADS;
    const int i0 = min(len, tid * piece);
    const int i1 = min(len, i0 + piece);
    auto weight = [&](int i) {
        if (x[i] < floor_key) {
            return 0.0f;
        }
        const float v = ggml_ext_sample_unkey(x[i]) - m;
        return min_p <= 0.0f || expf(v) >= min_p ? expf(v * inv_t) : 0.0f;
    };
    float s = 0.0f;
    for (int i = i0; i < i1; ++i) {
        s += weight(i);
    }
    const int lane = tid % 32, warp = tid / 32;
    float incl = s;
    for (int o = 1; o < 32; o <<= 1) {
        const float y = __shfl_up_sync(0xffffffff, incl, o);
        if (lane >= o) {
            incl += y;
        }
    }
    if (lane == 31) {
        scan[warp] = incl;
    }
    __syncthreads();
    float before = 0.0f;           // the sum of the block's warps before this one
    for (int w = 0; w < warp; ++w) {
        before += scan[w];
    }
    incl += before;
    // the block's total, published in a result slot of the reduction scratch; then each block sums the totals of
    // the blocks before it (and all of them) in rank order
    float block_total = 0.0f;
    for (int w = 0; w < SAMPLE_WARPS; ++w) {
        block_total += scan[w];
    }
    const int p_slot = parity;
    parity ^= 1;
    if (tid == 0) {
        *reinterpret_cast<float *>(&red.slot[p_slot][0]) = block_total;
    }
    sample_row_sync<C>();
    float offset = 0.0f, total = 0.0f;
    for (int r = 0; r < C; ++r) {
        const float t = sample_peer<C>(reinterpret_cast<float *>(&red.slot[p_slot][0]), r);
        offset += r < rank ? t : 0.0f;
        total += t;
    }
    incl += offset;

    if (p) {
        for (int i = i0; i < i1; ++i) {
            p[i] = weight(i) / total;
        }
        sample_row_sync<C>();
        return;
    }
    // the piece where the cumulative sum first exceeds u * total draws; if rounding leaves none, the last piece
    // with weight (the row's largest logit always has weight, so there is one)
    const float target = rand[row] * total;
    const int me = rank * SAMPLE_THREADS + tid;
    int winner = sample_row_reduce1<C>(s > 0.0f && target < incl ? me : INT_MAX, INT_MAX,
                                       [](int a, int b) { return min(a, b); }, red, parity);
    if (winner == INT_MAX) {
        winner = sample_row_reduce1<C>(s > 0.0f ? me : -1, INT_MIN, [](int a, int b) { return max(a, b); }, red,
                                       parity);
    }
    if (me == winner) {
        float cum = incl - s;
        int last = best;
        for (int i = i0; i < i1; ++i) {
            const float w = weight(i);
            if (w > 0.0f) {
                cum += w;
                last = c0 + i;
                if (cum > target) {
                    break;
                }
            }
        }
        tokens[row] = last;
    }
    sample_row_sync<C>();
}

struct sample_args {
    const char * logits; size_t logits_nb1; const int32_t * hist; int n_hist; const float * par; const float * rand;
    uint32_t * scratch; bool slice_in_smem; int n; int slice; int32_t * tokens; char * probs; size_t probs_nb1;
};

template <int C>
static cudaError_t sample_launch(const sample_args & a, int n_rows, size_t smem, cudaStream_t stream) {
    cudaLaunchConfig_t cfg = {};
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = C;
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
    cfg.gridDim = dim3(C, n_rows);
    cfg.blockDim = dim3(SAMPLE_THREADS);
    cfg.dynamicSmemBytes = smem;
    cfg.stream = stream;
    cfg.attrs = attr;
    cfg.numAttrs = C > 1 ? 1 : 0;
    return cudaLaunchKernelEx(&cfg, sample_kernel<C>, a.logits, a.logits_nb1, a.hist, a.n_hist, a.par, a.rand,
                              a.scratch, a.slice_in_smem, a.n, a.slice, a.tokens, a.probs, a.probs_nb1);
}

// Whether clusters of C blocks of sample_kernel<C> with this shared memory can run on the current device.
template <int C>
static bool sample_cluster_fits(size_t smem_limit) {
    if (C > 8 && cudaFuncSetAttribute(sample_kernel<C>, cudaFuncAttributeNonPortableClusterSizeAllowed, 1) !=
                     cudaSuccess) {
        (void) cudaGetLastError();
        return false;
    }
    if (cudaFuncSetAttribute(sample_kernel<C>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int) smem_limit) !=
            cudaSuccess) {
        (void) cudaGetLastError();
        return false;
    }
    cudaLaunchConfig_t cfg = {};
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = C;
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
    cfg.gridDim = dim3(C, 1);
    cfg.blockDim = dim3(SAMPLE_THREADS);
    cfg.dynamicSmemBytes = smem_limit;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    int n_clusters = 0;
    if (cudaOccupancyMaxActiveClusters(&n_clusters, sample_kernel<C>, &cfg) != cudaSuccess) {
        (void) cudaGetLastError();
        return false;
    }
    return n_clusters > 0;
}

static size_t sample_smem_limit(int n_blocks, size_t smpbo) {
    return std::min(n_blocks > 8 ? (size_t) 96 * 1024 : (size_t) SAMPLE_SMEM_MAX, smpbo - 4096);
}

// Blocks per row on this device: SAMPLE_CLUSTER on Hopper and newer, 1 before. PYDFLASH_SAMPLE_BLOCKS=1, 8 or 16
// chooses (for measurements; 16 is a non-portable cluster size); a size the device cannot run falls back to 1.
static int sample_blocks_per_row(int device, int cc, size_t smpbo) {
    static int chosen[GGML_CUDA_MAX_DEVICES] = {};
    if (chosen[device] == 0) {
        int want = GGML_CUDA_CC_IS_NVIDIA(cc) && cc >= GGML_CUDA_CC_HOPPER ? SAMPLE_CLUSTER : 1;
        if (const char * env = getenv("PYDFLASH_SAMPLE_BLOCKS")) {
            want = atoi(env);
        }
        const bool clusters = GGML_CUDA_CC_IS_NVIDIA(cc) && cc >= GGML_CUDA_CC_HOPPER;
        if (want == 16 && clusters && sample_cluster_fits<16>(sample_smem_limit(16, smpbo))) {
            chosen[device] = 16;
        } else if (want >= 8 && clusters && sample_cluster_fits<8>(sample_smem_limit(8, smpbo))) {
            chosen[device] = 8;
        } else {
            chosen[device] = 1;
            CUDA_CHECK(cudaFuncSetAttribute(sample_kernel<1>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            (int) sample_smem_limit(1, smpbo)));
        }
    }
    return chosen[device];
}

void ggml_ext_cuda_sample_tokens(ggml_backend_cuda_context & ctx, ggml_tensor * dst) {
    const ggml_tensor * logits = dst->src[0];
    const ggml_tensor * hist   = dst->src[1];
    const ggml_tensor * par    = dst->src[2];
    const ggml_tensor * rand   = dst->src[3];
    const bool want_probs = dst->op_params[0] != 0;

    const int n      = (int) logits->ne[0];
    const int n_rows = (int) logits->ne[1];
    const int cc = ggml_cuda_info().devices[ctx.device].cc;
    const size_t smpbo = ggml_cuda_info().devices[ctx.device].smpbo;
    const int n_blocks = sample_blocks_per_row(ctx.device, cc, smpbo);
    const size_t smem_limit = sample_smem_limit(n_blocks, smpbo);
    const int slice = (n + n_blocks - 1) / n_blocks;
    const bool slice_in_smem = (size_t) slice * sizeof(float) <= smem_limit;
    const size_t smem = slice_in_smem ? (size_t) slice * sizeof(float) : 0;
    ggml_cuda_pool_alloc<uint32_t> scratch(ctx.pool());
    if (!slice_in_smem) {
        scratch.alloc((size_t) n * n_rows);
    }

    sample_args a;
    a.logits = (const char *) logits->data;
    a.logits_nb1 = logits->nb[1];
    a.hist = (const int32_t *) hist->data;
    a.n_hist = (int) hist->ne[0];
    a.par = (const float *) par->data;
    a.rand = want_probs ? nullptr : (const float *) rand->data;
    a.scratch = scratch.get();
    a.slice_in_smem = slice_in_smem;
    a.n = n;
    a.slice = slice;
    a.tokens = want_probs ? nullptr : (int32_t *) dst->data;
    a.probs = want_probs ? (char *) dst->data : nullptr;
    a.probs_nb1 = want_probs ? dst->nb[1] : 0;
    switch (n_blocks) {
        case 16: CUDA_CHECK(sample_launch<16>(a, n_rows, smem, ctx.stream())); break;
        case 8:  CUDA_CHECK(sample_launch<8>(a, n_rows, smem, ctx.stream())); break;
        default: CUDA_CHECK(sample_launch<1>(a, n_rows, smem, ctx.stream())); break;
    }
}
