// ggml_gated_delta_net_tree and ggml_gated_delta_net_tree_persist on CUDA.
//
// The delta rule keeps the value columns of the state independent: column j of S (S[:, j], over the keys) only
// needs k, q, v[j], beta and the decay. Each column is held in registers by LPC = S_v/RPL neighbouring lanes, RPL
// (GDN_TREE_RPL) rows each, so one warp carries 32/LPC columns and a dot product over the keys is RPL FMAs per
// lane plus log2(LPC) shuffles. A block of W (GDN_TREE_WARPS) warps takes CB columns of one head of one
// sequence: grid (H_v, n_s, S_v/CB).
// The block stages the inputs of a chunk of tokens at a time in shared memory (q, k, exp(g), beta, the parents and
// its columns of v; a 23-node verify tree is one chunk) with coalesced loads, then walks the tree in node order: a
// node whose parent is the node just computed continues from the registers; any other node reloads its start
// column, from the committed state (parent -1) or from its parent's stored state, which the same lane wrote
// earlier (so no synchronisation is needed). That reload is asked for while the node before it computes (a second
// register copy of the column): waiting for it was most of this latency-bound kernel's stalls (H100 profile: 1.5
// warps per scheduler, 82% of cycles with none eligible, half of the stalls on global loads). After each node the
// column is stored to the node states (the output tail, or `inter` in f32 or f16, with 16-byte stores; with f16
// the registers keep the rounded values, so children start from what is stored, as on the CPU), and its delta to
// the output's last part (not by the persist op). The node-state stores dominate the memory traffic: 23 nodes of
// the 27B layer are 72 MB in f32, 36 MB in f16; ggml_gated_delta_net_tree_o stores only the states a later node
// reloads.

#include "ggml-ext-cuda.cuh"
#include "../src/tree-walk.h"

#include <cuda_fp16.h>

// tokens staged in shared memory at once: 32 (a budget-22 tree in one round) where the per-row decay of KDA does
// not make that more than the 48 KB of static shared memory
#define GDN_TREE_CHUNK(KDA) ((KDA) ? 16 : 32)
#define GDN_TREE_PARENTS 256    // parents staged for the look-ahead (more nodes: the rest read from global memory)
// Rows per lane and warps per block. Measured on an H100 at the 27B shape (docs/benchmarks.md), 8, 16 and 32 rows
// with 4 or 8 warps were within 5% of each other; 32 rows and 4 warps keeps the most columns per warp.
#define GDN_TREE_RPL   32
#define GDN_TREE_WARPS 4
#define GDN_TREE_MASK_WORDS 8   // o only: trees of up to 256 nodes skip the stores no node reloads (larger: store all)

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
    float       * deltas;  // [S_v, H, n_t, n_s] (node t's at t * delta_ts), or null (the persist op)
    int64_t       delta_ts;   // floats from node t's deltas to node t+1's
    float       * steps;   // ggml_gated_delta_net_tree_steps: node t's key and log-decay also go to its column
    int64_t       steps_ld;   // floats per column of steps
    int           g_ne0;   // 1 or S_v (KDA)
    void        * nodes;   // [S_v*S_v, H, n_t(_max), n_s] of float or half
    int H, n_t, H_q, H_k, rq3, rk3;
    int64_t sq1, sq2, sq3, sk1, sk2, sk3, sv1, sv2, sv3;  // in floats
    int64_t node_s1, node_s2, node_s3;                     // in elements: per head, node, sequence
    int64_t par_s1;                                        // in ints: per sequence
    float scale;
    bool o_only;           // ggml_gated_delta_net_tree_o: store only the node states that the walk reloads
};

// A lane's 32 rows of a column are NCH chunks of CH consecutive rows, CH = 16 bytes of the node type (4 f32 or
// 8 f16), chunk c of lane seg at rows (c*LPC + seg)*CH: the LPC lanes of a column move LPC*16 contiguous bytes
// per instruction (whole sectors: partial-sector stores halved the f32 bandwidth). Loads and stores go 16 bytes
// at a time where VEC (the caller checked alignment). `p` points at the lane's first chunk; chunks are
// LPC*CH elements apart.
template <bool VEC, int CH, int LPC, int RPL>
static __device__ __forceinline__ void load_rows(const float * p, float (&x)[RPL]) {
#pragma unroll
    for (int c = 0; c < RPL / CH; ++c) {
#pragma unroll
        for (int e = 0; e < CH; e += 4) {
            const float * src = p + c * LPC * CH + e;
            if constexpr (VEC) {
                const float4 f = *(const float4 *) src;
                x[c * CH + e] = f.x; x[c * CH + e + 1] = f.y; x[c * CH + e + 2] = f.z; x[c * CH + e + 3] = f.w;
            } else {
                x[c * CH + e] = src[0]; x[c * CH + e + 1] = src[1]; x[c * CH + e + 2] = src[2]; x[c * CH + e + 3] = src[3];
            }
        }
    }
}

template <bool VEC, int CH, int LPC, int RPL>
static __device__ __forceinline__ void load_rows(const half * p, float (&x)[RPL]) {
    static_assert(CH == 8, "f16 chunks are 8 rows");
#pragma unroll
    for (int c = 0; c < RPL / CH; ++c) {
        const half * src = p + c * LPC * CH;
        half2 h[4];
        if constexpr (VEC) {
            *(uint4 *) h = *(const uint4 *) src;
        } else {
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                h[j] = __halves2half2(src[2 * j], src[2 * j + 1]);
            }
        }
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const float2 f = __half22float2(h[j]);
            x[c * CH + 2 * j] = f.x; x[c * CH + 2 * j + 1] = f.y;
        }
    }
}

// Stores x; x becomes what a reader of the stored node will see (the f16 rounding).
template <bool VEC, int CH, int LPC, int RPL>
static __device__ __forceinline__ void store_rows(float * p, const float (&x)[RPL]) {
#pragma unroll
    for (int c = 0; c < RPL / CH; ++c) {
#pragma unroll
        for (int e = 0; e < CH; e += 4) {
            float * dst = p + c * LPC * CH + e;
            if constexpr (VEC) {
                *(float4 *) dst = make_float4(x[c * CH + e], x[c * CH + e + 1], x[c * CH + e + 2], x[c * CH + e + 3]);
            } else {
                dst[0] = x[c * CH + e]; dst[1] = x[c * CH + e + 1]; dst[2] = x[c * CH + e + 2]; dst[3] = x[c * CH + e + 3];
            }
        }
    }
}

template <bool VEC, int CH, int LPC, int RPL>
static __device__ __forceinline__ void store_rows(half * p, float (&x)[RPL]) {
    static_assert(CH == 8, "f16 chunks are 8 rows");
#pragma unroll
    for (int c = 0; c < RPL / CH; ++c) {
        half2 h[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            h[j] = __floats2half2_rn(x[c * CH + 2 * j], x[c * CH + 2 * j + 1]);
            const float2 f = __half22float2(h[j]);
            x[c * CH + 2 * j] = f.x; x[c * CH + 2 * j + 1] = f.y;
        }
        half * dst = p + c * LPC * CH;
        if constexpr (VEC) {
            *(uint4 *) dst = *(const uint4 *) h;
        } else {
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                dst[2 * j] = __low2half(h[j]); dst[2 * j + 1] = __high2half(h[j]);
            }
        }
    }
}

// One step's two roundings of a state element, spelled out so that gated_delta_net_path repeats them exactly:
// the decay (exp(g) times S), then the rank-one update (S + k delta, one fused multiply-add).
static __device__ __forceinline__ float gdn_decay(float s, float decay) {
    return __fmul_rn(s, decay);
}

static __device__ __forceinline__ float gdn_update(float s, float k, float delta) {
    return __fmaf_rn(k, delta, s);
}

template <int LPC>
static __device__ __forceinline__ float column_sum(float x) {
#pragma unroll
    for (int offset = 1; offset < LPC; offset <<= 1) {
        x += __shfl_xor_sync(0xffffffff, x, offset, WARP_SIZE);
    }
    return x;
}

// ggml_gated_delta_net_tree_steps: the key (head h < H_k) and the log-decay of head h of every node, copied into
// the nodes' step columns by the first block of head h (the deltas are written where they are computed).
static __device__ void write_key_and_decay_steps(const gdn_tree_args & a, int S_v, int h, int tid, int nthreads) {
    if (a.steps == nullptr || blockIdx.z != 0) {
        return;
    }
    const int64_t key_dim = (int64_t) S_v * a.H_k;
    if (h < a.H_k) {
        for (int i = tid; i < a.n_t * S_v; i += nthreads) {
            const int t = i / S_v, r = i % S_v;
            a.steps[t * a.steps_ld + h * S_v + r] = a.k[t * a.sk2 + h * a.sk1 + r];
        }
    }
    for (int i = tid; i < a.n_t * a.g_ne0; i += nthreads) {
        const int t = i / a.g_ne0, r = i % a.g_ne0;
        a.steps[t * a.steps_ld + key_dim + (int64_t) S_v * a.H + h * a.g_ne0 + r] =
            a.g[((int64_t) t * a.H + h) * a.g_ne0 + r];
    }
}

template <int S_v, bool KDA, typename node_t, bool VEC, int W, int RPL>
__global__ void __launch_bounds__(WARP_SIZE * W)
gdn_tree_kernel(const gdn_tree_args a) {
    constexpr int LPC = S_v / RPL;              // lanes per column
    constexpr int CPW = WARP_SIZE / LPC;        // columns per warp
    constexpr int CB  = CPW * W;                // columns per block
    constexpr int CH  = 16 / sizeof(node_t);    // rows per chunk
    constexpr int NCH = RPL / CH;               // chunks per lane
    constexpr int TC  = GDN_TREE_CHUNK(KDA);
    constexpr int NT  = WARP_SIZE * W;
    static_assert(S_v % RPL == 0 && WARP_SIZE % LPC == 0 && RPL % CH == 0, "unsupported head size");

    __shared__ float sq[TC][S_v];
    __shared__ float sk[TC][S_v];
    __shared__ float sg[TC][KDA ? S_v : 1];
    __shared__ float sv[TC][CB];
    __shared__ float sb[TC];
    __shared__ int   sp[GDN_TREE_PARENTS];   // the parents of nodes 0 .. GDN_TREE_PARENTS-1
    __shared__ uint32_t reloaded[GDN_TREE_MASK_WORDS];   // o only: bit t = a later node starts from node t's state

    const int h    = blockIdx.x;
    const int s    = blockIdx.y;
    const int tid  = threadIdx.y * WARP_SIZE + threadIdx.x;
    const int seg  = threadIdx.x % LPC;
    const int cb   = threadIdx.y * CPW + threadIdx.x / LPC;  // column within the block
    const int col0 = blockIdx.z * CB;
    const int col  = col0 + cb;

    // Wait for the kernels before this one (programmatic dependent launch): also before any write, since an
    // earlier kernel may still read `inter` (a rollback copy).
    ggml_cuda_pdl_sync();

    const float * q_s = a.q + (s / a.rq3) * a.sq3 + (h % a.H_q) * a.sq1;
    const float * k_s = a.k + (s / a.rk3) * a.sk3 + (h % a.H_k) * a.sk1;
    const float * v_s = a.v + s * a.sv3 + h * a.sv1 + col0;
    const int   * par = a.parent + s * a.par_s1;
    const int64_t gb  = (int64_t) s * a.n_t * a.H + h;  // + t*H: the (h, t, s) index of g and beta

    const float * committed = a.state + (((int64_t) s * a.H + h) * S_v + col) * S_v + seg * CH;
    node_t      * nodes     = (node_t *) a.nodes + s * a.node_s3 + h * a.node_s1 + col * S_v + seg * CH;
    float       * o         = a.o + gb * S_v + col;
    float       * deltas    = a.deltas == nullptr ? nullptr
                                                  : a.deltas + (int64_t) s * a.n_t * a.delta_ts + h * S_v + col;
    write_key_and_decay_steps(a, S_v, h, tid, NT);

    for (int t = tid; t < min(a.n_t, GDN_TREE_PARENTS); t += NT) {
        sp[t] = ggml_ext_parent(par, t);
    }
    // (ordered before the reads below by the chunk loop's first __syncthreads)
    auto parent_of = [&](int t) { return t < GDN_TREE_PARENTS ? sp[t] : ggml_ext_parent(par, t); };

    // o only: which node states a later node reloads (it is not its parent's direct successor); the others, chain
    // links and leaves, are never read back, so their stores (most of this kernel's traffic) are skipped
    const bool store_all = !a.o_only || a.n_t > 32 * GDN_TREE_MASK_WORDS;
    if (!store_all) {
        for (int i = tid; i < GDN_TREE_MASK_WORDS; i += NT) {
            reloaded[i] = 0;
        }
        __syncthreads();
        for (int t = tid; t < a.n_t; t += NT) {
            const int p = ggml_ext_parent(par, t);
            if (p >= 0 && p != t - 1) {
                atomicOr(&reloaded[p / 32], 1u << (p % 32));
            }
        }
        // (the chunk loop's first __syncthreads orders these writes before the reads below)
    }

    float S[RPL];     // S[c*CH + e] is row (c*LPC + seg)*CH + e of the column
    float next[RPL];  // the start column of the next node, where it does not continue from this one
    load_rows<VEC, CH, LPC, RPL>(committed, next);   // node 0's (its parent is always -1)

    for (int t0 = 0; t0 < a.n_t; t0 += TC) {
        const int tc = min(TC, a.n_t - t0);
        __syncthreads();  // the previous chunk is consumed
        for (int i = tid; i < tc * S_v; i += NT) {
            const int tt = i / S_v, r = i % S_v;
            sq[tt][r] = q_s[(t0 + tt) * a.sq2 + r];
            sk[tt][r] = k_s[(t0 + tt) * a.sk2 + r];
            if constexpr (KDA) {
                sg[tt][r] = expf(a.g[(gb + (int64_t) (t0 + tt) * a.H) * S_v + r]);
            }
        }
        for (int i = tid; i < tc * CB; i += NT) {
            const int tt = i / CB, c = i % CB;
            sv[tt][c] = v_s[(t0 + tt) * a.sv2 + c];
        }
        for (int tt = tid; tt < tc; tt += NT) {
            const int64_t gbt = gb + (int64_t) (t0 + tt) * a.H;
            sb[tt] = a.beta[gbt];
            if constexpr (!KDA) {
                sg[tt][0] = expf(a.g[gbt]);
            }
        }
        __syncthreads();

        for (int tt = 0; tt < tc; ++tt) {
            const int t = t0 + tt;
            if (t == 0 || parent_of(t) != t - 1) {
#pragma unroll
                for (int i = 0; i < RPL; ++i) {
                    S[i] = next[i];
                }
            }
            // ask for the next node's start column now if it does not continue from this node: the committed
            // state, or a state stored by this lane before this node
            if (t + 1 < a.n_t) {
                const int pn = parent_of(t + 1);
                if (pn < 0) {
                    load_rows<VEC, CH, LPC, RPL>(committed, next);
                } else if (pn != t) {
                    load_rows<VEC, CH, LPC, RPL>(nodes + pn * a.node_s2, next);
                }
            }

            // the lane's rows of q, k, exp(g): float4 e/4 of chunk c
            const float * qt = &sq[tt][seg * CH];
            const float * kt = &sk[tt][seg * CH];
            const float * gt = &sg[tt][KDA ? seg * CH : 0];

            // decay, then kv = S^T k over this lane's rows (4 partial sums), summed over the column's lanes
            float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
            for (int c = 0; c < NCH; ++c) {
#pragma unroll
                for (int e = 0; e < CH; e += 4) {
                    const int i = c * CH + e;
                    const float4 kk = *(const float4 *) (kt + c * LPC * CH + e);
                    if constexpr (KDA) {
                        const float4 gg = *(const float4 *) (gt + c * LPC * CH + e);
                        S[i]     = gdn_decay(S[i], gg.x);     S[i + 1] = gdn_decay(S[i + 1], gg.y);
                        S[i + 2] = gdn_decay(S[i + 2], gg.z); S[i + 3] = gdn_decay(S[i + 3], gg.w);
                    } else {
                        const float gs = gt[0];
                        S[i]     = gdn_decay(S[i], gs);     S[i + 1] = gdn_decay(S[i + 1], gs);
                        S[i + 2] = gdn_decay(S[i + 2], gs); S[i + 3] = gdn_decay(S[i + 3], gs);
                    }
                    acc[0] += S[i] * kk.x; acc[1] += S[i + 1] * kk.y; acc[2] += S[i + 2] * kk.z; acc[3] += S[i + 3] * kk.w;
                }
            }
            const float kv    = column_sum<LPC>((acc[0] + acc[1]) + (acc[2] + acc[3]));
            const float delta = (sv[tt][cb] - kv) * sb[tt];

            // S += k delta; o = S^T q
            acc[0] = acc[1] = acc[2] = acc[3] = 0.0f;
#pragma unroll
            for (int c = 0; c < NCH; ++c) {
#pragma unroll
                for (int e = 0; e < CH; e += 4) {
                    const int i = c * CH + e;
                    const float4 kk = *(const float4 *) (kt + c * LPC * CH + e);
                    const float4 qq = *(const float4 *) (qt + c * LPC * CH + e);
                    S[i]     = gdn_update(S[i], kk.x, delta);     acc[0] += S[i]     * qq.x;
                    S[i + 1] = gdn_update(S[i + 1], kk.y, delta); acc[1] += S[i + 1] * qq.y;
                    S[i + 2] = gdn_update(S[i + 2], kk.z, delta); acc[2] += S[i + 2] * qq.z;
                    S[i + 3] = gdn_update(S[i + 3], kk.w, delta); acc[3] += S[i + 3] * qq.w;
                }
            }
            const float oq = column_sum<LPC>((acc[0] + acc[1]) + (acc[2] + acc[3]));
            if (seg == 0) {
                o[(int64_t) t * a.H * S_v] = oq * a.scale;
                if (deltas != nullptr) {
                    deltas[(int64_t) t * a.delta_ts] = delta;
                }
            }
            if (store_all || (reloaded[t / 32] >> (t % 32)) & 1) {
                store_rows<VEC, CH, LPC, RPL>(nodes + t * a.node_s2, S);
            }
        }
    }
}

// ggml_gated_delta_net_tree_steps when not exact (scalar decay, one sequence, at most 32 nodes): every node at once,
// in the rule's chunk form over the tree (docs/gdn-tree-chunk.md). With G_t the log-decays summed along node t's path
// and A(t) its strict ancestors,
//   u_t = beta_t (v_t - e^G_t S0^T k_t) - sum_{j in A(t)} beta_t e^(G_t - G_j) (k_t . k_j) u_j      (the delta)
//   o_t = (e^G_t S0^T q_t + sum_{j in A(t) + t} e^(G_t - G_j) (q_t . k_j) u_j) / sqrt(S_v)
// The walk's latency (a dependent dot product per node and a state reload per branch) becomes a few small dense
// products and a 32-node forward substitution. A block takes 32 value columns of one head (grid H x S_v/32):
// lane = value column (or node j in the node-by-node products), warp w the nodes w, w+8, w+16, w+24.
#define GDN_CHUNK_NODES 32   // at most (one lane a node, one bit a node in the ancestor sets)
#define GDN_CHUNK_WARPS 8

// NN: the nodes the block is sized for (24 or 32; the tree's n_t <= NN), so a budget-22 tree (23 nodes) does not pay
// for 32 in the products and the substitution.
template <int S_v, int NN> struct gdn_chunk_smem {
    float k[NN][S_v + 4];                // (+4: lane j reading row j's float4s meets no bank conflict)
    float q[NN][S_v];                    // (read by whole warps at once)
    float s0[32][S_v + 4];               // the block's columns of the committed state, one per row
    float v[NN][32];
    float rhs[NN][32];                   // beta_t (v_t - e^G_t S0^T k_t)
    float qs[NN][32];                    // e^G_t S0^T q_t
    float a[NN][32];                     // beta_t e^(G_t - G_j) k_t . k_j for j in A(t), else 0
    float b[NN][32];                     // e^(G_t - G_j) q_t . k_j for j in A(t) + t, else 0
    float u[NN][32];
    float G[32];
    float beta[32];
    uint32_t anc[32];                    // bit j: j is t or an ancestor of t
};

template <int S_v, int NN>
__global__ void __launch_bounds__(WARP_SIZE * GDN_CHUNK_WARPS)
gdn_tree_chunk_kernel(const gdn_tree_args a) {
    static_assert(NN % GDN_CHUNK_WARPS == 0 && NN <= GDN_CHUNK_NODES, "nodes per block");
    extern __shared__ __align__(16) char gdn_chunk_raw[];
    gdn_chunk_smem<S_v, NN> & sm = *reinterpret_cast<gdn_chunk_smem<S_v, NN> *>(gdn_chunk_raw);
    constexpr int NT = WARP_SIZE * GDN_CHUNK_WARPS;
    constexpr int C4 = S_v / 4;                   // float4s per row
    constexpr int RK = (NN * C4 + NT - 1) / NT;   // per thread: float4s of k (and of q)
    constexpr int RS = 32 * C4 / NT;              // float4s of state columns
    constexpr int RV = NN * 32 / NT;              // values of v
    constexpr int MW = NN / GDN_CHUNK_WARPS;      // nodes per warp
    const int h    = blockIdx.x;
    const int col0 = blockIdx.z * 32;
    const int lane = threadIdx.x;
    const int warp = threadIdx.y;
    const int tid  = warp * WARP_SIZE + lane;
    const int n    = a.n_t;

    ggml_cuda_pdl_sync();

    // Stage q and k rows (zero past n: those nodes' products vanish), the block's state columns and v: every
    // load asked for before the first store, one memory latency for the lot.
    const float * q_h = a.q + (h % a.H_q) * a.sq1;
    const float * k_h = a.k + (h % a.H_k) * a.sk1;
    const float * s0  = a.state + ((int64_t) h * S_v + col0) * S_v;
    const float * v_h = a.v + h * a.sv1 + col0;
    float4 kr[RK], qr[RK], sr[RS];
    float  vr[RV];
#pragma unroll
    for (int e = 0; e < RK; ++e) {
        const int i = tid + e * NT, t = i / C4, r = 4 * (i % C4);
        kr[e] = qr[e] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (i < NN * C4 && t < n) {
            kr[e] = *(const float4 *) (k_h + t * a.sk2 + r);
            qr[e] = *(const float4 *) (q_h + t * a.sq2 + r);
        }
    }
#pragma unroll
    for (int e = 0; e < RS; ++e) {
        const int i = tid + e * NT;
        sr[e] = *(const float4 *) (s0 + (i / C4) * S_v + 4 * (i % C4));
    }
#pragma unroll
    for (int e = 0; e < RV; ++e) {
        const int t = (tid + e * NT) / 32;
        vr[e] = t < n ? v_h[t * a.sv2 + lane] : 0.0f;
    }
    // G_t and the ancestor sets by pointer jumping: after round r each node holds the sum over its 2^r nearest
    // path nodes (itself included) and p is the next node above them, or -1
    if (warp == 0) {
        int      p   = lane < n ? ggml_ext_parent(a.parent, lane) : -1;
        float    g   = lane < n ? a.g[(int64_t) lane * a.H + h] : 0.0f;
        float    G   = g;
        uint32_t anc = 1u << lane;
        sm.beta[lane] = lane < n ? a.beta[(int64_t) lane * a.H + h] : 0.0f;
#pragma unroll
        for (int r = 0; r < 5; ++r) {
            const int      from = max(p, 0);
            const float    Gp   = __shfl_sync(0xffffffff, G, from);
            const uint32_t ap   = __shfl_sync(0xffffffff, anc, from);
            const int      pp   = __shfl_sync(0xffffffff, p, from);
            if (p >= 0) {
                G += Gp; anc |= ap; p = pp;
            }
        }
        sm.G[lane]   = G;
        sm.anc[lane] = anc;
        if (a.steps != nullptr && blockIdx.z == 0 && lane < n) {   // the step's log-decay (scalar: one per head)
            a.steps[lane * a.steps_ld + (int64_t) S_v * (a.H_k + a.H) + h] = g;
        }
    }
#pragma unroll
    for (int e = 0; e < RK; ++e) {
        const int i = tid + e * NT;
        if (i < NN * C4) {
            *(float4 *) &sm.k[i / C4][4 * (i % C4)] = kr[e];
            *(float4 *) &sm.q[i / C4][4 * (i % C4)] = qr[e];
        }
    }
#pragma unroll
    for (int e = 0; e < RS; ++e) {
        const int i = tid + e * NT;
        *(float4 *) &sm.s0[i / C4][4 * (i % C4)] = sr[e];
    }
#pragma unroll
    for (int e = 0; e < RV; ++e) {
        sm.v[(tid + e * NT) / 32][lane] = vr[e];
    }
    __syncthreads();

    // the step's key, from the staged rows (the first block of each key head)
    if (a.steps != nullptr && blockIdx.z == 0 && h < a.H_k) {
        for (int i = tid; i < n * S_v; i += NT) {
            a.steps[(i / S_v) * a.steps_ld + h * S_v + i % S_v] = sm.k[i / S_v][i % S_v];
        }
    }

    // the dot products over the keys, for the warp's nodes t: with the state column `lane` (S0^T k_t, S0^T q_t)
    // and with node `lane`'s key (k_t . k_j, q_t . k_j; lanes past NN read state rows instead: their sums are unused)
    const float * kj_row = lane < NN ? sm.k[lane] : sm.s0[lane];
    float kS[MW] = {}, qS[MW] = {}, kk[MW] = {}, qk[MW] = {};
#pragma unroll 4
    for (int r = 0; r < S_v; r += 4) {
        const float4 s4 = *(const float4 *) &sm.s0[lane][r];
        const float4 kj = *(const float4 *) &kj_row[r];
#pragma unroll
        for (int m = 0; m < MW; ++m) {
            const int t = warp + GDN_CHUNK_WARPS * m;
            if (t < n) {
                const float4 kt = *(const float4 *) &sm.k[t][r];
                const float4 qt = *(const float4 *) &sm.q[t][r];
                kS[m] = fmaf(kt.w, s4.w, fmaf(kt.z, s4.z, fmaf(kt.y, s4.y, fmaf(kt.x, s4.x, kS[m]))));
                qS[m] = fmaf(qt.w, s4.w, fmaf(qt.z, s4.z, fmaf(qt.y, s4.y, fmaf(qt.x, s4.x, qS[m]))));
                kk[m] = fmaf(kt.w, kj.w, fmaf(kt.z, kj.z, fmaf(kt.y, kj.y, fmaf(kt.x, kj.x, kk[m]))));
                qk[m] = fmaf(qt.w, kj.w, fmaf(qt.z, kj.z, fmaf(qt.y, kj.y, fmaf(qt.x, kj.x, qk[m]))));
            }
        }
    }
#pragma unroll
    for (int m = 0; m < MW; ++m) {
        const int   t    = warp + GDN_CHUNK_WARPS * m;
        const float Gt   = sm.G[t];
        const float bt   = sm.beta[t];
        const bool  seen = t < n && (sm.anc[t] >> lane & 1u);   // node `lane` is t or an ancestor
        const float dj   = seen ? expf(Gt - sm.G[lane]) : 0.0f;
        sm.a[t][lane]   = seen && lane != t ? bt * dj * kk[m] : 0.0f;
        sm.b[t][lane]   = seen ? dj * qk[m] : 0.0f;
        sm.rhs[t][lane] = t < n ? bt * (sm.v[t][lane] - expf(Gt) * kS[m]) : 0.0f;
        sm.qs[t][lane]  = t < n ? expf(Gt) * qS[m] : 0.0f;
    }
    __syncthreads();

    // forward substitution, node by node (ancestors precede their descendants), the deltas in registers
    if (warp == 0) {
        float u[NN];
        float * delta = a.deltas + h * S_v + col0 + lane;
#pragma unroll
        for (int t = 0; t < NN; ++t) {
            float acc = sm.rhs[t][lane];
#pragma unroll
            for (int j = 0; j < t; ++j) {
                acc = fmaf(-sm.a[t][j], u[j], acc);
            }
            u[t] = acc;
            sm.u[t][lane] = acc;
            if (t < n) {
                delta[t * a.delta_ts] = acc;
            }
        }
    }
    __syncthreads();

#pragma unroll
    for (int m = 0; m < MW; ++m) {
        const int t = warp + GDN_CHUNK_WARPS * m;
        if (t < n) {
            float acc = sm.qs[t][lane];
            for (int j = 0; j <= t; ++j) {
                acc = fmaf(sm.b[t][j], sm.u[j][lane], acc);
            }
            a.o[((int64_t) t * a.H + h) * S_v + col0 + lane] = acc * a.scale;
        }
    }
}

template <int S_v, int NN>
static void launch_chunk(const gdn_tree_args & a, int device, cudaStream_t stream) {
    constexpr auto   kernel = gdn_tree_chunk_kernel<S_v, NN>;
    constexpr size_t smem   = sizeof(gdn_chunk_smem<S_v, NN>);
    ggml_ext_cuda_allow_smem<kernel>(smem, device);
    ggml_cuda_kernel_launch(kernel, ggml_cuda_kernel_launch_params(dim3(a.H, 1, S_v / 32),
                                                                   dim3(WARP_SIZE, GDN_CHUNK_WARPS), smem, stream), a);
}

template <int S_v> static void launch_chunk_for(const gdn_tree_args & a, int device, cudaStream_t stream) {
    a.n_t <= 24 ? launch_chunk<S_v, 24>(a, device, stream) : launch_chunk<S_v, 32>(a, device, stream);
}

template <int S_v, bool KDA, typename node_t, bool VEC, int W, int RPL>
static void launch(const gdn_tree_args & a, int n_s, cudaStream_t stream) {
    constexpr int CB = WARP_SIZE / (S_v / RPL) * W;
    static_assert(S_v % CB == 0, "columns per block must divide the head size");
    const dim3 grid(a.H, n_s, S_v / CB);
    const dim3 block(WARP_SIZE, W, 1);
    ggml_cuda_kernel_launch(gdn_tree_kernel<S_v, KDA, node_t, VEC, W, RPL>,
                            ggml_cuda_kernel_launch_params(grid, block, 0, stream), a);
}

template <typename node_t>
static void launch_for(const gdn_tree_args & a, int S_v, bool kda, bool vec, int n_s, cudaStream_t stream) {
#define GDN_TREE_LAUNCH(SV, KDA_)                                                                              \
    (vec ? launch<SV, KDA_, node_t, true, GDN_TREE_WARPS, GDN_TREE_RPL>(a, n_s, stream)                         \
         : launch<SV, KDA_, node_t, false, GDN_TREE_WARPS, GDN_TREE_RPL>(a, n_s, stream))
    switch (S_v) {
        case 64:  kda ? GDN_TREE_LAUNCH(64,  true) : GDN_TREE_LAUNCH(64,  false); break;
        case 128: kda ? GDN_TREE_LAUNCH(128, true) : GDN_TREE_LAUNCH(128, false); break;
        default:  GGML_ABORT("ggml_ext: gated_delta_net_tree on CUDA takes head size 64 or 128, not %d", S_v);
    }
#undef GDN_TREE_LAUNCH
}

// inter: the persist op's node states; steps: ggml_gated_delta_net_tree_steps' replay steps (else null)
static void gdn_tree(ggml_backend_cuda_context & ctx, ggml_tensor * dst, const ggml_tensor * inter,
                     const ggml_tensor * steps) {
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
    a.o_only = (inter == nullptr && dst->op_params[0] == 1) || steps != nullptr;
    a.g_ne0  = (int) g->ne[0];
    a.steps  = nullptr;
    a.steps_ld = 0;
    a.delta_ts = S_v * H;

    const bool kda = g->ne[0] == S_v;
    cudaStream_t stream = ctx.stream();
    a.deltas = nullptr;
    if (steps != nullptr) {
        a.steps    = (float *) steps->data;
        a.steps_ld = steps->nb[1] / sizeof(float);
        a.deltas   = a.steps + S_v * a.H_k;
        a.delta_ts = a.steps_ld;
        const bool exact = dst->op_params[0] == 1;
        // the chunk kernel moves q, k rows and state columns 16 bytes at a time
        const bool vec = aligned16(a.q) && aligned16(a.k) && aligned16(a.state) &&
                         a.sq1 % 4 == 0 && a.sq2 % 4 == 0 && a.sk1 % 4 == 0 && a.sk2 % 4 == 0;
        if (!exact && !kda && n_t <= GDN_CHUNK_NODES && vec) {
            S_v == 64 ? launch_chunk_for<64>(a, ctx.device, stream) : launch_chunk_for<128>(a, ctx.device, stream);
            return;
        }
    }
    // the tree kernel's lanes move their 32 rows 16 bytes at a time where the state's and the nodes' bases allow it:
    // every column starts a multiple of S_v elements (64 or 128) after the base, so the base decides
    if (inter == nullptr) {
        a.nodes   = (float *) dst->data + S_v * H * n_t * n_s;
        if (steps == nullptr) {
            a.deltas = (float *) dst->data + S_v * H * n_t * n_s * (1 + S_v);
        }
        a.node_s1 = S_v * S_v;
        a.node_s2 = a.node_s1 * H;
        a.node_s3 = a.node_s2 * n_t;
        launch_for<float>(a, (int) S_v, kda, aligned16(a.state) && aligned16(a.nodes), (int) n_s, stream);
    } else {
        const size_t elem = ggml_type_size(inter->type);
        a.nodes   = inter->data;
        a.node_s1 = inter->nb[1] / elem;
        a.node_s2 = inter->nb[2] / elem;
        a.node_s3 = inter->nb[3] / elem;
        const bool vec = aligned16(a.state) && aligned16(a.nodes);
        if (inter->type == GGML_TYPE_F16) {
            launch_for<half>(a, (int) S_v, kda, vec, (int) n_s, stream);
        } else {
            launch_for<float>(a, (int) S_v, kda, vec, (int) n_s, stream);
        }
    }
}

// ggml_gated_delta_net_path: a thread takes V consecutive keys i of one value column j of one head (a block row of
// the grid: (S_v*S_v / (V*256), H_v, n_s)) through the path's steps in order, with the tree kernel's roundings
// (gdn_decay, gdn_update) and its decay expression, expf(g). V = 4 moves the state 16 bytes at a time. A thread
// reads its values before it writes them, so dst may be the state itself.
template <bool KDA, int V>
__global__ void gdn_path_kernel(const float * state, const float * __restrict__ k,
                                const float * __restrict__ g, const float * __restrict__ delta,
                                const int * __restrict__ steps, float * dst,
                                int S_v, int H, int H_k, int n, int L, int rk3,
                                int64_t sk1, int64_t sk2, int64_t sk3, int64_t sg1, int64_t sg2, int64_t sg3,
                                int64_t sd1, int64_t sd2, int64_t sd3) {
    const int h = blockIdx.y;
    const int s = blockIdx.z;
    const int e = V * (blockIdx.x * blockDim.x + threadIdx.x);   // within the head's S_v*S_v values
    ggml_cuda_pdl_sync();
    if (e >= S_v * S_v) {
        return;
    }
    const int i = e % S_v;
    const int j = e / S_v;
    const int64_t head = ((int64_t) s * H + h) * S_v * S_v;
    float x[V];
    if constexpr (V == 4) {
        const float4 f = *(const float4 *) (state + head + e);
        x[0] = f.x; x[1] = f.y; x[2] = f.z; x[3] = f.w;
    } else {
        x[0] = state[head + e];
    }
    const float * kp = k + (s / rk3) * sk3 + (h % H_k) * sk1 + i;
    const float * dp = delta + s * sd3 + h * sd1 + j;
    const float * gp = g + s * sg3 + h * sg1 + (KDA ? i : 0);
    for (int step = 0; step < L; ++step) {
        const int l = steps != nullptr ? steps[s * L + step] : step;   // (the picked candidate)
        if (l < 0 || l >= n) {
            continue;
        }
        const float d = dp[l * sd2];
        const float * gl = gp + l * sg2;
        const float gs = KDA ? 0.0f : expf(gl[0]);
#pragma unroll
        for (int v = 0; v < V; ++v) {
            x[v] = gdn_update(gdn_decay(x[v], KDA ? expf(gl[v]) : gs), kp[l * sk2 + v], d);
        }
    }
    if constexpr (V == 4) {
        *(float4 *) (dst + head + e) = make_float4(x[0], x[1], x[2], x[3]);
    } else {
        dst[head + e] = x[0];
    }
}

template <bool KDA, int V>
static void gdn_path_launch(ggml_backend_cuda_context & ctx, ggml_tensor * dst) {
    const ggml_tensor * state = dst->src[0];
    const ggml_tensor * k     = dst->src[1];
    const ggml_tensor * g     = dst->src[2];
    const ggml_tensor * delta = dst->src[3];
    const ggml_tensor * steps = dst->src[4];   // ggml_gated_delta_net_path_steps' picks, or null
    const int64_t S_v = state->ne[0], H = state->ne[2], n_s = state->ne[3], n = delta->ne[2];
    const int64_t L = steps != nullptr ? steps->ne[0] : n;
    const int block = 256;
    const dim3 grid((unsigned) ((S_v * S_v / V + block - 1) / block), (unsigned) H, (unsigned) n_s);
    const int64_t f = sizeof(float);
    ggml_cuda_kernel_launch(gdn_path_kernel<KDA, V>, ggml_cuda_kernel_launch_params(grid, dim3(block), 0, ctx.stream()),
                            (const float *) state->data, (const float *) k->data, (const float *) g->data,
                            (const float *) delta->data, steps != nullptr ? (const int *) steps->data : nullptr,
                            (float *) dst->data, (int) S_v, (int) H, (int) k->ne[1], (int) n, (int) L,
                            (int) (n_s / k->ne[3]), k->nb[1] / f, k->nb[2] / f, k->nb[3] / f,
                            g->nb[1] / f, g->nb[2] / f, g->nb[3] / f,
                            delta->nb[1] / f, delta->nb[2] / f, delta->nb[3] / f);
}

} // namespace

void ggml_ext_cuda_gated_delta_net_path(ggml_backend_cuda_context & ctx, ggml_tensor * dst) {
    const bool kda = dst->src[2]->ne[0] == dst->src[0]->ne[0];
    const bool vec = dst->ne[0] % 4 == 0 && aligned16(dst->src[0]->data) && aligned16(dst->data);
    if (vec) {
        kda ? gdn_path_launch<true, 4>(ctx, dst) : gdn_path_launch<false, 4>(ctx, dst);
    } else {
        kda ? gdn_path_launch<true, 1>(ctx, dst) : gdn_path_launch<false, 1>(ctx, dst);
    }
}

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
    gdn_tree(ctx, dst, nullptr, nullptr);
}

void ggml_ext_cuda_gated_delta_net_tree_persist(ggml_backend_cuda_context & ctx, ggml_tensor * dst) {
    gdn_tree(ctx, dst, dst->src[7], nullptr);
}

void ggml_ext_cuda_gated_delta_net_tree_steps(ggml_backend_cuda_context & ctx, ggml_tensor * dst) {
    gdn_tree(ctx, dst, nullptr, dst->src[7]);
}
