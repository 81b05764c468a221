"""ggml_top_k_logp: each row's k best logits (larger first, equal logits by lower id) and their log-softmax,
against numpy float64, on every backend (CPU in CI, CUDA with `-m cuda`): ties inside the top k and at its k-th
boundary (also across the CUDA kernel's chunks), -inf and NaN logits, strided row views, the wrapper's errors.

Log-prob bound: the CPU kernel sums exp in double and the CUDA kernel in float32 (per-term relative error a few
1e-7, a relative error of the sum of ~1e-6 at most, i.e. ~1e-6 in log space); the result is then rounded to
float32, half an ulp of |logp| <= 64 being 3.8e-6. So 1e-5 absolute for logits within +-30."""
import numpy as np
import pytest

from pydflash import ggml

from conftest import run_graph

CHUNK = 8192    # TOPK_CHUNK in ggml_ext/cuda/top_k_logp.cu: logits per pass-1 CUDA block
ATOL = 1e-5


def top_k_logp(backend, x: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(ids int64 [rows, k], logp float32 [rows, k]) from the op."""
    out = run_graph(backend, lambda ctx, t: ggml.top_k_logp(ctx, t["x"], k), {"x": x})
    out = out.reshape(x.shape[0], 2, k)     # numpy() drops trailing dims of 1
    ids = out[:, 1]
    assert np.array_equal(ids, np.round(ids)), "ids must be exact integers"
    return ids.astype(np.int64), out[:, 0]


def reference(x: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """numpy float64: ids by (-logit, id), NaN last; logp = logit - (max + log sum exp(x - max))."""
    ids, logp = [], []
    for row in x.astype(np.float64):
        rank = np.where(np.isnan(row), np.inf, -row)     # NaN below every number
        order = np.lexsort((np.arange(row.size), rank))[:k]
        finite = row[row > -np.inf]                      # also drops NaN
        m = finite.max() if finite.size else np.nan
        lse = np.nan if np.isnan(row).any() else m + np.log(np.sum(np.exp(finite - m)))
        ids.append(order)
        logp.append(row[order] - lse)
    return np.array(ids), np.array(logp)


def check(backend, x: np.ndarray, k: int) -> None:
    ids, logp = top_k_logp(backend, x, k)
    want_ids, want_logp = reference(x, k)
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_allclose(logp, want_logp, rtol=0, atol=ATOL)


@pytest.mark.parametrize("n, rows, k", [(1, 1, 1), (7, 2, 7), (40, 3, 32), (CHUNK, 2, 8), (CHUNK + 1, 3, 16),
                                        (151936, 15, 8), (248320, 2, 32)])
def test_random_rows_match_numpy(backend, n, rows, k):
    x = np.random.default_rng(n + k).uniform(-30, 30, (rows, n)).astype(np.float32)
    check(backend, x, k)


@pytest.mark.parametrize("k", [1, 5, 8, 16, 32])
def test_ties_inside_and_at_the_kth_boundary(backend, k):
    n = 4 * CHUNK + 123
    rng = np.random.default_rng(k)
    x = rng.uniform(-10, 10, (5, n)).astype(np.float32)
    x[0, rng.choice(n, 3 * k, replace=False)] = 12.0          # more equal maxima than k, spread over chunks
    top = rng.choice(n, k + 4, replace=False)                  # k-1 distinct best, then a tie for the k-th spot
    x[1, top[: k - 1]] = 20.0 + np.arange(k - 1, dtype=np.float32)
    x[1, top[k - 1:]] = 15.0
    x[2, [CHUNK - 1, CHUNK, 2 * CHUNK + 7, n - 1]] = 11.0     # equal maxima in neighbouring chunks
    x[3] = np.round(rng.uniform(-3, 3, n) * 2) / 2             # only 13 distinct values: ties everywhere
    x[4] = -5.0                                                # one value everywhere
    check(backend, x, k)
    ids, _ = top_k_logp(backend, x, k)
    assert ids[4].tolist() == list(range(k))                   # the lowest ids of a constant row
    assert ids[1, k - 1] == top[k - 1:].min()                  # the k-th spot goes to the lowest tied id


def test_signed_zeros_and_subnormals_are_equal(backend):
    """-0, +0 and subnormals share one rank (CUDA flushes subnormals to zero in comparisons), so ties go by id."""
    x = np.full((1, 50), -1.0, np.float32)
    x[0, [30, 10, 20, 5]] = [-0.0, 0.0, -0.0, 1e-40]
    ids, _ = top_k_logp(backend, x, 5)
    assert ids[0].tolist() == [5, 10, 20, 30, 0]


def test_negative_infinity(backend):
    """Masked logits (-inf) have probability 0; they fill the k slots after the finite ones, lowest ids first; a
    row of only -inf gives ids 0..k-1 with -inf log-probs."""
    n, k = 2 * CHUNK + 5, 8
    x = np.full((3, n), -np.inf, np.float32)
    x[0, [3, CHUNK + 9, n - 1]] = [1.0, 2.5, -4.0]
    x[1] = np.random.default_rng(1).uniform(-30, 30, n)
    x[1, ::2] = -np.inf
    ids, logp = top_k_logp(backend, x, k)
    assert ids[0].tolist() == [CHUNK + 9, 3, n - 1, 0, 1, 2, 4, 5]
    assert np.all(logp[0, 3:] == -np.inf)
    check(backend, x[:2], k)
    assert ids[2].tolist() == list(range(k)) and np.all(logp[2] == -np.inf)


def test_nan_is_never_chosen_before_a_number(backend):
    x = np.random.default_rng(2).uniform(-5, 5, (2, CHUNK + 50)).astype(np.float32)
    x[0, [0, 7, CHUNK + 1]] = np.nan
    x[0, 100] = 9.0
    x[1, :] = np.nan
    x[1, [4, 9]] = [1.0, 2.0]
    ids, logp = top_k_logp(backend, x, 4)
    assert ids[0, 0] == 100 and not np.isin(ids[0], [0, 7, CHUNK + 1]).any()
    assert ids[1].tolist() == [9, 4, 0, 1]           # the numbers, then NaN by lowest id
    assert np.all(np.isnan(logp))                    # a NaN in the row makes its logsumexp NaN
    np.testing.assert_array_equal(ids, reference(x, 4)[0])


def test_strided_rows_of_a_view(backend):
    """Logit rows read through a view whose row stride is wider than the row."""
    full = np.random.default_rng(3).uniform(-30, 30, (4, CHUNK + 100)).astype(np.float32)
    n, k = CHUNK + 37, 8
    out = run_graph(backend, lambda ctx, t: ggml.top_k_logp(
        ctx, ctx.view_2d(t["x"], n, 4, t["x"].nb[1], 0), k), {"x": full}).reshape(4, 2, k)
    want_ids, want_logp = reference(full[:, :n], k)
    np.testing.assert_array_equal(out[:, 1].astype(np.int64), want_ids)
    np.testing.assert_allclose(out[:, 0], want_logp, rtol=0, atol=ATOL)


def test_bad_inputs_are_named():
    ctx = ggml.Context(n_tensors=8, graph_size=8)
    short = ctx.new_tensor(ggml.Type.F32, (5, 2))
    with pytest.raises(ValueError, match="5 values, fewer than k = 6"):
        ggml.top_k_logp(ctx, short, 6)
    wide = ctx.new_tensor(ggml.Type.F32, (100, 2))
    with pytest.raises(ValueError, match="k must be in 1..32, got 33"):
        ggml.top_k_logp(ctx, wide, 33)
    with pytest.raises(ValueError, match="got 0"):
        ggml.top_k_logp(ctx, wide, 0)
    with pytest.raises(TypeError, match="logits must be F32"):
        ggml.top_k_logp(ctx, ctx.new_tensor(ggml.Type.F16, (100, 2)), 4)
