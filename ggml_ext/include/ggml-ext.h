#pragma once

// pydflash's additions to ggml: tree-aware recurrent ops and (later) the TQ3_0 cache type.
// Compiled into the ggml libraries of the fork; see vendor/patches for how they are wired in.

#include "ggml.h"

#ifdef __cplusplus
extern "C" {
#endif

// Bumped whenever an op's signature or semantics change; the Python bindings check it at load.
#define GGML_EXT_ABI_VERSION 2

// The number of ops in ggml-ext-ops.def.
enum {
    GGML_EXT_N_OPS = 0
#define GGML_EXT_OP(NAME, SYMBOL) + 1
#include "ggml-ext-ops.def"
#undef GGML_EXT_OP
};

GGML_API int ggml_ext_abi_version(void);

// Depthwise causal convolution over a token tree (the tree form of ggml_ssm_conv).
//   sx     f32 [d_conv-1+n_t, d_inner, n_s]  conv state columns (oldest first), then the n_t new inputs
//   c      f32 [d_conv, d_inner]             kernel
//   parent i32 [n_t, n_s]                    parent[t] in {-1, 0..t-1}; -1: t follows the committed state
// Token t convolves itself with its d_conv-1 nearest ancestors; a walk that passes a node whose parent is -1
// continues into the state columns, newest first. Returns f32 [d_inner, n_t, n_s]. With parent[t] = t-1 it
// equals ggml_ssm_conv(sx, c).
GGML_API struct ggml_tensor * ggml_ssm_conv_tree(
        struct ggml_context * ctx,
        struct ggml_tensor  * sx,
        struct ggml_tensor  * c,
        struct ggml_tensor  * parent);

// The gated delta rule over a token tree (the tree form of ggml_gated_delta_net, K = 1).
// Shapes as upstream (S_k == S_v; H_v % H_k == 0, head h reads q/k head h % H_k; n_s % n_s_qk == 0,
// sequence s reads q/k sequence s / (n_s / n_s_qk)):
//   q, k   f32 [S_v, H_k, n_t, n_s_qk]   rows contiguous
//   v      f32 [S_v, H_v, n_t, n_s]      rows contiguous
//   g      f32 [1, H_v, n_t, n_s] (scalar log-decay) or [S_v, H_v, n_t, n_s] (per key dim, "KDA"), contiguous
//   beta   f32 [1, H_v, n_t, n_s]        contiguous
//   state  f32 [S_v, S_v, H_v, n_s]      the committed state, contiguous; element (i, j) is S[key i][value j]
//   parent i32 [n_t, n_s]                parent[t] in {-1, 0..t-1}; -1: t follows the committed state
// Node t starts from `state` when its parent is -1, else from the state after its parent, then applies one
// step of the rule: S <- exp(g) S; S += k (beta (v - S^T k))^T; o = S^T q / sqrt(S_v).
// Returns f32 [S_v*H_v, n_t*n_s*(1+S_v)]: o [S_v, H_v, n_t, n_s] followed by the state after every node,
// laid out [S_v*S_v, H_v, n_t, n_s] (node t of sequence s is one contiguous [S_v, S_v, H_v] block, ready to
// become the committed state). With parent[t] = t-1 the o part and node n_t-1's state equal
// ggml_gated_delta_net(q, k, v, g, beta, state, 1).
GGML_API struct ggml_tensor * ggml_gated_delta_net_tree(
        struct ggml_context * ctx,
        struct ggml_tensor  * q,
        struct ggml_tensor  * k,
        struct ggml_tensor  * v,
        struct ggml_tensor  * g,
        struct ggml_tensor  * beta,
        struct ggml_tensor  * state,
        struct ggml_tensor  * parent);

// ggml_gated_delta_net_tree whose node states live in a persistent tensor instead of the output:
//   inter  f32 or f16 [S_v*S_v, H_v, n_t_max, n_s], contiguous, n_t_max >= n_t
// Node t's state is written to inter[:, :, t, s]; a node whose parent p is not -1 starts from
// inter[:, :, p, s] as stored (so with f16 every node starts from its parent's rounded state). Returns o only,
// f32 [S_v, H_v, n_t, n_s]. Rollback to node r is then a copy of inter[:, :, r, s] into the committed state.
// The op writes into one of its sources, so `inter` must be allocated before the graph, in a buffer of its own
// (a cache buffer of the backend that computes the op) rather than by the graph allocator, which would place
// it in scratch memory and reuse it. Read it back in a later graph: nodes of the same graph that read `inter`
// are not ordered after this op.
GGML_API struct ggml_tensor * ggml_gated_delta_net_tree_persist(
        struct ggml_context * ctx,
        struct ggml_tensor  * q,
        struct ggml_tensor  * k,
        struct ggml_tensor  * v,
        struct ggml_tensor  * g,
        struct ggml_tensor  * beta,
        struct ggml_tensor  * state,
        struct ggml_tensor  * parent,
        struct ggml_tensor  * inter);

#ifdef __cplusplus
}
#endif
