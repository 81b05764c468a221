// ggml_argmax_first on CUDA, in two passes. Pass 1: a grid of (chunks, rows) blocks; each block finds the best
// (value, index) of its ARGMAX_CHUNK values of a row (coalesced loads, warp shuffles, then shared memory). Pass
// 2: one warp per row merges its chunks' winners. "Best" is a total order (larger value, then lower index; NaN
// never wins), so the result is the lowest index of the row maximum whatever the split.

#include "ggml-ext-cuda.cuh"

#define ARGMAX_THREADS 256
#define ARGMAX_CHUNK   2048    // values per block: ~75 blocks for a 152K-token row, ~120 for 248K

struct argmax_pair {
    float v;
    int   i;     // INT_MAX: no candidate yet
};

static __device__ __forceinline__ argmax_pair argmax_better(argmax_pair a, argmax_pair b) {
    if (b.i == INT_MAX) return a;
    if (a.i == INT_MAX) return b;
    return (b.v > a.v || (b.v == a.v && b.i < a.i)) ? b : a;
}

static __device__ __forceinline__ argmax_pair argmax_warp(argmax_pair p) {
#pragma unroll
    for (int offset = WARP_SIZE / 2; offset > 0; offset >>= 1) {
        argmax_pair o;
        o.v = __shfl_xor_sync(0xFFFFFFFF, p.v, offset, WARP_SIZE);
        o.i = __shfl_xor_sync(0xFFFFFFFF, p.i, offset, WARP_SIZE);
        p = argmax_better(p, o);
    }
    return p;
}

static __global__ void __launch_bounds__(ARGMAX_THREADS)
argmax_first_chunks(const char * x, size_t row_stride, int n, int n_chunks, float * part_v, int * part_i) {
    const int chunk = blockIdx.x;
    const int row   = blockIdx.y;
    const float * xr = (const float *) (x + row * row_stride);
    const int lo = chunk * ARGMAX_CHUNK;
    const int hi = min(n, lo + ARGMAX_CHUNK);

    ggml_cuda_pdl_sync();
    argmax_pair best = {-INFINITY, INT_MAX};
    for (int i = lo + threadIdx.x; i < hi; i += ARGMAX_THREADS) {
        const float v = xr[i];
        if (v > best.v || (best.i == INT_MAX && v == best.v)) {   // a thread's indices rise: first max kept
            best.v = v;
            best.i = i;
        }
    }
    best = argmax_warp(best);

    __shared__ argmax_pair warp_best[ARGMAX_THREADS / WARP_SIZE];
    const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
    if (lane == 0) {
        warp_best[warp] = best;
    }
    __syncthreads();
    if (warp == 0) {
        best = lane < ARGMAX_THREADS / WARP_SIZE ? warp_best[lane] : argmax_pair{-INFINITY, INT_MAX};
        best = argmax_warp(best);
        if (lane == 0) {
            part_v[row * n_chunks + chunk] = best.v;
            part_i[row * n_chunks + chunk] = best.i;
        }
    }
}

static __global__ void argmax_first_merge(const float * part_v, const int * part_i, int n_chunks, int32_t * dst) {
    const int row = blockIdx.x;
    argmax_pair best = {-INFINITY, INT_MAX};
    for (int c = threadIdx.x; c < n_chunks; c += WARP_SIZE) {
        best = argmax_better(best, argmax_pair{part_v[row * n_chunks + c], part_i[row * n_chunks + c]});
    }
    best = argmax_warp(best);
    if (threadIdx.x == 0) {
        dst[row] = best.i == INT_MAX ? 0 : best.i;
    }
}

void ggml_ext_cuda_argmax_first(ggml_backend_cuda_context & ctx, ggml_tensor * dst) {
    const ggml_tensor * x = dst->src[0];
    GGML_ASSERT(x->type == GGML_TYPE_F32 && x->nb[0] == sizeof(float) && dst->type == GGML_TYPE_I32);

    const int n        = (int) x->ne[0];
    const int n_rows   = (int) x->ne[1];
    const int n_chunks = (n + ARGMAX_CHUNK - 1) / ARGMAX_CHUNK;
    if (n_rows == 0) {
        return;
    }
    ggml_cuda_pool_alloc<float> part_v(ctx.pool(), (size_t) n_chunks * n_rows);
    ggml_cuda_pool_alloc<int>   part_i(ctx.pool(), (size_t) n_chunks * n_rows);
    cudaStream_t stream = ctx.stream();

    argmax_first_chunks<<<dim3(n_chunks, n_rows), ARGMAX_THREADS, 0, stream>>>(
        (const char *) x->data, x->nb[1], n, n_chunks, part_v.get(), part_i.get());
    CUDA_CHECK(cudaGetLastError());
    argmax_first_merge<<<n_rows, WARP_SIZE, 0, stream>>>(part_v.get(), part_i.get(), n_chunks, (int32_t *) dst->data);
    CUDA_CHECK(cudaGetLastError());
}
