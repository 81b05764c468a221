// ggml_top_k_logp on CUDA, in two passes (one block per row would leave most SMs idle and read ~600 KB per SM).
// Pass 1: a grid of (chunks, rows) blocks; each block takes the k best keys of its TOPK_CHUNK logits and their
// (max, sum of exp(x - max)). Pass 2: one block per row picks the k best of its chunks' candidates and merges the
// (max, sum) pairs into logsumexp. Both passes select the same way: every thread keeps its own best keys sorted
// in registers, then k rounds of a block-wide max (warp shuffles, then shared memory) each take one key off the
// front of its owner's list. Keys follow ggml-ext-top-k-key.h (a total order), so the ids do not depend on the
// split and equal the CPU kernel's.

#include "ggml-ext-cuda.cuh"
#include "ggml-ext-top-k-key.h"
#include "ggml-ext.h"

#define TOPK_THREADS 256
#define TOPK_WARPS   (TOPK_THREADS / WARP_SIZE)
#define TOPK_CHUNK   8192   // logits per pass-1 block: 19 blocks for a 152K-token row
#define TOPK_BATCH   8      // loads a thread has in flight before it uses them

struct lse_pair {
    float m;   // the max so far (-inf: none); NaN never becomes the max
    float s;   // sum of exp(x - m) over the values so far (NaN once a NaN was seen)
};

static __device__ __forceinline__ lse_pair lse_merge(lse_pair a, lse_pair b) {
    const float m = fmaxf(a.m, b.m);
    if (m == -INFINITY) {
        return {m, a.s + b.s};     // no finite value on either side: 0 (or NaN)
    }
    return {m, a.s * expf(a.m - m) + b.s * expf(b.m - m)};
}

static __device__ __forceinline__ void lse_add(lse_pair & p, float v) {
    if (v > p.m) {
        p.s = p.s * expf(p.m - v) + 1.0f;
        p.m = v;
    } else if (v != -INFINITY) {   // -inf adds 0 (and would give -inf - -inf); NaN adds NaN
        p.s += expf(v - p.m);
    }
}

static __device__ __forceinline__ lse_pair warp_lse(lse_pair p) {
#pragma unroll
    for (int offset = WARP_SIZE / 2; offset > 0; offset >>= 1) {
        const lse_pair o = {__shfl_xor_sync(0xFFFFFFFF, p.m, offset), __shfl_xor_sync(0xFFFFFFFF, p.s, offset)};
        p = lse_merge(p, o);
    }
    return p;
}

static __device__ lse_pair block_lse(lse_pair p) {
    __shared__ lse_pair warp_p[TOPK_WARPS];
    __shared__ lse_pair total;
    const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
    p = warp_lse(p);
    if (lane == 0) {
        warp_p[warp] = p;
    }
    __syncthreads();
    if (warp == 0) {
        p = warp_lse(lane < TOPK_WARPS ? warp_p[lane] : lse_pair{-INFINITY, 0.0f});
        if (lane == 0) {
            total = p;
        }
    }
    __syncthreads();
    return total;
}

// A thread's best keys, descending, 0 in the empty slots; K (8, 16 or 32) >= the op's k.
template <int K>
static __device__ __forceinline__ void list_insert(uint64_t (&t)[K], uint64_t key) {
    if (key <= t[K - 1]) {
        return;
    }
    t[K - 1] = key;
#pragma unroll
    for (int j = K - 1; j > 0; --j) {    // one bubble pass moves the new key to its place
        const uint64_t a = t[j - 1], b = t[j];
        t[j - 1] = a > b ? a : b;
        t[j]     = a > b ? b : a;
    }
}

static __device__ __forceinline__ uint64_t warp_max_key(uint64_t key) {
#pragma unroll
    for (int offset = WARP_SIZE / 2; offset > 0; offset >>= 1) {
        const uint64_t o = __shfl_xor_sync(0xFFFFFFFF, key, offset);
        key = o > key ? o : key;
    }
    return key;
}

// The block's k best keys, best first, written by thread 0 to out[0..k-1]; consumes the threads' lists.
template <int K>
static __device__ void block_select(uint64_t (&t)[K], int k, uint64_t * out) {
    __shared__ uint64_t warp_best[TOPK_WARPS];
    __shared__ uint64_t winner;
    const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
    for (int r = 0; r < k; ++r) {
        uint64_t best = warp_max_key(t[0]);
        if (lane == 0) {
            warp_best[warp] = best;
        }
        __syncthreads();
        if (warp == 0) {
            best = warp_max_key(lane < TOPK_WARPS ? warp_best[lane] : 0);
            if (lane == 0) {
                winner = best;
                out[r] = best;
            }
        }
        __syncthreads();
        if (t[0] == winner && winner != 0) {   // keys are unique within a row: exactly one owner
#pragma unroll
            for (int j = 0; j < K - 1; ++j) {
                t[j] = t[j + 1];
            }
            t[K - 1] = 0;
        }
    }
}

template <int K>
static __global__ void __launch_bounds__(TOPK_THREADS)
top_k_logp_chunks(const char * x, size_t row_stride, int n, int n_chunks, int k, uint64_t * part_keys,
                  lse_pair * part_lse) {
    const int chunk = blockIdx.x;
    const int row   = blockIdx.y;
    const float * xr = (const float *) (x + row * row_stride);
    const int lo = chunk * TOPK_CHUNK;
    const int hi = min(n, lo + TOPK_CHUNK);

    ggml_cuda_pdl_sync();
    uint64_t t[K];
#pragma unroll
    for (int j = 0; j < K; ++j) {
        t[j] = 0;
    }
    lse_pair p = {-INFINITY, 0.0f};
    for (int base = lo + threadIdx.x; base < hi; base += TOPK_THREADS * TOPK_BATCH) {
        float v[TOPK_BATCH];
#pragma unroll
        for (int b = 0; b < TOPK_BATCH; ++b) {
            const int i = base + b * TOPK_THREADS;
            v[b] = i < hi ? xr[i] : 0.0f;
        }
#pragma unroll
        for (int b = 0; b < TOPK_BATCH; ++b) {
            const int i = base + b * TOPK_THREADS;
            if (i < hi) {
                lse_add(p, v[b]);
                list_insert<K>(t, ggml_ext_top_k_key(v[b], (uint32_t) i));
            }
        }
    }
    const size_t part = (size_t) row * n_chunks + chunk;
    block_select<K>(t, k, part_keys + part * k);
    p = block_lse(p);
    if (threadIdx.x == 0) {
        part_lse[part] = p;
    }
}

template <int K>
static __global__ void __launch_bounds__(TOPK_THREADS)
top_k_logp_merge(const char * x, size_t row_stride, int n_chunks, int k, const uint64_t * part_keys,
                 const lse_pair * part_lse, float * dst, size_t dst_row_stride) {
    const int row = blockIdx.x;
    const float * xr = (const float *) (x + row * row_stride);

    ggml_cuda_pdl_sync();
    uint64_t t[K];
#pragma unroll
    for (int j = 0; j < K; ++j) {
        t[j] = 0;
    }
    const uint64_t * keys = part_keys + (size_t) row * n_chunks * k;
    for (int c = threadIdx.x; c < n_chunks * k; c += TOPK_THREADS) {
        list_insert<K>(t, keys[c]);
    }
    lse_pair p = {-INFINITY, 0.0f};
    for (int c = threadIdx.x; c < n_chunks; c += TOPK_THREADS) {
        p = lse_merge(p, part_lse[(size_t) row * n_chunks + c]);
    }
    p = block_lse(p);

    __shared__ uint64_t best[GGML_EXT_TOP_K_LOGP_MAX_K];
    block_select<K>(t, k, best);
    __syncthreads();
    if (threadIdx.x < k) {
        const uint32_t id = ggml_ext_top_k_key_id(best[threadIdx.x]);
        const double lse = (double) p.m + log((double) p.s);   // -inf for a row of only -inf
        float * out = (float *) ((char *) dst + row * dst_row_stride);
        out[threadIdx.x]     = lse == -INFINITY ? -INFINITY : (float) ((double) xr[id] - lse);
        out[k + threadIdx.x] = (float) id;
    }
}

template <int K>
static void top_k_logp_launch(ggml_backend_cuda_context & ctx, const ggml_tensor * x, ggml_tensor * dst, int k) {
    const int n        = (int) x->ne[0];
    const int n_rows   = (int) x->ne[1];
    const int n_chunks = (n + TOPK_CHUNK - 1) / TOPK_CHUNK;
    ggml_cuda_pool_alloc<uint64_t> part_keys(ctx.pool(), (size_t) n_chunks * n_rows * k);
    ggml_cuda_pool_alloc<lse_pair> part_lse(ctx.pool(), (size_t) n_chunks * n_rows);
    cudaStream_t stream = ctx.stream();

    top_k_logp_chunks<K><<<dim3(n_chunks, n_rows), TOPK_THREADS, 0, stream>>>(
        (const char *) x->data, x->nb[1], n, n_chunks, k, part_keys.get(), part_lse.get());
    CUDA_CHECK(cudaGetLastError());
    top_k_logp_merge<K><<<n_rows, TOPK_THREADS, 0, stream>>>(
        (const char *) x->data, x->nb[1], n_chunks, k, part_keys.get(), part_lse.get(), (float *) dst->data,
        dst->nb[2]);
    CUDA_CHECK(cudaGetLastError());
}

void ggml_ext_cuda_top_k_logp(ggml_backend_cuda_context & ctx, ggml_tensor * dst) {
    const ggml_tensor * x = dst->src[0];
    GGML_ASSERT(x->type == GGML_TYPE_F32 && x->nb[0] == sizeof(float) && dst->type == GGML_TYPE_F32);
    const int k = dst->op_params[0];
    GGML_ASSERT(k >= 1 && k <= GGML_EXT_TOP_K_LOGP_MAX_K);
    if (x->ne[1] == 0) {
        return;
    }
    if (k <= 8) {
        top_k_logp_launch<8>(ctx, x, dst, k);
    } else if (k <= 16) {
        top_k_logp_launch<16>(ctx, x, dst, k);
    } else {
        top_k_logp_launch<32>(ctx, x, dst, k);
    }
}
