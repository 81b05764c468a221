"""Sampling: the settings and their validation, the sampler nodes appended to a target graph's logits, the
per-row inputs those nodes read each step (penalty history, settings, one uniform per row), and a float64 numpy
reference of the filtering. The rule itself, and why speculative decoding with it stays exact, is in
docs/sampling.md.

The filtering and the draw run on the device (ggml_ext's sample_tokens op, ggml_ext/include/ggml-ext.h), so a
step reads back only the drawn token of every row. The random numbers come from a host generator seeded by
`seed`: one uniform per row per forward, so a seed and settings give the same tokens on the same device.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, fields

import numpy as np

PENALTY_LAST_N = 64       # tokens of history the penalties look at (llama.cpp's default repeat_last_n)
N_PARAMS = 8              # GGML_EXT_SAMPLE_N_PARAMS


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings. The defaults are greedy decoding (temperature 0) without penalties.

    temperature: 0 picks the argmax (after the penalties); > 0 samples from softmax(logits / temperature).
    top_k: keep the k most likely tokens (0: all). top_p: keep the smallest most-likely set holding this share
    of the probability (1: all). min_p: keep tokens at least this fraction as likely as the most likely (0: all).
    repeat_penalty, presence_penalty, frequency_penalty: llama.cpp's penalties over the last PENALTY_LAST_N
    tokens (prompt included). seed: the random numbers' seed (None: a fresh one per generation)."""
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    repeat_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    def __post_init__(self):
        _check_real("temperature", self.temperature, lo=0.0)
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, numbers.Integral) or self.top_k < 0:
            raise ValueError(f"top_k={self.top_k!r}: expected an integer >= 0 (0 keeps every token)")
        _check_real("top_p", self.top_p, lo=0.0, hi=1.0, lo_open=True)
        _check_real("min_p", self.min_p, lo=0.0, hi=1.0)
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, numbers.Integral)
                                      or not 0 <= self.seed < 2 ** 64):
            raise ValueError(f"seed={self.seed!r}: expected an integer in 0..2**64-1, or None")
        _check_real("repeat_penalty", self.repeat_penalty, lo=0.0, lo_open=True)
        _check_real("presence_penalty", self.presence_penalty, lo=-2.0, hi=2.0)
        _check_real("frequency_penalty", self.frequency_penalty, lo=-2.0, hi=2.0)

    @classmethod
    def from_options(cls, options: dict) -> "SamplingParams":
        """Settings from keyword options (as Engine.generate takes them). Unknown names are refused; None
        means the default."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(f"unknown sampling option(s) {', '.join(unknown)}: expected some of "
                             f"{', '.join(f.name for f in fields(cls))}")
        values = {}
        for name, value in options.items():
            if value is None:
                continue
            if name == "top_k" and isinstance(value, float) and value.is_integer():
                value = int(value)
            values[name] = value
        return cls(**values)

    @property
    def penalised(self) -> bool:
        return self.repeat_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def greedy(self) -> bool:
        """Plain argmax decoding: the graphs keep their argmax output and no sampler runs."""
        return self.temperature == 0.0 and not self.penalised

    def vector(self) -> np.ndarray:
        """The op's params tensor, indexed as GGML_EXT_SAMPLE_* in ggml-ext.h."""
        v = np.zeros(N_PARAMS, np.float32)
        v[:7] = (self.temperature, self.top_k, self.top_p, self.min_p, self.repeat_penalty, self.presence_penalty,
                 self.frequency_penalty)
        return v

    def generator(self) -> np.random.Generator:
        return np.random.Generator(np.random.PCG64(self.seed))


def _check_real(name, value, *, lo=None, hi=None, lo_open=False):
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ValueError(f"{name}={value!r}: expected a finite number")
    if lo is not None and (value < lo or (lo_open and value == lo)):
        raise ValueError(f"{name}={value!r}: expected a value {'>' if lo_open else '>='} {lo}")
    if hi is not None and value > hi:
        raise ValueError(f"{name}={value!r}: expected a value <= {hi}")


GREEDY = SamplingParams()


# --- the per-forward inputs ---

@dataclass
class StepInputs:
    """What the sampler nodes of one forward read: hist i32 [n_rows, PENALTY_LAST_N] (-1: none), params f32
    [N_PARAMS], rand f32 [n_rows]."""
    hist: np.ndarray
    params: np.ndarray
    rand: np.ndarray


def recent(tokens, n: int = PENALTY_LAST_N) -> np.ndarray:
    """The last n tokens, left-padded with -1: i32 [n]."""
    out = np.full(n, -1, np.int32)
    tail = list(tokens)[-n:]
    if tail:
        out[n - len(tail):] = tail
    return out


def slot_histories(context, slot_tokens, parents, n: int = PENALTY_LAST_N) -> np.ndarray:
    """Each verify slot's own penalty history, i32 [n_slots, n]: the committed context (the root last), then the
    tokens on the tree path down to the slot. Slots whose parent is -1 (the root, padding) see the context."""
    base = recent(context, n)
    out = np.empty((len(parents), n), np.int32)
    out[0] = base
    for s in range(1, len(parents)):
        p = int(parents[s])
        if p < 0:
            out[s] = base
        else:
            out[s, :-1] = out[p, 1:]
            out[s, -1] = slot_tokens[s]
    return out


class Sampler:
    """The sampling of one generation: its settings and seeded random numbers, and the inputs of each forward."""

    def __init__(self, params: SamplingParams):
        self.params = params
        self.rng = params.generator()
        self._vector = params.vector()

    def inputs(self, histories: np.ndarray) -> StepInputs:
        """Inputs for a forward whose rows have these penalty histories (one row each): draws the uniforms."""
        n_rows = histories.shape[0]
        return StepInputs(histories, self._vector, self.rng.random(n_rows, dtype=np.float32))

    def for_context(self, context) -> StepInputs:
        """Inputs for a forward whose one sampled row continues `context`."""
        return self.inputs(recent(context)[None, :] if self.params.penalised else _NO_HISTORY[:1])

    def for_tree(self, context, slot_tokens, parents) -> StepInputs:
        if self.params.penalised:
            return self.inputs(slot_histories(context, slot_tokens, parents))
        return self.inputs(_no_history(len(parents)))


_NO_HISTORY = np.full((1, PENALTY_LAST_N), -1, np.int32)


def _no_history(n_rows: int) -> np.ndarray:
    return np.broadcast_to(_NO_HISTORY, (n_rows, PENALTY_LAST_N))


# --- the graph nodes ---

class SamplerNodes:
    """The sampler appended to one graph: its inputs and the drawn token of every logits row."""

    def __init__(self, ctx, logits):
        from . import ggml
        n_rows = logits.ne[1]
        self.hist = ctx.new_tensor(ggml.Type.I32, (PENALTY_LAST_N, n_rows), name="inp.sample_hist").mark_input()
        self.params = ctx.new_tensor(ggml.Type.F32, (N_PARAMS,), name="inp.sample_params").mark_input()
        self.rand = ctx.new_tensor(ggml.Type.F32, (n_rows,), name="inp.sample_rand").mark_input()
        self.tokens = ggml.sample_tokens(ctx, logits, self.hist, self.params, self.rand).named("out.sampled")
        self.n_rows = n_rows

    def set(self, inputs: StepInputs | None) -> None:
        """Upload a forward's inputs; None: neutral ones (greedy settings, no history), so a forward that is not
        sampling computes on defined values."""
        if inputs is None:
            inputs = StepInputs(_no_history(self.n_rows), GREEDY.vector(), np.zeros(self.n_rows, np.float32))
        if inputs.hist.shape[0] != self.n_rows or inputs.rand.size != self.n_rows:
            raise ValueError(f"sampler inputs for {inputs.hist.shape[0]} rows, the graph has {self.n_rows}")
        self.hist.set(np.ascontiguousarray(inputs.hist, np.int32))
        self.params.set(inputs.params)
        self.rand.set(inputs.rand)


def attach(ctx, logits) -> SamplerNodes:
    """Append the sampler to a graph's logits f32 [n_vocab, n_rows]; `.tokens` is i32 [n_rows]."""
    return SamplerNodes(ctx, logits)


# --- the float64 reference ---

def reference_probs(logits, params: SamplingParams, history=()) -> np.ndarray:
    """The distribution the sampler draws from, in float64 numpy (the tests' oracle; slow, one row)."""
    x = np.asarray(logits, np.float64).copy()
    hist = [int(t) for t in history if 0 <= int(t) < x.size][-PENALTY_LAST_N:]
    for tok in set(hist):
        c = hist.count(tok)
        x[tok] = x[tok] * params.repeat_penalty if x[tok] <= 0 else x[tok] / params.repeat_penalty
        x[tok] -= c * params.frequency_penalty + params.presence_penalty
    if params.temperature == 0.0:
        out = np.zeros_like(x)
        out[int(np.argmax(x))] = 1.0
        return out
    keep = np.ones(x.size, bool)
    if 0 < params.top_k < x.size:
        keep &= x >= np.sort(x)[::-1][params.top_k - 1]
    p = np.exp(x - x.max())
    if params.top_p < 1.0:
        kept_mass = p[keep].sum()
        # the largest value v whose tokens at or above it (within the kept set) hold top_p of the mass
        for v in np.sort(p[keep])[::-1]:
            if p[keep & (p >= v)].sum() >= params.top_p * kept_mass:
                keep &= p >= v
                break
    if params.min_p > 0.0:
        keep &= p >= params.min_p
    w = np.where(keep, np.exp((x - x.max()) / params.temperature), 0.0)
    return w / w.sum()
