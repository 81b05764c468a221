// Graph constructors of the ggml_ext ops (linked into ggml-base).

#include "ggml-ext.h"
#include "ggml-impl.h"

#include <stdio.h>
#include <string.h>

// An f32 matrix whose rows are contiguous (its columns may be strided: a view of a wider tensor)
static bool ggml_ext_is_f32_rows(const struct ggml_tensor * t) {
    return t->type == GGML_TYPE_F32 && ggml_is_matrix(t) && t->nb[0] == sizeof(float);
}

int ggml_ext_abi_version(void) {
    return GGML_EXT_ABI_VERSION;
}

void ggml_ext_graph_renew_uid(struct ggml_cgraph * graph) {
    graph->uid = ggml_graph_next_uid();
}

uint64_t ggml_ext_graph_uid(const struct ggml_cgraph * graph) {
    return graph->uid;
}

void ggml_ext_log_no_debug(enum ggml_log_level level, const char * text, void * user_data) {
    static enum ggml_log_level last = GGML_LOG_LEVEL_NONE;   // the level a CONT line continues
    (void) user_data;
    if (level != GGML_LOG_LEVEL_CONT) {
        last = level;
    }
    if (last == GGML_LOG_LEVEL_DEBUG) {
        return;
    }
    fputs(text, stderr);
    fflush(stderr);
}

// ggml_gdn_gates' inputs (and ggml_gdn_conv_tree's): beta, alpha f32 [H, n] rows contiguous, dt_bias, a f32 [H]
static void ggml_ext_check_gates(const struct ggml_tensor * beta, const struct ggml_tensor * alpha,
                                 const struct ggml_tensor * dt_bias, const struct ggml_tensor * a) {
    const int64_t H = beta->ne[0];
    GGML_ASSERT(ggml_ext_is_f32_rows(beta) && ggml_ext_is_f32_rows(alpha));
    GGML_ASSERT(alpha->ne[0] == H && alpha->ne[1] == beta->ne[1]);
    GGML_ASSERT(dt_bias->type == GGML_TYPE_F32 && ggml_is_contiguous(dt_bias) && ggml_nelements(dt_bias) == H);
    GGML_ASSERT(a->type == GGML_TYPE_F32 && ggml_is_contiguous(a) && ggml_nelements(a) == H);
}

// Both forms of ggml_ssm_conv_tree: the kernel and parent checks, and the result [d_inner, n_t, n_s] over src0 (the
// concatenated inputs, or the split form's state); with extra > 0 one f32 vector of the conv's values and then
// `extra` more (ggml_gdn_conv_tree's gates)
// op_params[0]: 1 = silu of the result; [1], [2], [3], [4] (ggml_gdn_conv_tree): qk channels normed, their group,
// eps and scale (floats); src[4]: the inputs' copy or NULL; src[5..8]: beta, alpha, dt_bias, a (the gates) or NULL
static struct ggml_tensor * ggml_ext_conv_tree_op(
        struct ggml_context * ctx, struct ggml_tensor * src0, struct ggml_tensor * c, struct ggml_tensor * parent,
        int64_t n_t, int64_t n_s, bool silu, int64_t extra) {
    GGML_ASSERT(ggml_is_matrix(c) && c->type == GGML_TYPE_F32);
    GGML_ASSERT(parent->type == GGML_TYPE_I32 && ggml_is_contiguous(parent));
    GGML_ASSERT(n_t >= 1);
    GGML_ASSERT(parent->ne[0] == n_t && parent->ne[1] == n_s && parent->ne[2] == 1 && parent->ne[3] == 1);

    struct ggml_tensor * result = extra == 0 ? ggml_new_tensor_3d(ctx, GGML_TYPE_F32, c->ne[1], n_t, n_s)
                                             : ggml_new_tensor_1d(ctx, GGML_TYPE_F32, c->ne[1] * n_t * n_s + extra);
    result->op     = GGML_OP_SSM_CONV_TREE;
    result->op_params[0] = silu ? 1 : 0;
    result->src[0] = src0;
    result->src[1] = c;
    result->src[2] = parent;
    return result;
}

struct ggml_tensor * ggml_ssm_conv_tree(
        struct ggml_context * ctx,
        struct ggml_tensor  * sx,
        struct ggml_tensor  * c,
        struct ggml_tensor  * parent,
        bool                  silu) {
    GGML_ASSERT(ggml_is_3d(sx) && sx->type == GGML_TYPE_F32);
    GGML_ASSERT(sx->ne[1] == c->ne[1]);
    return ggml_ext_conv_tree_op(ctx, sx, c, parent, sx->ne[0] - c->ne[0] + 1, sx->ne[2], silu, 0);
}

// The split form's checks and node, with `extra` floats after the conv's values (ggml_gdn_conv_tree's gates)
static struct ggml_tensor * ggml_ext_conv_tree_split_op(
        struct ggml_context * ctx, struct ggml_tensor * state, struct ggml_tensor * x, struct ggml_tensor * c,
        struct ggml_tensor * parent, bool silu, int64_t extra) {
    GGML_ASSERT(state->type == GGML_TYPE_F32 && ggml_is_contiguous(state) && ggml_is_3d(state));
    GGML_ASSERT(x->type == GGML_TYPE_F32 && ggml_is_3d(x) && x->nb[0] == sizeof(float));
    GGML_ASSERT(state->ne[0] == c->ne[0] - 1 && state->ne[1] == c->ne[1] && state->ne[2] == x->ne[2]);
    GGML_ASSERT(x->ne[0] == c->ne[1]);

    struct ggml_tensor * result = ggml_ext_conv_tree_op(ctx, state, c, parent, x->ne[1], x->ne[2], silu, extra);
    result->src[3] = x;    // the split form: src[0] holds the state only
    return result;
}

struct ggml_tensor * ggml_ssm_conv_tree_split(
        struct ggml_context * ctx,
        struct ggml_tensor  * state,
        struct ggml_tensor  * x,
        struct ggml_tensor  * c,
        struct ggml_tensor  * parent,
        bool                  silu) {
    return ggml_ext_conv_tree_split_op(ctx, state, x, c, parent, silu, 0);
}

struct ggml_tensor * ggml_gdn_conv_tree(
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
        struct ggml_tensor  * a) {
    GGML_ASSERT(group >= 1 && qk >= 0 && qk % group == 0 && qk <= c->ne[1]);
    int64_t extra = 0;
    if (beta != NULL) {   // the gates after the conv's values, in one f32 vector
        ggml_ext_check_gates(beta, alpha, dt_bias, a);
        GGML_ASSERT(x->ne[2] == 1 && beta->ne[1] == x->ne[1]);
        extra = 2 * beta->ne[0] * x->ne[1];
    }
    struct ggml_tensor * result = ggml_ext_conv_tree_split_op(ctx, state, x, c, parent, true, extra);
    if (beta != NULL) {
        result->src[5] = beta;
        result->src[6] = alpha;
        result->src[7] = dt_bias;
        result->src[8] = a;
    }
    if (inputs != NULL) {
        GGML_ASSERT(inputs->type == GGML_TYPE_F32 && inputs->nb[0] == sizeof(float));
        GGML_ASSERT(inputs->ne[0] == c->ne[1] && inputs->ne[1] == x->ne[1] && inputs->ne[2] == x->ne[2]);
        result->src[4] = inputs;
    }
    ggml_set_op_params_i32(result, 1, qk);
    ggml_set_op_params_i32(result, 2, group);
    ggml_set_op_params_f32(result, 3, eps);
    ggml_set_op_params_f32(result, 4, scale);
    return result;
}

// Checks shared by both gated delta net tree ops (the Python wrappers raise on the same conditions first).
static void ggml_ext_check_gdn_tree(
        const struct ggml_tensor * q, const struct ggml_tensor * k, const struct ggml_tensor * v,
        const struct ggml_tensor * g, const struct ggml_tensor * beta, const struct ggml_tensor * state,
        const struct ggml_tensor * parent) {
    GGML_ASSERT(q->type == GGML_TYPE_F32 && k->type == GGML_TYPE_F32 && v->type == GGML_TYPE_F32);
    GGML_ASSERT(g->type == GGML_TYPE_F32 && beta->type == GGML_TYPE_F32 && state->type == GGML_TYPE_F32);
    GGML_ASSERT(parent->type == GGML_TYPE_I32);
    GGML_ASSERT(ggml_is_contiguous_rows(q) && ggml_is_contiguous_rows(k) && ggml_is_contiguous_rows(v));
    GGML_ASSERT(ggml_is_contiguous(g) && ggml_is_contiguous(beta) && ggml_is_contiguous(state));
    GGML_ASSERT(ggml_is_contiguous(parent));

    const int64_t S_v = v->ne[0];
    const int64_t H   = v->ne[1];
    const int64_t n_t = v->ne[2];
    const int64_t n_s = v->ne[3];

    GGML_ASSERT(q->ne[0] == S_v && k->ne[0] == S_v);
    GGML_ASSERT(H % q->ne[1] == 0 && H % k->ne[1] == 0);
    GGML_ASSERT(q->ne[2] == n_t && k->ne[2] == n_t);
    GGML_ASSERT(n_s % q->ne[3] == 0 && n_s % k->ne[3] == 0);
    GGML_ASSERT(g->ne[0] == 1 || g->ne[0] == S_v);
    GGML_ASSERT(g->ne[1] == H && g->ne[2] == n_t && g->ne[3] == n_s);
    GGML_ASSERT(beta->ne[0] == 1 && beta->ne[1] == H && beta->ne[2] == n_t && beta->ne[3] == n_s);
    GGML_ASSERT(state->ne[0] == S_v && state->ne[1] == S_v && state->ne[2] == H && state->ne[3] == n_s);
    GGML_ASSERT(parent->ne[0] == n_t && parent->ne[1] == n_s && parent->ne[2] == 1 && parent->ne[3] == 1);
}

// Makes `result` the node of a gated delta net tree op over its sources (src[0..6]).
static struct ggml_tensor * ggml_ext_gdn_tree_op(
        struct ggml_tensor * result, enum ggml_op op, struct ggml_tensor * q, struct ggml_tensor * k,
        struct ggml_tensor * v, struct ggml_tensor * g, struct ggml_tensor * beta, struct ggml_tensor * state,
        struct ggml_tensor * parent) {
    result->op     = op;
    result->src[0] = q;
    result->src[1] = k;
    result->src[2] = v;
    result->src[3] = g;
    result->src[4] = beta;
    result->src[5] = state;
    result->src[6] = parent;
    return result;
}

struct ggml_tensor * ggml_gated_delta_net_tree(
        struct ggml_context * ctx,
        struct ggml_tensor  * q,
        struct ggml_tensor  * k,
        struct ggml_tensor  * v,
        struct ggml_tensor  * g,
        struct ggml_tensor  * beta,
        struct ggml_tensor  * state,
        struct ggml_tensor  * parent) {
    ggml_ext_check_gdn_tree(q, k, v, g, beta, state, parent);

    const int64_t S_v = v->ne[0];
    const int64_t H   = v->ne[1];
    const int64_t n_t = v->ne[2];
    const int64_t n_s = v->ne[3];

    // o [S_v*H, n_t*n_s], the node states [S_v*S_v, H, n_t, n_s] = S_v*n_t*n_s rows of S_v*H, the deltas as o
    struct ggml_tensor * result = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, S_v * H, n_t * n_s * (2 + S_v));
    return ggml_ext_gdn_tree_op(result, GGML_OP_GATED_DELTA_NET_TREE, q, k, v, g, beta, state, parent);
}

struct ggml_tensor * ggml_gated_delta_net_tree_o(
        struct ggml_context * ctx,
        struct ggml_tensor  * q,
        struct ggml_tensor  * k,
        struct ggml_tensor  * v,
        struct ggml_tensor  * g,
        struct ggml_tensor  * beta,
        struct ggml_tensor  * state,
        struct ggml_tensor  * parent) {
    struct ggml_tensor * result = ggml_gated_delta_net_tree(ctx, q, k, v, g, beta, state, parent);
    result->op_params[0] = 1;   // o only (the CPU writes every node state regardless)
    return result;
}

struct ggml_tensor * ggml_gated_delta_net_tree_persist(
        struct ggml_context * ctx,
        struct ggml_tensor  * q,
        struct ggml_tensor  * k,
        struct ggml_tensor  * v,
        struct ggml_tensor  * g,
        struct ggml_tensor  * beta,
        struct ggml_tensor  * state,
        struct ggml_tensor  * parent,
        struct ggml_tensor  * inter) {
    ggml_ext_check_gdn_tree(q, k, v, g, beta, state, parent);

    const int64_t S_v = v->ne[0];
    const int64_t H   = v->ne[1];
    const int64_t n_t = v->ne[2];
    const int64_t n_s = v->ne[3];

    GGML_ASSERT(inter->type == GGML_TYPE_F32 || inter->type == GGML_TYPE_F16);
    GGML_ASSERT(ggml_is_contiguous(inter));
    GGML_ASSERT(inter->ne[0] == S_v * S_v && inter->ne[1] == H && inter->ne[2] >= n_t && inter->ne[3] == n_s);

    struct ggml_tensor * result = ggml_new_tensor_4d(ctx, GGML_TYPE_F32, S_v, H, n_t, n_s);
    ggml_ext_gdn_tree_op(result, GGML_OP_GATED_DELTA_NET_TREE_PERSIST, q, k, v, g, beta, state, parent);
    result->src[7] = inter;
    return result;
}

struct ggml_tensor * ggml_gated_delta_net_tree_steps(
        struct ggml_context * ctx,
        struct ggml_tensor  * q,
        struct ggml_tensor  * k,
        struct ggml_tensor  * v,
        struct ggml_tensor  * g,
        struct ggml_tensor  * beta,
        struct ggml_tensor  * state,
        struct ggml_tensor  * parent,
        struct ggml_tensor  * steps,
        bool                  exact) {
    ggml_ext_check_gdn_tree(q, k, v, g, beta, state, parent);

    const int64_t S_v = v->ne[0];
    const int64_t H   = v->ne[1];
    const int64_t n_t = v->ne[2];

    GGML_ASSERT(v->ne[3] == 1);
    GGML_ASSERT(steps->type == GGML_TYPE_F32 && ggml_is_matrix(steps) && steps->nb[0] == sizeof(float));
    GGML_ASSERT(steps->ne[0] == S_v * k->ne[1] + S_v * H + g->ne[0] * H && steps->ne[1] >= n_t);

    // o [S_v*H, n_t], then room for the node states a walk reloads (as ggml_gated_delta_net_tree_o)
    struct ggml_tensor * result = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, S_v * H, n_t * (1 + S_v));
    ggml_ext_gdn_tree_op(result, GGML_OP_GATED_DELTA_NET_TREE_STEPS, q, k, v, g, beta, state, parent);
    result->src[7]       = steps;
    result->op_params[0] = exact ? 1 : 0;
    return result;
}

struct ggml_tensor * ggml_gated_delta_net_path(
        struct ggml_context * ctx,
        struct ggml_tensor  * state,
        struct ggml_tensor  * k,
        struct ggml_tensor  * g,
        struct ggml_tensor  * delta) {
    GGML_ASSERT(state->type == GGML_TYPE_F32 && k->type == GGML_TYPE_F32);
    GGML_ASSERT(g->type == GGML_TYPE_F32 && delta->type == GGML_TYPE_F32);
    GGML_ASSERT(ggml_is_contiguous(state));
    GGML_ASSERT(ggml_is_contiguous_rows(k) && ggml_is_contiguous_rows(g) && ggml_is_contiguous_rows(delta));

    const int64_t S_v = state->ne[0];
    const int64_t H   = state->ne[2];
    const int64_t n_s = state->ne[3];
    const int64_t L   = delta->ne[2];

    GGML_ASSERT(state->ne[1] == S_v);
    GGML_ASSERT(delta->ne[0] == S_v && delta->ne[1] == H && delta->ne[3] == n_s);
    GGML_ASSERT(k->ne[0] == S_v && H % k->ne[1] == 0 && k->ne[2] == L && n_s % k->ne[3] == 0);
    GGML_ASSERT((g->ne[0] == 1 || g->ne[0] == S_v) && g->ne[1] == H && g->ne[2] == L && g->ne[3] == n_s);

    struct ggml_tensor * result = ggml_new_tensor_4d(ctx, GGML_TYPE_F32, S_v, S_v, H, n_s);
    result->op     = GGML_OP_GATED_DELTA_NET_PATH;
    result->src[0] = state;
    result->src[1] = k;
    result->src[2] = g;
    result->src[3] = delta;
    return result;
}

struct ggml_tensor * ggml_gated_delta_net_path_steps(
        struct ggml_context * ctx,
        struct ggml_tensor  * state,
        struct ggml_tensor  * k,
        struct ggml_tensor  * g,
        struct ggml_tensor  * delta,
        struct ggml_tensor  * steps) {
    struct ggml_tensor * result = ggml_gated_delta_net_path(ctx, state, k, g, delta);
    GGML_ASSERT(steps->type == GGML_TYPE_I32 && ggml_is_contiguous(steps));
    GGML_ASSERT(steps->ne[1] == state->ne[3] && steps->ne[2] == 1 && steps->ne[3] == 1);
    result->src[4] = steps;
    return result;
}

bool ggml_qmatmul_supported(enum ggml_type type) {
    return type == GGML_TYPE_Q4_K || type == GGML_TYPE_Q5_K || type == GGML_TYPE_Q6_K || type == GGML_TYPE_Q8_0 ||
           type == GGML_TYPE_BF16;
}

// A norm of x's columns (K values; with groups, of a length dividing K) and its eps checked and set on result as
// ggml_qmatmul's and ggml_qmatmul_prepare's nodes keep them: src[2], op_params[1]
static void ggml_ext_qmatmul_set_norm(struct ggml_tensor * result, int64_t K, bool groups, struct ggml_tensor * norm,
                                      float eps) {
    GGML_ASSERT(norm->type == GGML_TYPE_F32 && ggml_is_contiguous(norm));
    GGML_ASSERT(groups ? K % ggml_nelements(norm) == 0 : ggml_nelements(norm) == K);
    GGML_ASSERT(eps >= 0.0f);
    memcpy(&result->op_params[1], &eps, sizeof(float));
    result->src[2] = norm;
}

// An added tensor of M rows and N columns checked and set on result (src[3])
static void ggml_ext_qmatmul_set_add(struct ggml_tensor * result, struct ggml_tensor * add, int64_t M, int64_t N) {
    GGML_ASSERT(ggml_ext_is_f32_rows(add));
    GGML_ASSERT(add->ne[0] == M && add->ne[1] == N);
    result->src[3] = add;
}

// A ggml_qmatmul node's operands checked and set on result: src[0] w, src[1] x, src[2] the norm (op_params[1]:
// eps; with up, of up's groups), src[3] the added tensor, src[4] up (the gated columns silu(x) * up, or
// sigmoid(x) * up: op_params[2], enum ggml_ext_qmatmul_gate); op_params[0] row_tiles
static void ggml_ext_qmatmul_set(
        struct ggml_tensor  * result,
        struct ggml_tensor  * w,
        struct ggml_tensor  * x,
        struct ggml_tensor  * up,
        struct ggml_tensor  * norm,
        float                 eps,
        struct ggml_tensor  * add,
        int                   row_tiles) {
    GGML_ASSERT(ggml_qmatmul_supported(w->type) && ggml_is_contiguous(w) && ggml_is_matrix(w));
    GGML_ASSERT(ggml_ext_is_f32_rows(x));
    GGML_ASSERT(x->ne[0] == w->ne[0]);
    GGML_ASSERT(x->ne[1] >= 1 && x->ne[1] <= GGML_EXT_QMATMUL_MAX_COLS);
    GGML_ASSERT(row_tiles == 0 || row_tiles == 1 || row_tiles == 2 || row_tiles == 4 || row_tiles == -1 || row_tiles == -2 ||
                row_tiles == GGML_EXT_QMATMUL_F16);
    result->op     = GGML_OP_QMATMUL;
    result->op_params[0] = row_tiles;
    result->src[0] = w;
    result->src[1] = x;
    if (up != NULL) {
        GGML_ASSERT(ggml_ext_is_f32_rows(up));
        GGML_ASSERT(up->ne[0] == x->ne[0] && up->ne[1] == x->ne[1]);
        result->src[4] = up;
    }
    if (norm != NULL) {   // without up the norm spans a column; with up, groups of up's values
        ggml_ext_qmatmul_set_norm(result, x->ne[0], up != NULL, norm, eps);
    }
    if (add != NULL) {
        ggml_ext_qmatmul_set_add(result, add, w->ne[1], x->ne[1]);
    }
}

struct ggml_tensor * ggml_qmatmul(
        struct ggml_context * ctx,
        struct ggml_tensor  * w,
        struct ggml_tensor  * x,
        int                   row_tiles) {
    return ggml_qmatmul_fused(ctx, w, x, NULL, NULL, 0.0f, NULL, row_tiles);
}

struct ggml_tensor * ggml_qmatmul_rms_norm(
        struct ggml_context * ctx,
        struct ggml_tensor  * w,
        struct ggml_tensor  * x,
        struct ggml_tensor  * norm,
        float                 eps,
        int                   row_tiles) {
    GGML_ASSERT(norm != NULL);
    return ggml_qmatmul_fused(ctx, w, x, NULL, norm, eps, NULL, row_tiles);
}

struct ggml_tensor * ggml_qmatmul_fused(
        struct ggml_context * ctx,
        struct ggml_tensor  * w,
        struct ggml_tensor  * x,
        struct ggml_tensor  * up,
        struct ggml_tensor  * norm,
        float                 eps,
        struct ggml_tensor  * add,
        int                   row_tiles) {
    struct ggml_tensor * result = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, w->ne[1], x->ne[1]);
    ggml_ext_qmatmul_set(result, w, x, up, norm, eps, add, row_tiles);
    return result;
}

struct ggml_tensor * ggml_qmatmul_sigmoid_gated(
        struct ggml_context * ctx,
        struct ggml_tensor  * w,
        struct ggml_tensor  * x,
        struct ggml_tensor  * up,
        struct ggml_tensor  * add,
        int                   row_tiles) {
    GGML_ASSERT(up != NULL);
    struct ggml_tensor * result = ggml_qmatmul_fused(ctx, w, x, up, NULL, 0.0f, add, row_tiles);
    result->op_params[2] = GGML_EXT_QMATMUL_GATE_SIGMOID;
    return result;
}

// npad: N rounded up to the f16 kernel's 8-column tiles
static int64_t ggml_ext_qmatmul_npad(int64_t n) {
    return (n + 7) / 8 * 8;
}

struct ggml_tensor * ggml_qmatmul_swiglu_prepared(
        struct ggml_context * ctx,
        struct ggml_tensor  * w,
        struct ggml_tensor  * x,
        struct ggml_tensor  * norm,
        float                 eps,
        enum ggml_type        reader) {
    GGML_ASSERT(w->type == GGML_TYPE_Q4_K);
    GGML_ASSERT(reader == GGML_TYPE_Q4_K || reader == GGML_TYPE_Q6_K);
    GGML_ASSERT(w->ne[0] % 256 == 0 && w->ne[1] % (2 * 256) == 0);   // F gate rows, F up rows: F a multiple of 256
    struct ggml_tensor * result = ggml_new_tensor_3d(ctx, GGML_TYPE_F16, GGML_EXT_QMATMUL_HALF_PITCH,
                                                     ggml_ext_qmatmul_npad(x->ne[1]), w->ne[1] / 2 / 256);
    ggml_ext_qmatmul_set(result, w, x, NULL, norm, eps, NULL, GGML_EXT_QMATMUL_F16);
    result->op_params[3] = GGML_EXT_QMATMUL_FORM_SWIGLU_PREPARED;
    result->op_params[4] = reader == GGML_TYPE_Q4_K;   // the run sums: Q4_K's minimum term reads them
    return result;
}

// src[0]: x, src[2]: the norm (op_params[1]: eps), where ggml_qmatmul keeps them
struct ggml_tensor * ggml_qmatmul_prepare(
        struct ggml_context * ctx,
        struct ggml_tensor  * x,
        struct ggml_tensor  * norm,
        float                 eps) {
    GGML_ASSERT(ggml_ext_is_f32_rows(x) && x->ne[0] % 256 == 0);
    GGML_ASSERT(x->ne[1] >= 1 && x->ne[1] <= GGML_EXT_QMATMUL_MAX_COLS);
    struct ggml_tensor * result = ggml_new_tensor_3d(ctx, GGML_TYPE_F16, GGML_EXT_QMATMUL_HALF_PITCH,
                                                     ggml_ext_qmatmul_npad(x->ne[1]), x->ne[0] / 256);
    result->op     = GGML_OP_QMATMUL_PREPARE;
    result->src[0] = x;
    if (norm != NULL) {
        ggml_ext_qmatmul_set_norm(result, x->ne[0], false, norm, eps);
    }
    return result;
}

struct ggml_tensor * ggml_qmatmul_prepared(
        struct ggml_context * ctx,
        struct ggml_tensor  * w,
        struct ggml_tensor  * xp,
        int                   n_cols,
        struct ggml_tensor  * add) {
    GGML_ASSERT((w->type == GGML_TYPE_Q4_K || w->type == GGML_TYPE_Q6_K) && ggml_is_contiguous(w) && ggml_is_matrix(w));
    GGML_ASSERT(w->ne[0] % 256 == 0);
    GGML_ASSERT(n_cols >= 1 && n_cols <= GGML_EXT_QMATMUL_MAX_COLS);
    GGML_ASSERT(xp->type == GGML_TYPE_F16 && ggml_is_contiguous(xp) && xp->ne[3] == 1);
    GGML_ASSERT(xp->ne[0] == GGML_EXT_QMATMUL_HALF_PITCH && xp->ne[1] == ggml_ext_qmatmul_npad(n_cols) &&
                xp->ne[2] == w->ne[0] / 256);
    const bool sums_left_out = xp->op == GGML_OP_QMATMUL &&
                               xp->op_params[3] == GGML_EXT_QMATMUL_FORM_SWIGLU_PREPARED && !xp->op_params[4];
    GGML_ASSERT(!(sums_left_out && w->type == GGML_TYPE_Q4_K) && "prepared for a Q6_K reader: no run sums");
    struct ggml_tensor * result = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, w->ne[1], n_cols);
    result->op     = GGML_OP_QMATMUL;
    result->op_params[0] = GGML_EXT_QMATMUL_F16;
    result->op_params[3] = GGML_EXT_QMATMUL_FORM_PREPARED_IN;
    result->op_params[4] = n_cols;
    result->src[0] = w;
    result->src[1] = xp;
    if (add != NULL) {
        ggml_ext_qmatmul_set_add(result, add, w->ne[1], n_cols);
    }
    return result;
}

static void ggml_ext_check_sample(const struct ggml_tensor * logits, const struct ggml_tensor * hist,
                                  const struct ggml_tensor * params) {
    GGML_ASSERT(ggml_ext_is_f32_rows(logits));
    GGML_ASSERT(hist->type == GGML_TYPE_I32 && ggml_is_matrix(hist) && ggml_is_contiguous(hist));
    GGML_ASSERT(hist->ne[1] == logits->ne[1]);
    GGML_ASSERT(params->type == GGML_TYPE_F32 && ggml_is_contiguous(params));
    GGML_ASSERT(ggml_nelements(params) == GGML_EXT_SAMPLE_N_PARAMS);
}

// op_params[0]: 0 = draw tokens (ggml_sample_tokens), 1 = return the filtered distribution (ggml_sample_probs)
static struct ggml_tensor * ggml_ext_sample_op(struct ggml_tensor * result, int32_t want_probs,
                                               struct ggml_tensor * logits, struct ggml_tensor * hist,
                                               struct ggml_tensor * params, struct ggml_tensor * rand) {
    result->op = GGML_OP_SAMPLE_TOKENS;
    result->op_params[0] = want_probs;
    result->src[0] = logits;
    result->src[1] = hist;
    result->src[2] = params;
    result->src[3] = rand;
    return result;
}

struct ggml_tensor * ggml_sample_tokens(
        struct ggml_context * ctx,
        struct ggml_tensor  * logits,
        struct ggml_tensor  * hist,
        struct ggml_tensor  * params,
        struct ggml_tensor  * rand) {
    ggml_ext_check_sample(logits, hist, params);
    GGML_ASSERT(rand->type == GGML_TYPE_F32 && ggml_is_contiguous(rand) && ggml_nelements(rand) == logits->ne[1]);
    struct ggml_tensor * result = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, logits->ne[1]);
    return ggml_ext_sample_op(result, 0, logits, hist, params, rand);
}

struct ggml_tensor * ggml_sample_probs(
        struct ggml_context * ctx,
        struct ggml_tensor  * logits,
        struct ggml_tensor  * hist,
        struct ggml_tensor  * params) {
    ggml_ext_check_sample(logits, hist, params);
    struct ggml_tensor * result = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, logits->ne[0], logits->ne[1]);
    return ggml_ext_sample_op(result, 1, logits, hist, params, NULL);
}

struct ggml_tensor * ggml_flash_attn_ordered(
        struct ggml_context * ctx,
        struct ggml_tensor  * q,
        struct ggml_tensor  * k,
        struct ggml_tensor  * v,
        struct ggml_tensor  * mask,
        float                 scale) {
    GGML_ASSERT(q->type == GGML_TYPE_F32 && q->nb[0] == sizeof(float));
    GGML_ASSERT(k->type == GGML_TYPE_F16 && k->nb[0] == sizeof(ggml_fp16_t));
    GGML_ASSERT(v->type == GGML_TYPE_F16 && v->nb[0] == sizeof(ggml_fp16_t));
    GGML_ASSERT(mask->type == GGML_TYPE_F16 && mask->nb[0] == sizeof(ggml_fp16_t));

    const int64_t D    = q->ne[0];
    const int64_t n_q  = q->ne[1];
    const int64_t H_q  = q->ne[2];
    const int64_t n_kv = k->ne[1];

    GGML_ASSERT(q->ne[3] == 1 && k->ne[3] == 1 && v->ne[3] == 1);
    GGML_ASSERT(k->ne[0] == D && v->ne[0] == D && v->ne[1] == n_kv && v->ne[2] == k->ne[2]);
    GGML_ASSERT(H_q % k->ne[2] == 0);
    GGML_ASSERT(mask->ne[0] == n_kv && mask->ne[1] >= n_q && mask->ne[2] == 1 && mask->ne[3] == 1);

    struct ggml_tensor * result = ggml_new_tensor_4d(ctx, GGML_TYPE_F32, D, H_q, n_q, 1);
    result->op     = GGML_OP_FLASH_ATTN_ORDERED;
    ggml_set_op_params_f32(result, 0, scale);
    result->src[0] = q;
    result->src[1] = k;
    result->src[2] = v;
    result->src[3] = mask;
    return result;
}

struct ggml_tensor * ggml_argmax_first(
        struct ggml_context * ctx,
        struct ggml_tensor  * x) {
    GGML_ASSERT(ggml_ext_is_f32_rows(x));
    GGML_ASSERT(x->ne[0] <= INT32_MAX);

    struct ggml_tensor * result = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, x->ne[1]);
    result->op     = GGML_OP_ARGMAX_FIRST;
    result->src[0] = x;
    return result;
}

struct ggml_tensor * ggml_top_k_logp(
        struct ggml_context * ctx,
        struct ggml_tensor  * logits,
        int                   k) {
    GGML_ASSERT(ggml_ext_is_f32_rows(logits));
    GGML_ASSERT(logits->ne[0] < (1 << 24));      // ids are returned as exact floats
    GGML_ASSERT(k >= 1 && k <= GGML_EXT_TOP_K_LOGP_MAX_K && k <= logits->ne[0]);

    struct ggml_tensor * result = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, k, 2, logits->ne[1]);
    result->op           = GGML_OP_TOP_K_LOGP;
    result->op_params[0] = k;
    result->src[0]       = logits;
    return result;
}

struct ggml_tensor * ggml_gdn_gates(
        struct ggml_context * ctx,
        struct ggml_tensor  * beta,
        struct ggml_tensor  * alpha,
        struct ggml_tensor  * dt_bias,
        struct ggml_tensor  * a) {
    ggml_ext_check_gates(beta, alpha, dt_bias, a);

    struct ggml_tensor * result = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, beta->ne[0], beta->ne[1], 2);
    result->op     = GGML_OP_GDN_GATES;
    result->src[0] = beta;
    result->src[1] = alpha;
    result->src[2] = dt_bias;
    result->src[3] = a;
    return result;
}
