#pragma once

// pydflash's additions to ggml: tree-aware recurrent ops and the TQ3_0 cache type.
// Compiled into the ggml libraries of the fork; see vendor/patches for how they are wired in.

#include "ggml.h"

#ifdef __cplusplus
extern "C" {
#endif

// Bumped whenever an op's signature or semantics change; the Python bindings check it at load.
#define GGML_EXT_ABI_VERSION 20

// The number of ops in ggml-ext-ops.def.
enum {
    GGML_EXT_N_OPS = 0
#define GGML_EXT_OP(NAME, SYMBOL) + 1
#include "ggml-ext-ops.def"
#undef GGML_EXT_OP
};

GGML_API int ggml_ext_abi_version(void);

// A graph's uid tells a backend that nothing in it changed since the last compute with the same uid, so the CUDA
// backend can replay its captured CUDA graph without comparing every node (as it does for uid 0, the default).
// ggml's scheduler sets uids; callers that allocate graphs themselves renew the uid after every allocation.
GGML_API void     ggml_ext_graph_renew_uid(struct ggml_cgraph * graph);
GGML_API uint64_t ggml_ext_graph_uid(const struct ggml_cgraph * graph);

// A ggml log callback (ggml_log_set) that drops GGML_LOG_LEVEL_DEBUG messages and their GGML_LOG_LEVEL_CONT lines
// and writes the others to stderr. ggml's default callback prints every level, and ggml-cuda logs a debug line
// per reused CUDA graph: one per decode step.
GGML_API void ggml_ext_log_no_debug(enum ggml_log_level level, const char * text, void * user_data);

// Depthwise causal convolution over a token tree (the tree form of ggml_ssm_conv).
//   sx     f32 [d_conv-1+n_t, d_inner, n_s]  conv state columns (oldest first), then the n_t new inputs
//   c      f32 [d_conv, d_inner]             kernel
//   parent i32 [n_t, n_s]                    parent[t] in {-1, 0..t-1}; -1: t follows the committed state
// Token t convolves itself with its d_conv-1 nearest ancestors; a walk that passes a node whose parent is -1
// continues into the state columns, newest first. Returns f32 [d_inner, n_t, n_s]. With parent[t] = t-1 it
// equals ggml_ssm_conv(sx, c). silu: return ggml_silu of that instead, to the bit, one kernel fewer (the CPU runs
// ggml's own vector silu over each finished output row, as ggml_silu would).
GGML_API struct ggml_tensor * ggml_ssm_conv_tree(
        struct ggml_context * ctx,
        struct ggml_tensor  * sx,
        struct ggml_tensor  * c,
        struct ggml_tensor  * parent,
        bool                  silu);

// ggml_ssm_conv_tree reading the conv state and the new inputs where they are, not their concatenation:
//   state f32 [d_conv-1, d_inner, n_s]  contiguous: the cached inputs of each channel, oldest first
//   x     f32 [d_inner, n_t, n_s]       rows contiguous (e.g. a row range of a fused projection's output)
// The result is ggml_ssm_conv_tree(concat(state, transpose(x)), c, parent, silu)'s, to the bit, without the copy.
GGML_API struct ggml_tensor * ggml_ssm_conv_tree_split(
        struct ggml_context * ctx,
        struct ggml_tensor  * state,
        struct ggml_tensor  * x,
        struct ggml_tensor  * c,
        struct ggml_tensor  * parent,
        bool                  silu);

// A Gated DeltaNet layer's conv step over a token tree in one op, where three ops ran: the result of
// ggml_ssm_conv_tree_split(state, x, c, parent, silu = true), then
//   - its first qk channels (the q and k heads) normed in groups of `group` channels, token by token, as
//     ggml_scale(ggml_rms_norm(y, eps), scale) computes them, to the bit on the CPU and on CUDA (llama.cpp's L2 norm
//     of a head: eps = its epsilon / group, scale = 1 / sqrt(group));
//   - inputs (f32 [d_inner, n_t, n_s], rows contiguous; or NULL): x copied there (a verify's store of the slots'
//     conv inputs, which its commit reads). The op writes it as a side effect: it must not be memory the graph
//     allocator hands out;
//   - beta (or NULL; then alpha, dt_bias and a too): the layer's gates as well, ggml_gdn_gates(beta, alpha, dt_bias,
//     a)'s values (n_s = 1). The result is then f32 [d_inner n_t + 2 H n_t], the conv's [d_inner, n_t] followed by
//     ggml_gdn_gates' [H, n_t, 2] (views pick them out); else f32 [d_inner, n_t, n_s].
// qk: a multiple of group, at most d_inner. CUDA takes groups of 1 to 128 channels, powers of two (supports_op).
GGML_API struct ggml_tensor * ggml_gdn_conv_tree(
        struct ggml_context * ctx,
        struct ggml_tensor  * state,
        struct ggml_tensor  * x,
        struct ggml_tensor  * c,
        struct ggml_tensor  * parent,
        int                   qk,
        int                   group,
        float                 eps,
        float                 scale,
        struct ggml_tensor  * inputs,
        struct ggml_tensor  * beta,
        struct ggml_tensor  * alpha,
        struct ggml_tensor  * dt_bias,
        struct ggml_tensor  * a);


// --- TQ3_0: the 3.5-bit KV-cache type (GGML_TYPE_TQ3_0; format below) ------------------------------------------
//
// Format. A row is cut into groups of 128 values (one K/V head row of 128, or two of a 256-wide head). Rows
// whose length is not a multiple of 128 are refused (the ggml block size is 128, so ggml_row_size and the
// Python layer reject them; the quantiser asserts it). Each group is stored as 4 sub-blocks of 32 values, each
// 14 bytes (block_tq3_0: f16 scale d, 8 bytes qs of low 2-bit indices, 4 bytes qh of high bits), so one ggml
// block is 56 bytes for 128 values: exactly 3.5 bits per value.
//   index of value j (0..31) of a sub-block:  ((qs[j % 8] >> (2*(j / 8))) & 3) | (((qh[j / 8] >> (j % 8)) & 1) << 2)
//   value:                                    d * TQ3_0_LEVELS[index]
//
// Rotation. Before quantising, each group x is rotated: y = D2 * H * D1 * x / sqrt(128), with H the 128-point
// Sylvester Walsh-Hadamard matrix (natural order) and D1, D2 fixed diagonal sign matrices (bit i of the words
// TQ3_0_SIGNS1/2 set: entry i is -1). The rotation is orthogonal (its inverse is D1 * H * D2 / sqrt(128)), so
// rotated K gives the same Q.K when Q is rotated the same way, and attention over rotated V gives the rotated
// output. Dequantisation returns values in the rotated domain: get_rows, cpy to f32/f16 and attention all see
// rotated values; pydflash/tq3.py rotates Q and un-rotates the attention output in the graph.
//
// Codebook. After the rotation the coordinates are close to N(0, |x|^2/128). A sub-block's values are divided
// by their RMS and each is mapped to the nearest of the 8 Lloyd-Max levels for N(0,1) (TQ3_0_LEVELS; their
// mean squared error on N(0,1) is 0.0345477607885). The scale is then d = |y_b| / |levels_b| so that the
// sub-block keeps its norm exactly before d is rounded to f16; the dequantised group's norm therefore equals
// the input's within the f16 rounding of d: relative error <= 2^-11 (for d in f16's normal range).
//
// The levels were derived offline in float64 by iterating Lloyd's algorithm on N(0,1) (thresholds at the
// midpoints, levels at the conditional means (phi(a)-phi(b))/(Phi(b)-Phi(a))) until the levels moved < 1e-15.
// The sign words are the first eight 32-bit halves of splitmix64 seeded with 0x7133.

#define TQ3_0_GROUP 128   // values rotated together; the ggml block size of GGML_TYPE_TQ3_0
#define TQ3_0_QK    32    // values per 14-byte sub-block

#define TQ3_0_L0 0.24509417894422190f
#define TQ3_0_L1 0.75600528120587830f
#define TQ3_0_L2 1.34390927850500140f
#define TQ3_0_L3 2.15194570453698700f
// level by 3-bit index, ascending
#define TQ3_0_LEVELS_INIT { -TQ3_0_L3, -TQ3_0_L2, -TQ3_0_L1, -TQ3_0_L0, TQ3_0_L0, TQ3_0_L1, TQ3_0_L2, TQ3_0_L3 }

#define TQ3_0_SIGNS1_INIT { 0xbf2f9891u, 0x1360fd4cu, 0xfe8a6fedu, 0x6e38569eu }
#define TQ3_0_SIGNS2_INIT { 0x392534e1u, 0xf76855b9u, 0x7d67d027u, 0xa2f891e8u }

typedef struct {
    ggml_fp16_t d;       // scale
    uint8_t     qs[8];   // low 2 bits of the 32 indices
    uint8_t     qh[4];   // high bit of the 32 indices
} block_tq3_0;

// Rotate (inverse = false) or un-rotate (inverse = true) n values, n a multiple of 128, group by group.
GGML_API void ggml_ext_tq3_0_rotate(const float * x, float * y, int64_t n, bool inverse);

// Type traits of GGML_TYPE_TQ3_0 (ggml-base): k and n_per_row are multiples of 128.
GGML_API void   ggml_ext_quantize_row_tq3_0_ref(const float * x, void * y, int64_t k);
GGML_API void   ggml_ext_dequantize_row_tq3_0(const void * x, float * y, int64_t k);
GGML_API size_t ggml_ext_quantize_tq3_0(const float * src, void * dst, int64_t nrows, int64_t n_per_row,
                                        const float * imatrix);

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
// step of the rule: S <- exp(g) S; delta = beta (v - S^T k); S += k delta^T; o = S^T q / sqrt(S_v).
// Returns f32 [S_v*H_v, n_t*n_s*(2+S_v)]: o [S_v, H_v, n_t, n_s], then the state after every node, laid out
// [S_v*S_v, H_v, n_t, n_s] (node t of sequence s is one contiguous [S_v, S_v, H_v] block, ready to become the
// committed state), then every node's delta [S_v, H_v, n_t, n_s] (what ggml_gated_delta_net_path takes). With
// parent[t] = t-1 the o part and node n_t-1's state equal ggml_gated_delta_net(q, k, v, g, beta, state, 1).
GGML_API struct ggml_tensor * ggml_gated_delta_net_tree(
        struct ggml_context * ctx,
        struct ggml_tensor  * q,
        struct ggml_tensor  * k,
        struct ggml_tensor  * v,
        struct ggml_tensor  * g,
        struct ggml_tensor  * beta,
        struct ggml_tensor  * state,
        struct ggml_tensor  * parent);

// ggml_gated_delta_net_tree for a caller that reads only o: of the node states in the output's tail, only those
// the walk itself reloads (nodes with a child that does not directly follow them) are sure to be written; the
// others may be left as they were. On CUDA, where storing every node's state is most of the op's memory
// traffic, that skips the stores of chain links and leaves (a speculative verify whose commit rebuilds the
// accepted node's state with ggml_gated_delta_net_path instead of copying a stored one). o and the deltas are
// the same, bit for bit.
GGML_API struct ggml_tensor * ggml_gated_delta_net_tree_o(
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

// ggml_gated_delta_net_tree for a speculative verify whose commit rebuilds the accepted node's state with
// ggml_gated_delta_net_path: no node state is kept. Returns f32 [S_v*H_v, n_t*(1+S_v)]: o [S_v, H_v, n_t, 1] then
// scratch; node t's replay step goes to column t of `steps`, f32 [S_v*H_k + S_v*H_v + G*H_v, >= n_t] (G = g->ne[0]),
// rows contiguous: its key (the H_k heads of k), its delta beta (v - S^T k) (H_v heads) and its log-decay g. One
// sequence (n_s = 1). `steps` is written as the persist op's `inter` is: allocate it before the graph, read it later.
// exact: o and the deltas are ggml_gated_delta_net_tree's, bit for bit (what a bit-exact decode reproduces).
// Otherwise a backend may compute every node at once: on CUDA, for a scalar decay and up to 32 nodes, the rule's
// chunk form over the tree's ancestor sets (docs/gdn-tree-chunk.md), equal to the walk within f32 rounding.
GGML_API struct ggml_tensor * ggml_gated_delta_net_tree_steps(
        struct ggml_context * ctx,
        struct ggml_tensor  * q,
        struct ggml_tensor  * k,
        struct ggml_tensor  * v,
        struct ggml_tensor  * g,
        struct ggml_tensor  * beta,
        struct ggml_tensor  * state,
        struct ggml_tensor  * parent,
        struct ggml_tensor  * steps,
        bool                  exact);

// The state after a path of L nodes of ggml_gated_delta_net_tree from their decays and deltas alone (no dot
// products left: each step is S <- exp(g) S; S += k delta^T, element by element):
//   state  f32 [S_v, S_v, H_v, n_s]    the state before the path, contiguous
//   k      f32 [S_v, H_k, L, n_s_k]    the path's keys (head h reads k head h % H_k), rows contiguous
//   g      f32 [1 or S_v, H_v, L, n_s] the path's log-decays, rows contiguous
//   delta  f32 [S_v, H_v, L, n_s]      the path's deltas (ggml_gated_delta_net_tree's last part), rows contiguous
// Returns f32 [S_v, S_v, H_v, n_s]: the very bits of the tree op's stored state after the path's last node (the
// same rounding per step on each backend). A step with g = 0 and delta = 0 leaves the state unchanged. Each value
// is read before it is written: the result may be placed on `state` itself (an in-place commit).
GGML_API struct ggml_tensor * ggml_gated_delta_net_path(
        struct ggml_context * ctx,
        struct ggml_tensor  * state,
        struct ggml_tensor  * k,
        struct ggml_tensor  * g,
        struct ggml_tensor  * delta);

// ggml_gated_delta_net_path whose steps are picked: k, g and delta hold n candidate steps (their ne[2] = n, e.g.
// views of ggml_gated_delta_net_tree_steps' store) and step l of sequence s is candidate steps[l, s]
// (i32 [L, n_s], contiguous). An index outside 0..n-1 is a step that changes nothing. One kernel, no gather.
GGML_API struct ggml_tensor * ggml_gated_delta_net_path_steps(
        struct ggml_context * ctx,
        struct ggml_tensor  * state,
        struct ggml_tensor  * k,
        struct ggml_tensor  * g,
        struct ggml_tensor  * delta,
        struct ggml_tensor  * steps);

// W * X for a quantised weight matrix and a few activation columns (the target's decode and verify).
//   w  Q4_K, Q5_K, Q6_K, Q8_0 or BF16 [K, M], contiguous (a GGUF weight as stored; BF16: a DFlash draft's matrices,
//      on CUDA through the f16 kernel's family only, below)
//   x  f32 [K, N], 1 <= N <= GGML_EXT_QMATMUL_MAX_COLS, rows contiguous
// Returns f32 [M, N], the same product as ggml_mul_mat(w, x). On CUDA the columns of x are quantised to
// 8 bits per 32 values (as ggml's own vector kernel does) and every output is reduced in one fixed order that
// does not depend on N: column j of the result is bit-identical whether x has 1 column or many. The CPU kernel is
// a reference (each weight row dequantised to f32, float sums); it is not bit-identical to the CUDA one.
#define GGML_EXT_QMATMUL_MAX_COLS 48

GGML_API bool ggml_qmatmul_supported(enum ggml_type type);

// row_tiles (CUDA only; the CPU kernel ignores it): how many 16-row tiles of w each warp multiplies with every
// activation fragment it loads: 0 lets the kernel choose from M, N and the GPU; 1, 2 or 4 forces it; -1 or -2
// forces it with the activations staged in shared memory (Hopper, Q4_K/Q5_K/Q6_K, N > 8; elsewhere as 1 or 2). A
// knob for benchmarks: the result's bits do not depend on it.
// GGML_EXT_QMATMUL_F16 instead takes the f16 kernel (Hopper, Q4_K/Q6_K, K a multiple of 256; elsewhere as 0): weights
// dequantised to f16 and f16 activations, f32 sums, faster from ~9 columns on the large matrices. Its column j is
// bit-identical whatever N is too, but it is not the int8 kernels' result: a caller that needs one token's result to
// equal the same token's among many (bit-exact verify) passes the same row_tiles for both. BF16 weights take its
// bf16 form on Hopper where K is a multiple of 256 (bf16 activations, f32 sums), whatever row_tiles says; elsewhere
// a plain f32 dot-product kernel (slow, for completeness: pydflash sends BF16 here only where the bf16 form runs).
#define GGML_EXT_QMATMUL_F16 16
GGML_API struct ggml_tensor * ggml_qmatmul(
        struct ggml_context * ctx,
        struct ggml_tensor  * w,
        struct ggml_tensor  * x,
        int                   row_tiles);

// ggml_qmatmul of RMS-normed activations: W * (x / sqrt(mean(x^2) + eps) * norm), per column of x, norm f32 [K]
// contiguous: a pre-norm layer's projection, the norm computed where the activations are quantised (on CUDA one
// kernel instead of a norm and a quantisation). Column j's result does not depend on N, as ggml_qmatmul's. On
// the CPU the normed columns are those of ggml_rms_norm then ggml_mul, to the bit.
GGML_API struct ggml_tensor * ggml_qmatmul_rms_norm(
        struct ggml_context * ctx,
        struct ggml_tensor  * w,
        struct ggml_tensor  * x,
        struct ggml_tensor  * norm,
        float                 eps,
        int                   row_tiles);

// ggml_qmatmul with its fusions, each optional (NULL: not taken), each the bits of the ggml ops it replaces on the
// same backend, with a kernel fewer:
//   up    f32 [K, N], rows contiguous: multiply the gated columns silu(x) * up (ggml_swiglu_split(x, up); x and up
//         are typically the two halves of a fused gate/up product), gated where the activations are quantised
//   norm  with eps: without up, as ggml_qmatmul_rms_norm's; with up, f32 [G] contiguous, G dividing K: up is
//         RMS-normed in groups of G values first (a per-head norm), silu(x) * (rms_norm(up_group, eps) * norm)
//         (on CUDA G a multiple of 32: a warp sums its group's squares itself, in an order of its own)
//   add   f32 [M, N], rows contiguous (a residual): W * X + add, added to every output as it is stored
GGML_API struct ggml_tensor * ggml_qmatmul_fused(
        struct ggml_context * ctx,
        struct ggml_tensor  * w,
        struct ggml_tensor  * x,
        struct ggml_tensor  * up,
        struct ggml_tensor  * norm,
        float                 eps,
        struct ggml_tensor  * add,
        int                   row_tiles);

// ggml_qmatmul of the gated columns sigmoid(x) * up (ggml_sigmoid(x) then ggml_mul with up: an attention's output
// gate, x the gate's rows and up the attention's output), gated where the activations are quantised, plus add where
// given (as ggml_qmatmul_fused's); x and up f32 [K, N], rows contiguous. The bits of those ggml ops on the same
// backend, with a kernel fewer (on CUDA two: ggml-cuda fuses the sigmoid and the multiplication).
GGML_API struct ggml_tensor * ggml_qmatmul_sigmoid_gated(
        struct ggml_context * ctx,
        struct ggml_tensor  * w,
        struct ggml_tensor  * x,
        struct ggml_tensor  * up,
        struct ggml_tensor  * add,
        int                   row_tiles);

// The f16 kernel's activations as a tensor ("prepared"): for K values (a multiple of 256) and N columns, F16
// [GGML_EXT_QMATMUL_HALF_PITCH, npad, K / 256] with npad = N rounded up to a multiple of 8. Per 256-value unit and
// column: the 256 values rounded to f16 and the 8 sums of its runs of 32 (each the f32 sum of the rounded values,
// rounded to f16); columns N..npad-1 hold zeros. A unit's npad * GGML_EXT_QMATMUL_HALF_PITCH halves are 36 chunks of
// npad x 8 (chunk c, column j's 8 halves at (c npad + j) 8): values 32 s + 8 t + 4 p + 2 q + {0, 1} of run s in
// chunk 4 s + 2 p + q at halves 2 t, 2 t + 1 (the K order of the kernel's MMA fragments, its chunks the 8 x 8 tiles
// the tensor cores read, ggml_ext/cuda/qmatmul_wgmma.cuh), the sums in chunk 32, zeros in chunk 33, 34-35 unused.
// GGML_EXT_QMATMUL_HALF_AT: where value v (0..255; 256 + s: the sum of run s) of column j sits in its unit.
// ggml_qmatmul_prepared reads it.
#define GGML_EXT_QMATMUL_HALF_PITCH 288
#define GGML_EXT_QMATMUL_HALF_CHUNK(v) ((v) < 256 ? 4 * ((v) / 32) + 2 * (((v) / 4) % 2) + ((v) / 2) % 2 : 32)
#define GGML_EXT_QMATMUL_HALF_ELEM(v)  ((v) < 256 ? 2 * (((v) / 8) % 4) + (v) % 2 : (v) - 256)
#define GGML_EXT_QMATMUL_HALF_AT(v, j, npad) \
    ((GGML_EXT_QMATMUL_HALF_CHUNK(v) * (npad) + (j)) * 8 + GGML_EXT_QMATMUL_HALF_ELEM(v))
#define GGML_EXT_QMATMUL_HALF_ZEROS 33   // the chunk of zeros
// where the zero beside run r's sum (r 0..7) of column j sits in its unit
#define GGML_EXT_QMATMUL_HALF_ZERO_AT(r, j, npad) ((GGML_EXT_QMATMUL_HALF_ZEROS * (npad) + (j)) * 8 + (r))

// An FFN's gate/up product handing the down product its input: w [K, 2F], Q4_K, holds F gate rows, then F up rows
// (a fused gate/up matrix; F a multiple of 256), x f32 [K, N] as ggml_qmatmul's, and with norm and eps (else NULL)
// the columns RMS-normed first, as ggml_qmatmul_rms_norm's. Returns the columns silu(W_gate x) *
// (W_up x), F values each, prepared (above), for a ggml_qmatmul_prepared whose matrix has type `reader` (Q4_K or
// Q6_K): Q6_K never reads the run sums, so for it they are left out (zeros; ggml_qmatmul_prepared refuses a Q4_K
// matrix over them). On CUDA the f16 kernel (Hopper) writes them as it stores its tiles, so
// no kernel runs between the two products: each value is what ggml_qmatmul_fused's preparation makes of the f32
// gate and up the kernel computed (ggml's silu times up, rounded to f16; the run sums in its butterfly order); the
// gate and up rows of a pair sit in one row tile, so their sums are cut at other K units than W's alone would be.
// On the CPU: the reference's gate and up, ggml's CPU swiglu, the run sums in index order.
GGML_API struct ggml_tensor * ggml_qmatmul_swiglu_prepared(
        struct ggml_context * ctx,
        struct ggml_tensor  * w,
        struct ggml_tensor  * x,
        struct ggml_tensor  * norm,
        float                 eps,
        enum ggml_type        reader);

// The prepared activations (above) of x f32 [K, N] (K a multiple of 256, 1 <= N <= GGML_EXT_QMATMUL_MAX_COLS, rows
// contiguous), RMS-normed first with norm and eps as ggml_qmatmul_rms_norm's (norm NULL: x as it is): what
// ggml_qmatmul with GGML_EXT_QMATMUL_F16 prepares for itself, as a tensor that several products read
// (ggml_qmatmul_prepared: one preparation for the projections of one input). On CUDA the bits of that preparation;
// on the CPU the columns the CPU reference would multiply, rounded to f16, the run sums in index order.
GGML_API struct ggml_tensor * ggml_qmatmul_prepare(
        struct ggml_context * ctx,
        struct ggml_tensor  * x,
        struct ggml_tensor  * norm,
        float                 eps);

// ggml_qmatmul of prepared activations xp (F16 [GGML_EXT_QMATMUL_HALF_PITCH, npad, K / 256], e.g.
// ggml_qmatmul_swiglu_prepared's result) of n_cols columns (npad - 7 .. npad), plus add (f32 [M, n_cols], rows
// contiguous; NULL: none) as ggml_qmatmul_fused's. w Q4_K or Q6_K [K, M]; on CUDA the f16 kernel (Hopper) reads xp
// as it is, its column j the bits of GGML_EXT_QMATMUL_F16 on the same values. On the CPU: the reference on the
// values as f32.
GGML_API struct ggml_tensor * ggml_qmatmul_prepared(
        struct ggml_context * ctx,
        struct ggml_tensor  * w,
        struct ggml_tensor  * xp,
        int                   n_cols,
        struct ggml_tensor  * add);

// What a ggml_qmatmul node reads and writes (op_params[3]; op_params[4]: the columns of a prepared input, or for
// GGML_EXT_QMATMUL_FORM_SWIGLU_PREPARED 1 where the run sums are written)
enum ggml_ext_qmatmul_form {
    GGML_EXT_QMATMUL_FORM_PLAIN           = 0,   // f32 x in, f32 [M, N] out
    GGML_EXT_QMATMUL_FORM_SWIGLU_PREPARED = 1,   // ggml_qmatmul_swiglu_prepared
    GGML_EXT_QMATMUL_FORM_PREPARED_IN     = 2,   // ggml_qmatmul_prepared
};

// How ggml_qmatmul's up gates x (op_params[2])
enum ggml_ext_qmatmul_gate {
    GGML_EXT_QMATMUL_GATE_SILU    = 0,   // silu(x) * up (ggml_qmatmul_fused)
    GGML_EXT_QMATMUL_GATE_SIGMOID = 1,   // sigmoid(x) * up (ggml_qmatmul_sigmoid_gated)
};

// --- Sampling: filter each row of logits and draw one token (docs/sampling.md) ----------------------------------
//   logits f32 [n_vocab, n_rows]  rows contiguous (nb[0] = 4)
//   hist   i32 [n_hist, n_rows]   each row's most recent tokens for the penalties (-1: no token), contiguous
//   params f32 [GGML_EXT_SAMPLE_N_PARAMS], contiguous, indexed by GGML_EXT_SAMPLE_*
//   rand   f32 [n_rows]           one uniform number in [0, 1) per row, contiguous
// Per row, in this order: penalties (a token seen c > 0 times in hist: logit /= repeat_penalty when > 0, else
// *= repeat_penalty; then logit -= c * frequency_penalty + presence_penalty), then with temperature <= 0 the
// argmax (lowest id on ties). Otherwise, with p = softmax(penalised logits): top-k keeps the tokens whose logit
// is >= the k-th largest (k <= 0: all); top-p keeps the tokens of the kept set whose p is >= v, for the largest
// v whose kept mass sum(p >= v) reaches top_p of the kept set's mass (top_p >= 1: all); min-p keeps the tokens
// with p >= min_p * max p (min_p <= 0: all); the kept tokens get probability exp(logit / temperature)
// normalised, and the drawn token is the first (by id) at which the cumulative probability exceeds rand.
// Ties at a boundary are kept together, so the result does not depend on any sort order.
#define GGML_EXT_SAMPLE_TEMPERATURE       0
#define GGML_EXT_SAMPLE_TOP_K             1
#define GGML_EXT_SAMPLE_TOP_P             2
#define GGML_EXT_SAMPLE_MIN_P             3
#define GGML_EXT_SAMPLE_REPEAT_PENALTY    4
#define GGML_EXT_SAMPLE_PRESENCE_PENALTY  5
#define GGML_EXT_SAMPLE_FREQUENCY_PENALTY 6
#define GGML_EXT_SAMPLE_N_PARAMS          8

// Returns i32 [n_rows]: the drawn token of every row.
GGML_API struct ggml_tensor * ggml_sample_tokens(
        struct ggml_context * ctx,
        struct ggml_tensor  * logits,
        struct ggml_tensor  * hist,
        struct ggml_tensor  * params,
        struct ggml_tensor  * rand);

// The same filtering, returning the distribution the draw samples from: f32 [n_vocab, n_rows] (one-hot at the
// argmax when temperature <= 0). For tests and diagnostics.
GGML_API struct ggml_tensor * ggml_sample_probs(
        struct ggml_context * ctx,
        struct ggml_tensor  * logits,
        struct ggml_tensor  * hist,
        struct ggml_tensor  * params);


// Attention whose every output is one fixed sequence of float operations, whatever the number of queries or of
// masked cells: decode (1 query) and a tree verify (n queries, the path's cells spread among other branches')
// give bit-identical rows for the same query over the same unmasked cells (docs/benchmarks.md, "bit-exact mode").
//   q    f32 [D, n_q, H_q, 1]   rows contiguous (the layout ggml_flash_attn_ext takes)
//   k, v f16 [D, n_kv, H_kv, 1] rows contiguous, H_q % H_kv == 0 (head h reads K/V head h / (H_q / H_kv))
//   mask f16 [n_kv, >= n_q]     rows contiguous; added to the scores; -inf removes a cell
// Per query i and head h: cells j with mask[i][j] = -inf are skipped (never read); the others, in ascending j,
// are folded one at a time into a running max m, sum l and output row a (for s_j = scale * q.k_j + mask[i][j]:
// if s_j > m, l and a are scaled by exp(m - s_j) and m = s_j; then p = exp(s_j - m), l += p, a += p v_j).
// q.k_j is a sum over d in a fixed order. Returns f32 [D, H_q, n_q, 1] = a / l (0 for a query with no cell).
// Sequential over the cells (no split of the KV range), so it is slower than ggml_flash_attn_ext at long context.
GGML_API struct ggml_tensor * ggml_flash_attn_ordered(
        struct ggml_context * ctx,
        struct ggml_tensor  * q,
        struct ggml_tensor  * k,
        struct ggml_tensor  * v,
        struct ggml_tensor  * mask,
        float                 scale);

// The index of the largest value of every row of x f32 [n, n_rows] (rows contiguous): i32 [n_rows], the lowest
// index among equal maxima (NaN never wins; a row with no comparable value gives 0). Unlike ggml_argmax (one CUDA
// block per row, ~90 us for a 248K-token row on an H100), the CUDA kernel splits each row over many blocks and
// merges their winners in a second pass, and its result does not depend on how the row was split.
GGML_API struct ggml_tensor * ggml_argmax_first(
        struct ggml_context * ctx,
        struct ggml_tensor  * x);

// The k most likely tokens of every row of logits f32 [n_vocab, n_rows] (rows contiguous, any row stride,
// n_vocab < 2^24, 1 <= k <= GGML_EXT_TOP_K_LOGP_MAX_K <= n_vocab), with their log-probabilities, in one pass:
// f32 [k, 2, n_rows]; per row, [:, 0] = log softmax(row)[id] = logit - logsumexp(row) of the chosen ids and
// [:, 1] = the ids as exact floats, best first. The order is total, so every backend picks the same ids: a larger
// logit first, equal logits by lower id (-0, +0 and subnormals all equal), NaN below everything (never before a
// number).
// logsumexp is taken stably (the row max, then the sum of exp(x - max)); -inf logits have probability 0 and a
// row of only -inf gives -inf log-probs (ids 0..k-1); a NaN in the row makes its log-probs NaN. Replaces
// ggml_top_k + ggml_soft_max + get_rows (a full segmented sort and a full softmax per row on CUDA).
#define GGML_EXT_TOP_K_LOGP_MAX_K 32

GGML_API struct ggml_tensor * ggml_top_k_logp(
        struct ggml_context * ctx,
        struct ggml_tensor  * logits,
        int                   k);

// --- The gates of a Gated DeltaNet layer from its beta and alpha projections: one op instead of four ----------
//   beta    f32 [H, n]  the beta projection (rows may be strided: a view of a fused projection's output)
//   alpha   f32 [H, n]  the alpha projection (likewise)
//   dt_bias f32 [H], a f32 [H]  contiguous
// Returns f32 [H, n, 2]: plane 0 the log-decay g = softplus(alpha + dt_bias) * a, plane 1 sigmoid(beta), each
// plane contiguous. The formulas are ggml's (softplus(x) = x > 20 ? x : logf(1 + expf(x)), sigmoid(x) =
// 1 / (1 + expf(-x))), evaluated in the order of ggml_add, ggml_softplus, ggml_mul and ggml_sigmoid, so the
// values equal those ops' on the same backend.
GGML_API struct ggml_tensor * ggml_gdn_gates(
        struct ggml_context * ctx,
        struct ggml_tensor  * beta,
        struct ggml_tensor  * alpha,
        struct ggml_tensor  * dt_bias,
        struct ggml_tensor  * a);

#ifdef __cplusplus
}
#endif
