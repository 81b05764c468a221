"""ggml_argmax_first: the lowest index of each row's maximum, against numpy, on every backend (CPU in CI, CUDA with
`-m cuda`): ties inside and across the CUDA kernel's chunks, rows of -inf, strided row views, vocabulary sizes."""
import numpy as np
import pytest

from pydflash import ggml

from conftest import run_graph

CHUNK = 2048    # ARGMAX_CHUNK in ggml_ext/cuda/argmax_first.cu: values per CUDA block


def argmax_rows(backend, x: np.ndarray) -> np.ndarray:
    return run_graph(backend, lambda ctx, t: ggml.argmax_first(ctx, t["x"]), {"x": x}).reshape(-1)


@pytest.mark.parametrize("n, rows", [(1, 1), (7, 3), (CHUNK, 2), (CHUNK + 1, 1), (151936, 1), (248320, 23)])
def test_random_rows_match_numpy(backend, n, rows):
    x = np.random.default_rng(n).standard_normal((rows, n)).astype(np.float32)
    np.testing.assert_array_equal(argmax_rows(backend, x), np.argmax(x, axis=1))


def test_ties_resolve_to_the_lowest_index(backend):
    n = 5 * CHUNK + 17
    x = np.random.default_rng(0).uniform(-1, 1, (6, n)).astype(np.float32)
    spots = [(3 * CHUNK + 5, 4 * CHUNK + 1, n - 1), (CHUNK - 1, CHUNK), (7, 9, 2 * CHUNK),   # across / inside chunks
             (0, n - 1), (n - 2, n - 1), tuple(range(0, n, 997))]
    for r, idx in enumerate(spots):
        x[r, list(idx)] = 2.0
    got = argmax_rows(backend, x)
    assert got.tolist() == [min(idx) for idx in spots]
    np.testing.assert_array_equal(got, np.argmax(x, axis=1))     # numpy's argmax also takes the first maximum


def test_rows_of_negative_infinity_and_all_equal(backend):
    x = np.full((3, 3 * CHUNK), -np.inf, np.float32)
    x[1] = 0.5
    x[2, 2 * CHUNK + 3] = -1e30
    assert argmax_rows(backend, x).tolist() == [0, 0, 2 * CHUNK + 3]


def test_strided_rows_of_a_view(backend):
    """Logits rows read through a view whose row stride is wider than the row (the verify takes such views)."""
    full = np.random.default_rng(3).standard_normal((4, CHUNK + 100)).astype(np.float32)
    n = CHUNK + 37
    got = run_graph(backend, lambda ctx, t: ggml.argmax_first(
        ctx, ctx.view_2d(t["x"], n, 4, t["x"].nb[1], 0)), {"x": full}).reshape(-1)
    np.testing.assert_array_equal(got, np.argmax(full[:, :n], axis=1))
