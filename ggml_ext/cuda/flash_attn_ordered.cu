// ggml_flash_attn_ordered on CUDA: one block of D threads per (query, head). The KV range is taken in chunks of
// D cells: first each thread scores one cell of the chunk (q.k in the fixed order of ggml-ext.h, the query in
// shared memory), then every thread folds the chunk's scores in ascending cell order into its own output value
// (thread d holds a[d]; m and l are computed identically by all threads). No reduction crosses cells or threads
// in an order that depends on the number of queries, the KV length or where the unmasked cells sit, so a query's
// output is the same bits in a decode and in a tree verify. The price: the KV range is not split across blocks.

#include "ggml-ext-cuda.cuh"

#include <cuda_fp16.h>

#define FA_ORDERED_PREFETCH 8   // V values loaded ahead of the fold, so one load latency covers several cells

namespace {

struct fa_ordered_args {
    const char * q;      // f32 [D, n_q, H_q]
    const char * k;      // f16 [D, n_kv, H_kv]
    const char * v;      // f16 [D, n_kv, H_kv]
    const char * mask;   // f16 [n_kv, >= n_q]
    float      * dst;    // f32 [D, H_q, n_q], contiguous
    int n_kv, H_q, ratio;
    size_t q_nb1, q_nb2, k_nb1, k_nb2, v_nb1, v_nb2, mask_nb1;
    float scale;
};

// The online-softmax step for one unmasked cell (score s, this thread's V value vd).
static __device__ __forceinline__ void fold(const float s, const float vd, float & m, float & l, float & a) {
    if (s > m) {
        const float r = expf(m - s);
        l *= r;
        a *= r;
        m  = s;
    }
    const float p = expf(s - m);
    l += p;
    a  = fmaf(p, vd, a);
}

template <int D>
__global__ void __launch_bounds__(D) flash_attn_ordered_kernel(const fa_ordered_args args) {
    __shared__ float sq[D];       // the query row
    __shared__ float ss[D];       // the chunk's scores, -inf for a removed cell

    const int i   = blockIdx.x;   // query
    const int h   = blockIdx.y;   // head
    const int tid = threadIdx.x;

    ggml_cuda_pdl_sync();

    sq[tid] = ((const float *) (args.q + i * args.q_nb1 + h * args.q_nb2))[tid];
    const half * mrow = (const half *) (args.mask + i * args.mask_nb1);
    const char * kh   = args.k + (h / args.ratio) * args.k_nb2;
    const char * vh   = args.v + (h / args.ratio) * args.v_nb2;

    float m = -INFINITY;
    float l = 0.0f;
    float a = 0.0f;

    for (int j0 = 0; j0 < args.n_kv; j0 += D) {
        __syncthreads();  // sq written (first chunk) / the previous chunk's scores consumed
        const int j = j0 + tid;
        float s = -INFINITY;
        if (j < args.n_kv) {
            const float mk = __half2float(mrow[j]);
            if (mk != -INFINITY) {
                // q.k: 4 partial sums (d mod 4) in ascending d, then (s0 + s1) + (s2 + s3)
                const half2 * kr = (const half2 *) (kh + j * args.k_nb1);
                float part[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
                for (int d = 0; d < D; d += 4) {
                    const float2 k01 = __half22float2(kr[d / 2]);
                    const float2 k23 = __half22float2(kr[d / 2 + 1]);
                    part[0] = fmaf(sq[d],     k01.x, part[0]);
                    part[1] = fmaf(sq[d + 1], k01.y, part[1]);
                    part[2] = fmaf(sq[d + 2], k23.x, part[2]);
                    part[3] = fmaf(sq[d + 3], k23.y, part[3]);
                }
                s = args.scale * ((part[0] + part[1]) + (part[2] + part[3])) + mk;
            }
        }
        ss[tid] = s;
        __syncthreads();

        const int nc = min(D, args.n_kv - j0);
        for (int c0 = 0; c0 < nc; c0 += FA_ORDERED_PREFETCH) {
            float vd[FA_ORDERED_PREFETCH];
#pragma unroll
            for (int u = 0; u < FA_ORDERED_PREFETCH; ++u) {
                const int c = c0 + u;
                vd[u] = (c < nc && ss[c] != -INFINITY) ? __half2float(((const half *) (vh + (j0 + c) * args.v_nb1))[tid])
                                                       : 0.0f;
            }
#pragma unroll
            for (int u = 0; u < FA_ORDERED_PREFETCH; ++u) {
                const int c = c0 + u;
                if (c < nc && ss[c] != -INFINITY) {   // the same for every thread: no divergence
                    fold(ss[c], vd[u], m, l, a);
                }
            }
        }
    }
    args.dst[((int64_t) i * args.H_q + h) * D + tid] = l > 0.0f ? a / l : 0.0f;
}

template <int D>
static void launch(const fa_ordered_args & args, int n_q, cudaStream_t stream) {
    const dim3 grid(n_q, args.H_q, 1);
    ggml_cuda_kernel_launch(flash_attn_ordered_kernel<D>, ggml_cuda_kernel_launch_params(grid, D, 0, stream), args);
}

} // namespace

bool ggml_ext_cuda_flash_attn_ordered_supported(const ggml_tensor * op) {
    const ggml_tensor * k = op->src[1];
    const ggml_tensor * v = op->src[2];
    const int64_t D = op->src[0]->ne[0];
    // half2 loads of K rows; the constructor checked types, shapes and contiguous rows
    return (D == 64 || D == 128 || D == 256 || D == 512) && k->nb[1] % 4 == 0 && k->nb[2] % 4 == 0 &&
           k->ne[1] <= INT32_MAX && op->src[0]->ne[1] <= INT32_MAX && op->src[0]->ne[2] <= 65535 &&
           v->nb[0] == sizeof(half);
}

void ggml_ext_cuda_flash_attn_ordered(ggml_backend_cuda_context & ctx, ggml_tensor * dst) {
    const ggml_tensor * q    = dst->src[0];
    const ggml_tensor * k    = dst->src[1];
    const ggml_tensor * v    = dst->src[2];
    const ggml_tensor * mask = dst->src[3];
    GGML_ASSERT(ggml_is_contiguous(dst));
    GGML_ASSERT(((uintptr_t) k->data) % 4 == 0);

    fa_ordered_args args;
    args.q        = (const char *) q->data;
    args.k        = (const char *) k->data;
    args.v        = (const char *) v->data;
    args.mask     = (const char *) mask->data;
    args.dst      = (float *) dst->data;
    args.n_kv     = (int) k->ne[1];
    args.H_q      = (int) q->ne[2];
    args.ratio    = (int) (q->ne[2] / k->ne[2]);
    args.q_nb1    = q->nb[1];
    args.q_nb2    = q->nb[2];
    args.k_nb1    = k->nb[1];
    args.k_nb2    = k->nb[2];
    args.v_nb1    = v->nb[1];
    args.v_nb2    = v->nb[2];
    args.mask_nb1 = mask->nb[1];
    memcpy(&args.scale, dst->op_params, sizeof(float));

    const int n_q = (int) q->ne[1];
    cudaStream_t stream = ctx.stream();
    switch (q->ne[0]) {
        case 64:  launch<64>(args, n_q, stream);  break;
        case 128: launch<128>(args, n_q, stream); break;
        case 256: launch<256>(args, n_q, stream); break;
        case 512: launch<512>(args, n_q, stream); break;
        default:  GGML_ABORT("ggml_ext: flash_attn_ordered on CUDA takes head size 64, 128, 256 or 512, not %d",
                             (int) q->ne[0]);
    }
}
