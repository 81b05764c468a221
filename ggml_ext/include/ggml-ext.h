#pragma once

// pydflash's additions to ggml: tree-aware recurrent ops and (later) the TQ3_0 cache type.
// Compiled into the ggml libraries of the fork; see vendor/patches for how they are wired in.

#include "ggml.h"

#ifdef __cplusplus
extern "C" {
#endif

// Bumped whenever an op's signature or semantics change; the Python bindings check it at load.
#define GGML_EXT_ABI_VERSION 1

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

#ifdef __cplusplus
}
#endif
