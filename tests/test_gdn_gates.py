"""ggml_gdn_gates (a Gated DeltaNet layer's log-decay and beta gate in one op) on every backend (CPU in CI, CUDA
with `-m cuda`): against float64 numpy, and bit for bit against the four ggml ops it replaces (add, softplus, mul,
sigmoid) on the same backend, with beta and alpha read as row ranges of one fused projection output."""
import numpy as np
import pytest

from conftest import rel_err, run_graph
from pydflash import ggml

H = 48


def inputs(rng, n: int) -> dict[str, np.ndarray]:
    """A fused projection's output [n, rows] (numpy order) whose rows 5..5+H are beta and the next H alpha; alpha
    spans softplus's linear branch (x > 20) too."""
    proj = rng.standard_normal((n, 2 * H + 11)).astype(np.float32) * 4.0
    proj[:, 5 + H: 5 + H + 4] = [25.0, 20.5, 19.5, -30.0]
    return {"proj": proj, "dt_bias": rng.standard_normal(H).astype(np.float32),
            "a": -np.exp(rng.standard_normal(H)).astype(np.float32)}


def views(ctx, t):
    proj = t["proj"]
    beta = ctx.view_2d(proj, H, proj.ne[1], proj.nb[1], 5 * 4)
    alpha = ctx.view_2d(proj, H, proj.ne[1], proj.nb[1], (5 + H) * 4)
    return beta, alpha


def gates(ctx, t):
    beta, alpha = views(ctx, t)
    return list(ggml.gdn_gates(ctx, beta, alpha, t["dt_bias"], t["a"]))


def gates_by_ggml_ops(ctx, t):
    beta, alpha = views(ctx, t)
    g = ctx.mul(ctx.softplus(ctx.add(ctx.cont(alpha), t["dt_bias"])), t["a"])
    return [g, ctx.sigmoid(ctx.cont(beta))]


@pytest.mark.parametrize("n", [1, 23, 512])
def test_gates_match_numpy_and_the_ops_they_replace(backend, rng, n):
    x = inputs(rng, n)
    g, beta = run_graph(backend, gates, x)
    g_ops, beta_ops = run_graph(backend, gates_by_ggml_ops, x)
    np.testing.assert_array_equal(g.reshape(n, H), g_ops.reshape(n, H))
    np.testing.assert_array_equal(beta.reshape(n, H), beta_ops.reshape(n, H))

    proj = x["proj"].astype(np.float64)
    z = proj[:, 5 + H: 5 + 2 * H] + x["dt_bias"]
    g_ref = np.where(z > 20.0, z, np.log1p(np.exp(np.minimum(z, 20.0)))) * x["a"]
    beta_ref = 1.0 / (1.0 + np.exp(-proj[:, 5: 5 + H]))
    assert rel_err(g.reshape(n, H), g_ref) < 1e-6
    assert rel_err(beta.reshape(n, H), beta_ref) < 1e-6
    assert np.all(g <= 0.0)


def test_gdn_gates_rejects_bad_input():
    ctx = ggml.Context(n_tensors=8)
    beta = ctx.new_tensor(np.float32, (H, 3))
    vec = ctx.new_tensor(np.float32, (H,))
    with pytest.raises(ValueError, match="alpha must have ne"):
        ggml.gdn_gates(ctx, beta, ctx.new_tensor(np.float32, (H, 4)), vec, vec)
    with pytest.raises(ValueError, match="dt_bias must have ne"):
        ggml.gdn_gates(ctx, beta, beta, ctx.new_tensor(np.float32, (H + 1,)), vec)
    with pytest.raises(TypeError, match="a must be F32"):
        ggml.gdn_gates(ctx, beta, beta, vec, ctx.new_tensor(np.float16, (H,)))
