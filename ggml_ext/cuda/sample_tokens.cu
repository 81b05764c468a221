// ggml_sample_tokens / ggml_sample_probs on CUDA. Same rule and same searches as the CPU kernel (the top-k and top-p
// thresholds bit by bit on the float keys, from the highest bit the row's smallest and largest keys do not share),
// with the row split over the blocks of a thread-block cluster on Hopper and newer (SAMPLE_CLUSTER blocks per row,
// so 23 verify rows keep ~180 SMs' worth of blocks busy instead of 23), one block per row before. Each block keeps
// its slice of the row in shared memory (global scratch when the slice does not fit) and penalises the history
// tokens that fall in it. Every pass ends in a row reduction: block partials are combined through distributed
// shared memory in a fixed order, so every block of the row sees the same value and a seed gives the same token
// on the same device. Sums are f32 here (f64 on the CPU): a draw within rounding of a boundary may differ.

#include "ggml-ext-cuda.cuh"
#include "ggml-ext.h"
#include "../src/sample-common.h"

#include <cooperative_groups.h>

#define SAMPLE_THREADS  512
#define SAMPLE_WARPS    (SAMPLE_THREADS / 32)
#define SAMPLE_CLUSTER  8                   // blocks per row on Hopper+ (the portable cluster size)
#define SAMPLE_SMEM_MAX (160 * 1024)        // the largest row slice kept in shared memory, bytes

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

// Shared scratch of the row reductions. Slots and results are double-buffered (`parity`, the same in every
// thread, flips at each reduction): a block rewrites slot[p] only two reductions later, after a row barrier that
// every block passes only once done reading slot[p].
struct sample_reduce_smem {
    unsigned long long warp[SAMPLE_WARPS];
    unsigned long long slot[2];
    unsigned long long result[2];
};

// op over every thread's v of the row's C blocks (identity: op's neutral value); the same value in every thread.
template <int C, typename T, typename Op>
static __device__ T sample_row_reduce(T v, T identity, Op op, sample_reduce_smem & s, int & parity) {
    static_assert(sizeof(T) <= sizeof(unsigned long long), "reduction type too large");
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int p = parity;
    parity ^= 1;
    T * warp_part = reinterpret_cast<T *>(s.warp);
    T * slot = reinterpret_cast<T *>(&s.slot[p]);
    T * result = reinterpret_cast<T *>(&s.result[p]);

    v = sample_warp_reduce(v, op);
    __syncthreads();          // warp_part is read by the previous reduction
    if (lane == 0) {
        warp_part[warp] = v;
    }
    __syncthreads();
    if (warp == 0) {
        v = sample_warp_reduce(lane < SAMPLE_WARPS ? warp_part[lane] : identity, op);
        if (lane == 0) {
            *slot = v;
        }
    }
    sample_row_sync<C>();
    if (warp == 0) {
        v = sample_warp_reduce(lane < C ? sample_peer<C>(slot, lane) : identity, op);
        if (lane == 0) {
            *result = v;
        }
    }
    __syncthreads();
    return *result;
}

template <int C, typename T>
static __device__ T sample_row_sum(T v, sample_reduce_smem & s, int & parity) {
    return sample_row_reduce<C>(v, (T) 0, [](T a, T b) { return a + b; }, s, parity);
}

template <int C>
static __device__ int sample_row_min(int v, sample_reduce_smem & s, int & parity) {
    return sample_row_reduce<C>(v, INT_MAX, [](int a, int b) { return min(a, b); }, s, parity);
}

template <int C>
static __device__ int sample_row_max(int v, sample_reduce_smem & s, int & parity) {
    return sample_row_reduce<C>(v, INT_MIN, [](int a, int b) { return max(a, b); }, s, parity);
}

// Grid (C, n_rows): block blockIdx.x (its rank in the row's cluster) takes row slice [c0, c1).
template <int C>
static __global__ void __launch_bounds__(SAMPLE_THREADS)
sample_kernel(const char * logits, size_t logits_nb1, const int32_t * hist, int n_hist, const float * par,
              const float * rand, float * scratch, bool slice_in_smem, int n, int slice, int32_t * tokens,
              char * probs, size_t probs_nb1) {
#if !SAMPLE_HAS_CLUSTERS
    if constexpr (C > 1) {
        __trap();          // the host launches clusters only where the device has them
    }
#endif
    extern __shared__ float smem_slice[];
    __shared__ sample_reduce_smem red;
    __shared__ float scan[SAMPLE_WARPS];

    const int rank = blockIdx.x, row = blockIdx.y, tid = threadIdx.x;
    const int c0 = min(n, rank * slice);
    const int len = min(n, c0 + slice) - c0;
    const float * l = (const float *) (logits + row * logits_nb1) + c0;
    const int32_t * h = hist + (size_t) row * n_hist;
    float * x = slice_in_smem ? smem_slice : scratch + (size_t) row * n + c0;
    int parity = 0;

    ggml_cuda_pdl_sync();
    for (int i = tid; i < len; i += SAMPLE_THREADS) {
        x[i] = l[i];
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
                    x[tok - c0] = ggml_ext_sample_penalise(x[tok - c0], count, repeat, presence, frequency);
                }
            }
        }
        __syncthreads();
    }

    // the largest key with its lowest index (packed: key high, inverted index low), and the smallest key
    unsigned long long top = 0;
    uint32_t lo = UINT32_MAX;
    for (int i = tid; i < len; i += SAMPLE_THREADS) {
        const uint32_t key = ggml_ext_sample_key(x[i]);
        top = max(top, ((unsigned long long) key << 32) | (UINT32_MAX - (uint32_t) (c0 + i)));
        lo = min(lo, key);
    }
    top = sample_row_reduce<C>(top, 0ull, [](unsigned long long a, unsigned long long b) { return max(a, b); },
                               red, parity);
    lo = sample_row_reduce<C>(lo, UINT32_MAX, [](uint32_t a, uint32_t b) { return min(a, b); }, red, parity);
    const uint32_t hi = (uint32_t) (top >> 32);
    const int best = (int) (UINT32_MAX - (uint32_t) top);
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
        for (int b = ggml_ext_sample_search_start(lo, hi, &T); b >= 0; --b) {
            const uint32_t c = T | (1u << b);
            int count = 0;
            for (int i = tid; i < len; i += SAMPLE_THREADS) {
                count += ggml_ext_sample_key(x[i]) >= c;
            }
            if (sample_row_sum<C>(count, red, parity) >= k) {
                T = c;
            }
        }
        floor_key = T;
    }
    const float top_p = par[GGML_EXT_SAMPLE_TOP_P];
    if (top_p < 1.0f) {
        float mass = 0.0f;
        for (int i = tid; i < len; i += SAMPLE_THREADS) {
            mass += ggml_ext_sample_key(x[i]) >= floor_key ? expf(x[i] - m) : 0.0f;
        }
        const float want = top_p * sample_row_sum<C>(mass, red, parity);
        uint32_t T;
        for (int b = ggml_ext_sample_search_start(max(floor_key, lo), hi, &T); b >= 0; --b) {
            const uint32_t c = max(T | (1u << b), floor_key);
            mass = 0.0f;
            for (int i = tid; i < len; i += SAMPLE_THREADS) {
                mass += ggml_ext_sample_key(x[i]) >= c ? expf(x[i] - m) : 0.0f;
            }
            if (sample_row_sum<C>(mass, red, parity) >= want) {
                T |= 1u << b;
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
        const bool kept = ggml_ext_sample_key(x[i]) >= floor_key && (min_p <= 0.0f || expf(x[i] - m) >= min_p);
        return kept ? expf((x[i] - m) * inv_t) : 0.0f;
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
        *reinterpret_cast<float *>(&red.slot[p_slot]) = block_total;
    }
    sample_row_sync<C>();
    float offset = 0.0f, total = 0.0f;
    for (int r = 0; r < C; ++r) {
        const float t = sample_peer<C>(reinterpret_cast<float *>(&red.slot[p_slot]), r);
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
    int winner = sample_row_min<C>(s > 0.0f && target < incl ? me : INT_MAX, red, parity);
    if (winner == INT_MAX) {
        winner = sample_row_max<C>(s > 0.0f ? me : -1, red, parity);
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

void ggml_ext_cuda_sample_tokens(ggml_backend_cuda_context & ctx, ggml_tensor * dst) {
    const ggml_tensor * logits = dst->src[0];
    const ggml_tensor * hist   = dst->src[1];
    const ggml_tensor * par    = dst->src[2];
    const ggml_tensor * rand   = dst->src[3];
    const bool want_probs = dst->op_params[0] != 0;

    const int n      = (int) logits->ne[0];
    const int n_rows = (int) logits->ne[1];
    const int cc = ggml_cuda_info().devices[ctx.device].cc;
    const size_t smem_limit = std::min((size_t) SAMPLE_SMEM_MAX, ggml_cuda_info().devices[ctx.device].smpbo - 4096);
#if !defined(GGML_USE_HIP)
    const int n_blocks = GGML_CUDA_CC_IS_NVIDIA(cc) && cc >= GGML_CUDA_CC_HOPPER ? SAMPLE_CLUSTER : 1;
#else
    const int n_blocks = 1;
#endif
    const int slice = (n + n_blocks - 1) / n_blocks;
    const bool slice_in_smem = (size_t) slice * sizeof(float) <= smem_limit;
    const size_t smem = slice_in_smem ? (size_t) slice * sizeof(float) : 0;
    ggml_cuda_pool_alloc<float> scratch(ctx.pool());
    if (!slice_in_smem) {
        scratch.alloc((size_t) n * n_rows);
    }

    const char * l = (const char *) logits->data;
    const int32_t * h = (const int32_t *) hist->data;
    const float * prm = (const float *) par->data;
    const float * u = want_probs ? nullptr : (const float *) rand->data;
    int32_t * tok = want_probs ? nullptr : (int32_t *) dst->data;
    char * pr = want_probs ? (char *) dst->data : nullptr;
    const size_t pr_nb1 = want_probs ? dst->nb[1] : 0;
    if (n_blocks > 1) {
        CUDA_SET_SHARED_MEMORY_LIMIT(sample_kernel<SAMPLE_CLUSTER>, smem_limit);
        cudaLaunchConfig_t cfg = {};
        cudaLaunchAttribute attr[1];
        attr[0].id = cudaLaunchAttributeClusterDimension;
        attr[0].val.clusterDim.x = SAMPLE_CLUSTER;
        attr[0].val.clusterDim.y = 1;
        attr[0].val.clusterDim.z = 1;
        cfg.gridDim = dim3(SAMPLE_CLUSTER, n_rows);
        cfg.blockDim = dim3(SAMPLE_THREADS);
        cfg.dynamicSmemBytes = smem;
        cfg.stream = ctx.stream();
        cfg.attrs = attr;
        cfg.numAttrs = 1;
        CUDA_CHECK(cudaLaunchKernelEx(&cfg, sample_kernel<SAMPLE_CLUSTER>, l, logits->nb[1], h, (int) hist->ne[0], prm,
                                      u, scratch.get(), slice_in_smem, n, slice, tok, pr, pr_nb1));
    } else {
        CUDA_SET_SHARED_MEMORY_LIMIT(sample_kernel<1>, smem_limit);
        ggml_cuda_kernel_launch(sample_kernel<1>,
            ggml_cuda_kernel_launch_params(dim3(1, n_rows), dim3(SAMPLE_THREADS), smem, ctx.stream()),
            l, logits->nb[1], h, (int) hist->ne[0], prm, u, scratch.get(), slice_in_smem, n, slice, tok, pr, pr_nb1);
    }
}
