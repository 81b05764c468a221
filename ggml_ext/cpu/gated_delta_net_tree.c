// ggml_gated_delta_net_tree(_persist, _steps) and ggml_gated_delta_net_path on the CPU. Threads
// split the (head, sequence) pairs; each pair walks its tree in node order with the state in a per-thread f32
// scratch matrix, using the same vector primitives in the same order as upstream's ggml_gated_delta_net, so a
// chain gives its numbers; the path op repeats a node's decay and update with the same primitives.

#include "ggml-ext-cpu.h"
#include "ggml-cpu-impl.h"
#include "ggml-impl.h"
#include "ggml-cpu.h"
#include "vec.h"
#include "../src/tree-walk.h"

#include <math.h>
#include <string.h>

// Per-thread scratch: the state (S_v*S_v) and one vector (S_v), rounded up to whole cache lines.
#define GGML_EXT_LINE_F32 64

static int64_t gdn_tree_scratch_f32(const struct ggml_tensor * node) {
    const int64_t S_v = node->src[2]->ne[0];
    const int64_t n   = S_v * S_v + S_v;
    return (n + GGML_EXT_LINE_F32 - 1) / GGML_EXT_LINE_F32 * GGML_EXT_LINE_F32;
}

size_t ggml_ext_cpu_gated_delta_net_tree_work_size(const struct ggml_tensor * node, int n_tasks) {
    return (size_t) (gdn_tree_scratch_f32(node) * n_tasks + GGML_EXT_LINE_F32) * sizeof(float);
}

// One step's decay S <- exp(g) S (scalar g, or one per key with KDA; scratch: S_v floats) and rank-one update
// S += k delta^T, on a state stored transposed (S[j*S_v + i] = S[key i][value j], row j contiguous). The tree op
// and the path op share them, so that a rebuilt state is the walked one bit for bit.
static void gdn_decay(float * S, int64_t S_v, const float * g_d, bool kda, float * scratch) {
    if (kda) {
        for (int64_t i = 0; i < S_v; ++i) {
            scratch[i] = expf(g_d[i]);
        }
        for (int64_t j = 0; j < S_v; ++j) {
            ggml_vec_mul_f32((int) S_v, &S[j * S_v], &S[j * S_v], scratch);
        }
    } else {
        ggml_vec_scale_f32((int) (S_v * S_v), S, expf(g_d[0]));
    }
}

static void gdn_update(float * S, int64_t S_v, const float * k_d, const float * delta) {
    for (int64_t j = 0; j < S_v; ++j) {
        ggml_vec_mad_f32((int) S_v, &S[j * S_v], k_d, delta[j]);
    }
}

// inter: NULL for ggml_gated_delta_net_tree (node states go to dst after o), else the persistent tensor.
// steps: ggml_gated_delta_net_tree_steps' replay steps (the deltas go there; node states to dst after o), or NULL.
static void gdn_tree(const struct ggml_compute_params * params, struct ggml_tensor * dst,
                     const struct ggml_tensor * inter, const struct ggml_tensor * steps) {
    const struct ggml_tensor * q      = dst->src[0];
    const struct ggml_tensor * k      = dst->src[1];
    const struct ggml_tensor * v      = dst->src[2];
    const struct ggml_tensor * g      = dst->src[3];
    const struct ggml_tensor * beta   = dst->src[4];
    const struct ggml_tensor * state  = dst->src[5];
    const struct ggml_tensor * parent = dst->src[6];

    const int64_t S_v = v->ne[0];
    const int64_t H   = v->ne[1];
    const int64_t n_t = v->ne[2];
    const int64_t n_s = v->ne[3];
    const int64_t D   = S_v * S_v;
    const bool    kda = g->ne[0] == S_v;

    // o: [S_v, H, n_t, n_s] at the start of dst in both ops
    float * o_base = (float *) dst->data;

    // the deltas: [S_v, H, n_t, n_s] after the node states (not kept by the persist op), or the steps' delta rows
    const int64_t key_dim  = S_v * k->ne[1];
    float * delta_base     = inter == NULL ? o_base + S_v * H * n_t * n_s * (1 + S_v) : NULL;
    int64_t delta_t_stride = S_v * H;   // floats from node t's deltas to node t+1's
    if (steps != NULL) {
        delta_base     = (float *) steps->data + key_dim;
        delta_t_stride = steps->nb[1] / sizeof(float);
    }

    // node states, [S_v*S_v, H, n_t, n_s]: byte strides per head, node, sequence
    char * node_base;
    size_t node_nb1, node_nb2, node_nb3;
    bool   f16 = false;
    if (inter != NULL) {
        node_base = (char *) inter->data;
        node_nb1  = inter->nb[1];
        node_nb2  = inter->nb[2];
        node_nb3  = inter->nb[3];
        f16       = inter->type == GGML_TYPE_F16;
    } else {
        node_base = (char *) dst->data + S_v * H * n_t * n_s * sizeof(float);
        node_nb1  = D * sizeof(float);
        node_nb2  = node_nb1 * H;
        node_nb3  = node_nb2 * n_t;
    }

    const int64_t rq3 = n_s / q->ne[3];
    const int64_t rk3 = n_s / k->ne[3];
    const float scale = 1.0f / sqrtf((float) S_v);

    float * S     = (float *) params->wdata + params->ith * gdn_tree_scratch_f32(dst);
    float * delta = S + D;

    int64_t ir0, ir1;   // this thread's (head, sequence) pairs
    ggml_ext_thread_rows(H * n_s, params->ith, params->nth, &ir0, &ir1);

    for (int64_t ir = ir0; ir < ir1; ++ir) {
        const int64_t h = ir % H;
        const int64_t s = ir / H;
        const int64_t iq1 = h % q->ne[1], iq3 = s / rq3;
        const int64_t ik1 = h % k->ne[1], ik3 = s / rk3;

        const int * par = (const int *) ((const char *) parent->data + s * parent->nb[1]);
        const float * s_committed = (const float *) ((const char *) state->data + s * state->nb[3] + h * state->nb[2]);
        char * nodes = node_base + s * node_nb3 + h * node_nb1;

        for (int64_t t = 0; t < n_t; ++t) {
            const int p = ggml_ext_parent(par, (int) t);
            // The scratch still holds node t-1's state as computed; an f16 child must start from the rounded one.
            if (p < 0) {
                memcpy(S, s_committed, D * sizeof(float));
            } else if (p != t - 1 || f16) {
                const void * src = nodes + p * node_nb2;
                if (f16) {
                    ggml_cpu_fp16_to_fp32((const ggml_fp16_t *) src, S, D);
                } else {
                    memcpy(S, src, D * sizeof(float));
                }
            }

            const float * q_d = (const float *) ((const char *) q->data + iq3 * q->nb[3] + t * q->nb[2] + iq1 * q->nb[1]);
            const float * k_d = (const float *) ((const char *) k->data + ik3 * k->nb[3] + t * k->nb[2] + ik1 * k->nb[1]);
            const float * v_d = (const float *) ((const char *) v->data + s * v->nb[3] + t * v->nb[2] + h * v->nb[1]);
            const float * g_d = (const float *) ((const char *) g->data + s * g->nb[3] + t * g->nb[2] + h * g->nb[1]);
            const float beta_val = *(const float *) ((const char *) beta->data + s * beta->nb[3] + t * beta->nb[2] + h * beta->nb[1]);

            gdn_decay(S, S_v, g_d, kda, delta);   // (delta is scratch until it is computed below)
            for (int64_t j = 0; j < S_v; ++j) {
                float sum = 0.0f;
                ggml_vec_dot_f32((int) S_v, &sum, 0, &S[j * S_v], 0, k_d, 0, 1);
                delta[j] = (v_d[j] - sum) * beta_val;
            }
            gdn_update(S, S_v, k_d, delta);
            if (delta_base != NULL) {
                memcpy(delta_base + (s * n_t + t) * delta_t_stride + h * S_v, delta, S_v * sizeof(float));
            }
            float * o = o_base + ((s * n_t + t) * H + h) * S_v;
            for (int64_t j = 0; j < S_v; ++j) {
                float sum = 0.0f;
                ggml_vec_dot_f32((int) S_v, &sum, 0, &S[j * S_v], 0, q_d, 0, 1);
                o[j] = sum * scale;
            }

            void * out = nodes + t * node_nb2;
            if (f16) {
                ggml_cpu_fp32_to_fp16(S, (ggml_fp16_t *) out, D);
            } else {
                memcpy(out, S, D * sizeof(float));
            }
            if (steps != NULL) {   // the rest of node t's replay step: head h's key (one per key head), decay
                float * step = (float *) ((char *) steps->data + t * steps->nb[1]);
                if (h < k->ne[1]) {
                    memcpy(step + h * S_v, k_d, S_v * sizeof(float));
                }
                memcpy(step + key_dim + S_v * H + h * g->ne[0], g_d, g->ne[0] * sizeof(float));
            }
        }
    }
}

void ggml_ext_cpu_gated_delta_net_tree(const struct ggml_compute_params * params, struct ggml_tensor * dst) {
    gdn_tree(params, dst, NULL, NULL);
}

void ggml_ext_cpu_gated_delta_net_tree_persist(const struct ggml_compute_params * params, struct ggml_tensor * dst) {
    gdn_tree(params, dst, dst->src[7], NULL);
}

// The CPU always walks the tree (exact or not): the chunk form is for GPUs, where the walk is latency-bound.
void ggml_ext_cpu_gated_delta_net_tree_steps(const struct ggml_compute_params * params, struct ggml_tensor * dst) {
    gdn_tree(params, dst, NULL, dst->src[7]);
}

size_t ggml_ext_cpu_gated_delta_net_path_work_size(const struct ggml_tensor * node, int n_tasks) {
    return (size_t) (node->src[0]->ne[0] + GGML_EXT_LINE_F32) * n_tasks * sizeof(float);
}

void ggml_ext_cpu_gated_delta_net_path(const struct ggml_compute_params * params, struct ggml_tensor * dst) {
    const struct ggml_tensor * state = dst->src[0];
    const struct ggml_tensor * k     = dst->src[1];
    const struct ggml_tensor * g     = dst->src[2];
    const struct ggml_tensor * delta = dst->src[3];
    const struct ggml_tensor * steps = dst->src[4];   // picked steps (ggml_gated_delta_net_path_steps), or NULL

    const int64_t S_v = state->ne[0];
    const int64_t H   = state->ne[2];
    const int64_t n_s = state->ne[3];
    const int64_t n   = delta->ne[2];                 // candidate steps
    const int64_t L   = steps != NULL ? steps->ne[0] : n;
    const int64_t D   = S_v * S_v;
    const int64_t rk3 = n_s / k->ne[3];
    const bool    kda = g->ne[0] == S_v;

    float * decay = (float *) params->wdata + params->ith * (S_v + GGML_EXT_LINE_F32);

    int64_t ir0, ir1;   // this thread's (head, sequence) pairs
    ggml_ext_thread_rows(H * n_s, params->ith, params->nth, &ir0, &ir1);

    for (int64_t ir = ir0; ir < ir1; ++ir) {
        const int64_t h = ir % H;
        const int64_t s = ir / H;
        float * S = (float *) ((char *) dst->data + s * dst->nb[3] + h * dst->nb[2]);
        // (memmove: dst may be the state itself, an in-place commit)
        memmove(S, (const char *) state->data + s * state->nb[3] + h * state->nb[2], D * sizeof(float));
        for (int64_t i = 0; i < L; ++i) {
            const int64_t l = steps != NULL ? ((const int32_t *) steps->data)[s * L + i] : i;
            if (l < 0 || l >= n) {
                continue;
            }
            const float * k_d = (const float *) ((const char *) k->data + (s / rk3) * k->nb[3] + l * k->nb[2] + (h % k->ne[1]) * k->nb[1]);
            const float * g_d = (const float *) ((const char *) g->data + s * g->nb[3] + l * g->nb[2] + h * g->nb[1]);
            const float * d_d = (const float *) ((const char *) delta->data + s * delta->nb[3] + l * delta->nb[2] + h * delta->nb[1]);
            gdn_decay(S, S_v, g_d, kda, decay);
            gdn_update(S, S_v, k_d, d_d);
        }
    }
}
