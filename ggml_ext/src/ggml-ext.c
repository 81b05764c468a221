// Graph constructors of the ggml_ext ops (linked into ggml-base).

#include "ggml-ext.h"
#include "ggml-impl.h"

int ggml_ext_abi_version(void) {
    return GGML_EXT_ABI_VERSION;
}

struct ggml_tensor * ggml_ssm_conv_tree(
        struct ggml_context * ctx,
        struct ggml_tensor  * sx,
        struct ggml_tensor  * c,
        struct ggml_tensor  * parent) {
    GGML_ASSERT(ggml_is_3d(sx) && sx->type == GGML_TYPE_F32);
    GGML_ASSERT(ggml_is_matrix(c) && c->type == GGML_TYPE_F32);
    GGML_ASSERT(parent->type == GGML_TYPE_I32 && ggml_is_contiguous(parent));

    const int64_t d_conv  = c->ne[0];
    const int64_t d_inner = c->ne[1];
    const int64_t n_t     = sx->ne[0] - d_conv + 1;
    const int64_t n_s     = sx->ne[2];

    GGML_ASSERT(n_t >= 1 && sx->ne[1] == d_inner);
    GGML_ASSERT(parent->ne[0] == n_t && parent->ne[1] == n_s && parent->ne[2] == 1 && parent->ne[3] == 1);

    struct ggml_tensor * result = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, d_inner, n_t, n_s);
    result->op     = GGML_OP_SSM_CONV_TREE;
    result->src[0] = sx;
    result->src[1] = c;
    result->src[2] = parent;
    return result;
}
