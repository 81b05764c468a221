"""Where a verify and a decode part ways: run a chain as one verify and token by token, keeping every named node
of the target's graphs (`l3.gdn.conv`, `l3.attn_out`, `out.logits`, ...), and name, for every slot, the first node
in graph order whose values differ between the two. Nodes before it agree bit for bit, so the op that makes it
(or an unnamed op between it and its nearest named inputs) is where the two forwards stop computing the same
numbers: one GPU run localises a gap in bit-exact mode (docs/benchmarks.md, "Bit-exact mode").

Keeping a node makes it a graph output, which stops ggml's CUDA backend from fusing it into the next op; the
fused kernels compute the same values, so the comparison holds for the real graphs.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .ggml import Op
from .ggml._ffi import lib

_NOT_COMPUTED = {Op.NONE, Op.VIEW, Op.RESHAPE, Op.PERMUTE, Op.TRANSPOSE}


@dataclass(frozen=True)
class Divergence:
    """The first named node of slot `slot` whose values differ (None: every kept node agrees), by how much."""
    slot: int
    node: str | None
    max_abs_diff: float
    checked: int               # named nodes compared for this slot


def keep_named_nodes(target) -> None:
    """Make every named, computed, contiguous node of the target's graphs built from now on a graph output (so its
    memory is not reused; for a named reshape, the tensor it reshapes) and list it in the graph's `kept` (name ->
    tensor, graph order)."""
    build = target._build

    def build_keeping(n, n_kv, tree=False, fed=False):
        g = build(n, n_kv, tree, fed)
        g.kept = {}
        for node in g.graph.nodes():
            name = node.name
            if not name or "(" in name or name.startswith(("node_", "leaf_")) or not node.is_contiguous:
                continue
            if node.op == Op.RESHAPE and node.src[0].is_contiguous:   # a named reshape: keep what it reshapes
                lib.ggml_set_output(node.src[0]._ptr)
            elif node.op in _NOT_COMPUTED:
                continue
            else:
                lib.ggml_set_output(node._ptr)
            g.kept.setdefault(name, node)
        return g

    target._build = build_keeping
    target._graphs.clear()


def _snapshot(g) -> dict[str, np.ndarray]:
    return {name: t.numpy().reshape(t.ne[::-1]) for name, t in g.kept.items()}


def _token_rows(verified: np.ndarray, decoded: np.ndarray, n: int, slot: int):
    """The slot's part of a verify node and the decode node (both in numpy order of ggml's 4 dims): the axis that is
    n long in the verify and 1 in the decode is the token axis. None when the shapes do not pair up that way."""
    if verified.shape == decoded.shape and n == 1:
        return verified, decoded
    for axis in range(4):
        if verified.shape[axis] == n and decoded.shape[axis] == 1:
            rest_v = verified.shape[:axis] + verified.shape[axis + 1:]
            rest_d = decoded.shape[:axis] + decoded.shape[axis + 1:]
            if rest_v == rest_d:
                return np.take(verified, slot, axis), np.take(decoded, 0, axis)
    return None


def first_divergence(target, prompt, chain) -> list[Divergence]:
    """Verify `chain` (a chain of slots at the end of `prompt`) in one forward and decode it token by token; per
    slot, the first kept node (verify graph order) whose values differ. The target's graph cache is rebuilt."""
    chain = np.asarray(chain, np.int64)
    n = chain.size
    keep_named_nodes(target)
    target.reset()
    target.prefill(prompt, return_logits=False)
    target.enable_verify(n)
    target.verify(chain, parents=np.arange(-1, n - 1), depths=np.arange(n))
    order = list(target._last.kept)
    verified = _snapshot(target._last)

    target.reset()
    target.prefill(prompt, return_logits=False)
    decoded = []
    for token in chain:
        target.decode(int(token))
        decoded.append(_snapshot(target._last))

    report = []
    for slot in range(n):
        found, checked = None, 0
        for name in order:
            if name not in decoded[slot]:
                continue
            pair = _token_rows(verified[name], decoded[slot][name], n, slot)
            if pair is None:
                continue
            checked += 1
            a, b = pair
            if not np.array_equal(a, b, equal_nan=True):
                diff = np.abs(a.astype(np.float64) - b.astype(np.float64))
                found = Divergence(slot, name, float(np.nanmax(diff)) if diff.size else 0.0, checked)
                break
        report.append(found or Divergence(slot, None, 0.0, checked))
    return report


def describe(report: list[Divergence]) -> str:
    lines = []
    for d in report:
        if d.node is None:
            lines.append(f"slot {d.slot}: all {d.checked} named nodes bit-identical")
        else:
            lines.append(f"slot {d.slot}: first differing node {d.node!r} (max |diff| {d.max_abs_diff:.3g}; "
                         f"{d.checked - 1} earlier named nodes identical)")
    return "\n".join(lines)
