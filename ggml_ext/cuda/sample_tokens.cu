// ggml_sample_tokens / ggml_sample_probs on CUDA. One block per row: the block copies the row into pool scratch
// and penalises it, then finds the argmax, the top-k and top-p thresholds (bit by bit on the float keys, one
// block reduction per bit) and the draw (a block scan of per-thread chunk sums). Same rule as the CPU kernel;
// the sums are f32 here, f64 there, so a draw that falls within rounding of a boundary may differ.

#include "ggml-ext-cuda.cuh"
#include "ggml-ext.h"
#include "../src/sample-common.h"

#define SAMPLE_THREADS 1024
#define SAMPLE_WARPS   (SAMPLE_THREADS / 32)

template <typename T>
static __device__ T sample_block_sum(T v, T * red) {
    for (int o = 16; o > 0; o >>= 1) {
        v += __shfl_xor_sync(0xffffffff, v, o);
    }
    __syncthreads();   // red is reused by consecutive reductions
    if (threadIdx.x % 32 == 0) {
        red[threadIdx.x / 32] = v;
    }
    __syncthreads();
    v = red[threadIdx.x % 32];
    for (int o = 16; o > 0; o >>= 1) {
        v += __shfl_xor_sync(0xffffffff, v, o);
    }
    return v;
}

template <bool MAX>
static __device__ int sample_block_extreme(int v, int * red) {
    for (int o = 16; o > 0; o >>= 1) {
        const int w = __shfl_xor_sync(0xffffffff, v, o);
        v = MAX ? max(v, w) : min(v, w);
    }
    __syncthreads();
    if (threadIdx.x % 32 == 0) {
        red[threadIdx.x / 32] = v;
    }
    __syncthreads();
    v = red[threadIdx.x % 32];
    for (int o = 16; o > 0; o >>= 1) {
        const int w = __shfl_xor_sync(0xffffffff, v, o);
        v = MAX ? max(v, w) : min(v, w);
    }
    return v;
}

// The largest key, and its lowest index, over the row.
static __device__ void sample_block_argmax(const float * x, int n, float & best, int & best_i, float * redf,
                                           int * redi) {
    float v = -INFINITY;
    int vi = n;
    for (int i = threadIdx.x; i < n; i += SAMPLE_THREADS) {
        if (x[i] > v) {
            v = x[i];
            vi = i;
        }
    }
    for (int o = 16; o > 0; o >>= 1) {
        const float w = __shfl_xor_sync(0xffffffff, v, o);
        const int wi = __shfl_xor_sync(0xffffffff, vi, o);
        if (w > v || (w == v && wi < vi)) {
            v = w;
            vi = wi;
        }
    }
    __syncthreads();
    if (threadIdx.x % 32 == 0) {
        redf[threadIdx.x / 32] = v;
        redi[threadIdx.x / 32] = vi;
    }
    __syncthreads();
    v = redf[threadIdx.x % 32];
    vi = redi[threadIdx.x % 32];
    for (int o = 16; o > 0; o >>= 1) {
        const float w = __shfl_xor_sync(0xffffffff, v, o);
        const int wi = __shfl_xor_sync(0xffffffff, vi, o);
        if (w > v || (w == v && wi < vi)) {
            v = w;
            vi = wi;
        }
    }
    best = v;
    best_i = vi;
}

static __global__ void __launch_bounds__(SAMPLE_THREADS)
sample_kernel(const char * logits, size_t logits_nb1, const int32_t * hist, int n_hist, const float * par,
              const float * rand, float * scratch, int n, int32_t * tokens, char * probs, size_t probs_nb1) {
    __shared__ float redf[32];
    __shared__ int   redi[32];
    __shared__ float warp_incl[SAMPLE_WARPS];

    const int row = blockIdx.x;
    const int tid = threadIdx.x;
    const float * l = (const float *) (logits + row * logits_nb1);
    const int32_t * h = hist + (size_t) row * n_hist;
    float * x = scratch + (size_t) row * n;

    ggml_cuda_pdl_sync();
    for (int i = tid; i < n; i += SAMPLE_THREADS) {
        x[i] = l[i];
    }
    __syncthreads();
    const float repeat = par[GGML_EXT_SAMPLE_REPEAT_PENALTY];
    const float presence = par[GGML_EXT_SAMPLE_PRESENCE_PENALTY];
    const float frequency = par[GGML_EXT_SAMPLE_FREQUENCY_PENALTY];
    if (repeat != 1.0f || presence != 0.0f || frequency != 0.0f) {
        for (int j = tid; j < n_hist; j += SAMPLE_THREADS) {   // distinct tokens: one thread each
            const int count = ggml_ext_sample_count(h, n_hist, j, n);
            if (count > 0) {
                x[h[j]] = ggml_ext_sample_penalise(x[h[j]], count, repeat, presence, frequency);
            }
        }
        __syncthreads();
    }
    float m;
    int best;
    sample_block_argmax(x, n, m, best, redf, redi);

    float * p = probs ? (float *) (probs + row * probs_nb1) : nullptr;
    const float temperature = par[GGML_EXT_SAMPLE_TEMPERATURE];
    if (!(temperature > 0.0f)) {
        if (p) {
            for (int i = tid; i < n; i += SAMPLE_THREADS) {
                p[i] = i == best ? 1.0f : 0.0f;
            }
        } else if (tid == 0) {
            tokens[row] = best;
        }
        return;
    }

    uint32_t floor_key = 0;
    const int k = (int) par[GGML_EXT_SAMPLE_TOP_K];
    if (k > 0 && k < n) {
        for (int b = 31; b >= 0; --b) {
            const uint32_t c = floor_key | (1u << b);
            int count = 0;
            for (int i = tid; i < n; i += SAMPLE_THREADS) {
                count += ggml_ext_sample_key(x[i]) >= c;
            }
            if (sample_block_sum(count, redi) >= k) {
                floor_key = c;
            }
        }
    }
    const float top_p = par[GGML_EXT_SAMPLE_TOP_P];
    if (top_p < 1.0f) {
        float mass = 0.0f;
        for (int i = tid; i < n; i += SAMPLE_THREADS) {
            mass += ggml_ext_sample_key(x[i]) >= floor_key ? expf(x[i] - m) : 0.0f;
        }
        const float want = top_p * sample_block_sum(mass, redf);
        uint32_t T = 0;
        for (int b = 31; b >= 0; --b) {
            const uint32_t c = max(T | (1u << b), floor_key);
            mass = 0.0f;
            for (int i = tid; i < n; i += SAMPLE_THREADS) {
                mass += ggml_ext_sample_key(x[i]) >= c ? expf(x[i] - m) : 0.0f;
            }
            if (sample_block_sum(mass, redf) >= want) {
                T |= 1u << b;
            }
        }
        floor_key = max(T, floor_key);
    }

    // each thread takes a contiguous chunk of the row, so chunk sums scan into cumulative probabilities by id
    const float min_p = par[GGML_EXT_SAMPLE_MIN_P];
    const float inv_t = 1.0f / temperature;
    const int chunk = (n + SAMPLE_THREADS - 1) / SAMPLE_THREADS;
    const int i0 = min(n, tid * chunk);
    const int i1 = min(n, i0 + chunk);
    auto weight = [&](int i) {
        const bool kept = ggml_ext_sample_key(x[i]) >= floor_key && (min_p <= 0.0f || expf(x[i] - m) >= min_p);
        return kept ? expf((x[i] - m) * inv_t) : 0.0f;
    };
    float s = 0.0f;
    for (int i = i0; i < i1; ++i) {
        s += weight(i);
    }
    float incl = s;
    const int lane = tid % 32, warp = tid / 32;
    for (int o = 1; o < 32; o <<= 1) {
        const float y = __shfl_up_sync(0xffffffff, incl, o);
        if (lane >= o) {
            incl += y;
        }
    }
    if (lane == 31) {
        warp_incl[warp] = incl;
    }
    __syncthreads();
    if (warp == 0) {
        float w = warp_incl[lane];
        for (int o = 1; o < 32; o <<= 1) {
            const float y = __shfl_up_sync(0xffffffff, w, o);
            if (lane >= o) {
                w += y;
            }
        }
        warp_incl[lane] = w;
    }
    __syncthreads();
    if (warp > 0) {
        incl += warp_incl[warp - 1];
    }
    const float total = warp_incl[SAMPLE_WARPS - 1];

    if (p) {
        for (int i = i0; i < i1; ++i) {
            p[i] = weight(i) / total;
        }
        return;
    }
    // the chunk where the cumulative sum first exceeds u * total draws; if rounding leaves none, the last one
    const float target = rand[row] * total;
    int winner = sample_block_extreme<false>(s > 0.0f && target < incl ? tid : SAMPLE_THREADS, redi);
    if (winner == SAMPLE_THREADS) {
        winner = sample_block_extreme<true>(s > 0.0f ? tid : -1, redi);
    }
    if (tid == winner) {
        float cum = incl - s;
        int last = best;
        for (int i = i0; i < i1; ++i) {
            const float w = weight(i);
            if (w > 0.0f) {
                cum += w;
                last = i;
                if (cum > target) {
                    break;
                }
            }
        }
        tokens[row] = last;
    }
}

void ggml_ext_cuda_sample_tokens(ggml_backend_cuda_context & ctx, ggml_tensor * dst) {
    const ggml_tensor * logits = dst->src[0];
    const ggml_tensor * hist   = dst->src[1];
    const ggml_tensor * par    = dst->src[2];
    const ggml_tensor * rand   = dst->src[3];
    const bool want_probs = dst->op_params[0] != 0;

    const int n      = (int) logits->ne[0];
    const int n_rows = (int) logits->ne[1];
    ggml_cuda_pool_alloc<float> scratch(ctx.pool(), (size_t) n * n_rows);
    ggml_cuda_kernel_launch(sample_kernel, ggml_cuda_kernel_launch_params(dim3(n_rows), dim3(SAMPLE_THREADS), 0, ctx.stream()),
        (const char *) logits->data, logits->nb[1], (const int32_t *) hist->data, (int) hist->ne[0],
        (const float *) par->data, want_probs ? (const float *) nullptr : (const float *) rand->data, scratch.get(), n,
        want_probs ? (int32_t *) nullptr : (int32_t *) dst->data, want_probs ? (char *) dst->data : (char *) nullptr,
        want_probs ? dst->nb[1] : (size_t) 0);
}
