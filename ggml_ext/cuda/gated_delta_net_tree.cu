// ggml_gated_delta_net_tree and ggml_gated_delta_net_tree_persist on CUDA.
//
// The delta rule keeps the value columns of the state independent: column j of S (S[:, j], over the keys) only
// needs k, q, v[j], beta and the decay. So, as upstream's chain kernel, each warp owns one column of one head of
// one sequence and keeps it in registers (S_v/32 rows per lane), with blocks of GDN_TREE_WARPS columns over a
// grid (H_v, n_s, S_v/GDN_TREE_WARPS). The warp walks the tree in node order: a node whose parent is the node
// just computed continues from the registers; any other node reloads its start column, from the committed state
// (parent -1) or from its parent's stored state, which this same lane wrote earlier (so no synchronisation).
// After each node the column is stored to the node states (the output tail, or `inter` in f32 or f16; with f16
// the registers keep the rounded values, so that children start from what is stored, as on the CPU). The next
// node's q, k, v, g, beta and parent are loaded while the current one is computed.

#include "ggml-ext-cuda.cuh"
#include "../src/tree-walk.h"

#include <cuda_fp16.h>

#define GDN_TREE_WARPS 4

namespace {

struct gdn_tree_args {
    const float * q;
    const float * k;
    const float * v;
    const float * g;       // contiguous [1 or S_v, H, n_t, n_s]
    const float * beta;    // contiguous [1, H, n_t, n_s]
    const float * state;   // contiguous [S_v, S_v, H, n_s]
    const int   * parent;  // [n_t, n_s]
    float       * o;       // [S_v, H, n_t, n_s]
    void        * nodes;   // [S_v*S_v, H, n_t(_max), n_s] of float or half
    int H, n_t, H_q, H_k, rq3, rk3;
    int64_t sq1, sq2, sq3, sk1, sk2, sk3, sv1, sv2, sv3;  // in floats
    int64_t node_s1, node_s2, node_s3;                     // in elements: per head, node, sequence
    int64_t par_s1;                                        // in ints: per sequence
    float scale;
};

template <typename T> struct node_io;

template <> struct node_io<float> {
    static __device__ __forceinline__ float load(const float * p) { return *p; }
    // stores x; returns what a reader of the node will see
    static __device__ __forceinline__ float store(float * p, float x) { *p = x; return x; }
};

template <> struct node_io<half> {
    static __device__ __forceinline__ float load(const half * p) { return __half2float(*p); }
    static __device__ __forceinline__ float store(half * p, float x) {
        const half h = __float2half(x);
        *p = h;
        return __half2float(h);
    }
};

// One token's inputs as this lane needs them.
template <int S_v, bool KDA>
struct gdn_token {
    static constexpr int R = S_v / WARP_SIZE;
    float q[R], k[R], g[KDA ? R : 1];
    float v, beta;
    int   parent;

    __device__ __forceinline__ void load(const gdn_tree_args & a, const float * q_s, const float * k_s,
                                         const float * v_s, int64_t gb, const int * par, int t, int lane) {
        const float * q_t = q_s + t * a.sq2;
        const float * k_t = k_s + t * a.sk2;
#pragma unroll
        for (int r = 0; r < R; ++r) {
            q[r] = q_t[r * WARP_SIZE + lane];
            k[r] = k_t[r * WARP_SIZE + lane];
        }
        const int64_t gbt = gb + (int64_t) t * a.H;  // ((s*n_t + t)*H + h)
        if constexpr (KDA) {
#pragma unroll
            for (int r = 0; r < R; ++r) {
                g[r] = expf(a.g[gbt * S_v + r * WARP_SIZE + lane]);
            }
        } else {
            g[0] = expf(a.g[gbt]);
        }
        v      = v_s[t * a.sv2];
        beta   = a.beta[gbt];
        parent = ggml_ext_parent(par, t);
    }
};

template <int S_v, bool KDA, typename node_t>
__global__ void __launch_bounds__(WARP_SIZE * GDN_TREE_WARPS)
gdn_tree_kernel(const gdn_tree_args a) {
    constexpr int R = S_v / WARP_SIZE;
    static_assert(S_v % WARP_SIZE == 0, "S_v must be a multiple of the warp size");

    const int h    = blockIdx.x;
    const int s    = blockIdx.y;
    const int lane = threadIdx.x;
    const int col  = blockIdx.z * GDN_TREE_WARPS + threadIdx.y;

    // Wait for the kernels before this one (launched with programmatic dependent launch): also before any write,
    // since an earlier kernel may still read `inter` (a rollback copy).
    ggml_cuda_pdl_sync();

    const float * q_s = a.q + (s / a.rq3) * a.sq3 + (h % a.H_q) * a.sq1;
    const float * k_s = a.k + (s / a.rk3) * a.sk3 + (h % a.H_k) * a.sk1;
    const float * v_s = a.v + s * a.sv3 + h * a.sv1 + col;
    const int   * par = a.parent + s * a.par_s1;
    const int64_t gb  = (int64_t) s * a.n_t * a.H + h;

    const float * committed = a.state + (((int64_t) s * a.H + h) * S_v + col) * S_v;
    node_t      * nodes     = (node_t *) a.nodes + s * a.node_s3 + h * a.node_s1 + col * S_v;
    float       * o         = a.o + gb * S_v + col;

    float S[R];
    gdn_token<S_v, KDA> cur, next;
    cur.load(a, q_s, k_s, v_s, gb, par, 0, lane);

    for (int t = 0; t < a.n_t; ++t) {
        if (cur.parent < 0) {
#pragma unroll
            for (int r = 0; r < R; ++r) {
                S[r] = committed[r * WARP_SIZE + lane];
            }
        } else if (cur.parent != t - 1) {
            const node_t * from = nodes + cur.parent * a.node_s2;
#pragma unroll
            for (int r = 0; r < R; ++r) {
                S[r] = node_io<node_t>::load(from + r * WARP_SIZE + lane);
            }
        }
        if (t + 1 < a.n_t) {
            next.load(a, q_s, k_s, v_s, gb, par, t + 1, lane);
        }

        // kv = (decayed S)^T k for this column; delta = beta (v - kv); S = decay S + k delta; o = S^T q
        float kv = 0.0f;
#pragma unroll
        for (int r = 0; r < R; ++r) {
            kv += (KDA ? cur.g[r] : 1.0f) * S[r] * cur.k[r];
        }
        kv = warp_reduce_sum<WARP_SIZE>(kv);
        const float delta = (cur.v - (KDA ? 1.0f : cur.g[0]) * kv) * cur.beta;

        node_t * to = nodes + t * a.node_s2;
        float oq = 0.0f;
#pragma unroll
        for (int r = 0; r < R; ++r) {
            S[r] = (KDA ? cur.g[r] : cur.g[0]) * S[r] + cur.k[r] * delta;
            oq += S[r] * cur.q[r];
            S[r] = node_io<node_t>::store(to + r * WARP_SIZE + lane, S[r]);
        }
        oq = warp_reduce_sum<WARP_SIZE>(oq);
        if (lane == 0) {
            o[(int64_t) t * a.H * S_v] = oq * a.scale;
        }
        cur = next;
    }
}

template <int S_v, bool KDA, typename node_t>
static void launch(const gdn_tree_args & a, int n_s, cudaStream_t stream) {
    const dim3 grid(a.H, n_s, S_v / GDN_TREE_WARPS);
    const dim3 block(WARP_SIZE, GDN_TREE_WARPS, 1);
    ggml_cuda_kernel_launch(gdn_tree_kernel<S_v, KDA, node_t>, ggml_cuda_kernel_launch_params(grid, block, 0, stream), a);
}

template <typename node_t>
static void launch_for(const gdn_tree_args & a, int S_v, bool kda, int n_s, cudaStream_t stream) {
    switch (S_v) {
        case 64:  kda ? launch<64,  true, node_t>(a, n_s, stream) : launch<64,  false, node_t>(a, n_s, stream); break;
        case 128: kda ? launch<128, true, node_t>(a, n_s, stream) : launch<128, false, node_t>(a, n_s, stream); break;
        default:  GGML_ABORT("ggml_ext: gated_delta_net_tree on CUDA takes head size 64 or 128, not %d", S_v);
    }
}

static void gdn_tree(ggml_backend_cuda_context & ctx, ggml_tensor * dst, const ggml_tensor * inter) {
    const ggml_tensor * q      = dst->src[0];
    const ggml_tensor * k      = dst->src[1];
    const ggml_tensor * v      = dst->src[2];
    const ggml_tensor * g      = dst->src[3];
    const ggml_tensor * beta   = dst->src[4];
    const ggml_tensor * state  = dst->src[5];
    const ggml_tensor * parent = dst->src[6];

    const int64_t S_v = v->ne[0];
    const int64_t H   = v->ne[1];
    const int64_t n_t = v->ne[2];
    const int64_t n_s = v->ne[3];

    gdn_tree_args a;
    a.q      = (const float *) q->data;
    a.k      = (const float *) k->data;
    a.v      = (const float *) v->data;
    a.g      = (const float *) g->data;
    a.beta   = (const float *) beta->data;
    a.state  = (const float *) state->data;
    a.parent = (const int *) parent->data;
    a.o      = (float *) dst->data;
    a.H      = (int) H;
    a.n_t    = (int) n_t;
    a.H_q    = (int) q->ne[1];
    a.H_k    = (int) k->ne[1];
    a.rq3    = (int) (n_s / q->ne[3]);
    a.rk3    = (int) (n_s / k->ne[3]);
    a.sq1 = q->nb[1] / sizeof(float); a.sq2 = q->nb[2] / sizeof(float); a.sq3 = q->nb[3] / sizeof(float);
    a.sk1 = k->nb[1] / sizeof(float); a.sk2 = k->nb[2] / sizeof(float); a.sk3 = k->nb[3] / sizeof(float);
    a.sv1 = v->nb[1] / sizeof(float); a.sv2 = v->nb[2] / sizeof(float); a.sv3 = v->nb[3] / sizeof(float);
    a.par_s1 = parent->nb[1] / sizeof(int);
    a.scale  = 1.0f / sqrtf((float) S_v);

    const bool kda = g->ne[0] == S_v;
    cudaStream_t stream = ctx.stream();
    if (inter == nullptr) {
        a.nodes   = (float *) dst->data + S_v * H * n_t * n_s;
        a.node_s1 = S_v * S_v;
        a.node_s2 = a.node_s1 * H;
        a.node_s3 = a.node_s2 * n_t;
        launch_for<float>(a, (int) S_v, kda, (int) n_s, stream);
    } else {
        const size_t elem = ggml_type_size(inter->type);
        a.nodes   = inter->data;
        a.node_s1 = inter->nb[1] / elem;
        a.node_s2 = inter->nb[2] / elem;
        a.node_s3 = inter->nb[3] / elem;
        if (inter->type == GGML_TYPE_F16) {
            launch_for<half>(a, (int) S_v, kda, (int) n_s, stream);
        } else {
            launch_for<float>(a, (int) S_v, kda, (int) n_s, stream);
        }
    }
}

} // namespace

bool ggml_ext_cuda_gated_delta_net_tree_supported(const ggml_tensor * op) {
    const int64_t S_v = op->src[2]->ne[0];
    if (S_v != 64 && S_v != 128) {
        return false;
    }
    // q, k, v rows, and the contiguous g, beta, state, parent, inter are checked by the constructor
    return op->op != GGML_OP_GATED_DELTA_NET_TREE_PERSIST ||
           op->src[7]->type == GGML_TYPE_F32 || op->src[7]->type == GGML_TYPE_F16;
}

void ggml_ext_cuda_gated_delta_net_tree(ggml_backend_cuda_context & ctx, ggml_tensor * dst) {
    gdn_tree(ctx, dst, nullptr);
}

void ggml_ext_cuda_gated_delta_net_tree_persist(ggml_backend_cuda_context & ctx, ggml_tensor * dst) {
    gdn_tree(ctx, dst, dst->src[7]);
}
