"""Prefix reuse across turns: a new prompt that extends an earlier one resumes from the saved state instead of
being prefilled from scratch.

What a resumed prompt needs, per kind of state:
- attention KV rows: nothing to copy. Row p stays valid while the tokens that produced rows 0..p are unchanged,
  so the cache only tracks the token sequence whose rows the target's cache holds (`tokens`).
- recurrent states (conv + ssm of every GDN layer): they hold one position only, so they are saved at turn
  boundaries (the end of a prompt's prefill, the end of a generation) into snapshot buffers on the same device
  (device-to-device copies) and a resumed prompt starts at a snapshot's position.
- the draft's context ring: it keeps positions like the KV cache, and is truncated to the snapshot's position
  (when the ring has overwritten positions that context needs, the snapshot cannot be used).

Snapshots are kept in LRU order, bounded by a count and a byte budget. A snapshot is valid while its tokens are a
prefix of `tokens`; the others are dropped whenever `tokens` changes. Anything else that runs the target
(another decoder, a direct `target.step`) changes the cache's epoch, and then nothing is reused.
"""
from __future__ import annotations

from collections import OrderedDict

from . import ggml


class _Snapshot:
    """Device buffers shaped like the target cache's conv_all and ssm_all (every recurrent layer's states in one
    tensor each: a save or a load is two device-to-device copies)."""

    def __init__(self, backend: ggml.Backend, cache):
        # an attention-only model has no recurrent state: its snapshot is only the position (nothing to allocate)
        self.saved, self.buffer = (), None
        if cache.conv_all is not None:
            self._ctx = ggml.Context(n_tensors=2)
            self.saved = tuple(self._ctx.new_tensor(t.type, t.ne, name=f"snapshot.{t.name}")
                               for t in (cache.conv_all, cache.ssm_all))
            self.buffer = backend.alloc_tensors(self._ctx)

    def save(self, cache) -> None:
        for live, saved in zip((cache.conv_all, cache.ssm_all), self.saved):
            live.copy_to(saved)

    def load(self, cache) -> None:
        for live, saved in zip((cache.conv_all, cache.ssm_all), self.saved):
            saved.copy_to(live)


def snapshot_nbytes(cache) -> int:
    """Bytes one snapshot of `cache` (a HybridCache) takes."""
    return sum(t.nbytes for t in (cache.conv_all, cache.ssm_all) if t is not None)


class PrefixCache:
    """Snapshots of a target's recurrent state at turn boundaries, and the tokens its cache holds.

    target: reads its public `cache` (conv, ssm, n_past, epoch) and `backend`. draft: the engine's draft (None in
    AR mode); prefix reuse with a draft needs its `truncate(n)`. max_snapshots / max_bytes: the LRU bound (the
    snapshots' device memory is allocated on first use and kept for reuse)."""

    def __init__(self, target, draft=None, *, max_snapshots: int = 4, max_bytes: int | None = None):
        if max_snapshots < 0:
            raise ValueError(f"max_snapshots must be 0 or more, got {max_snapshots}")
        if max_bytes is not None and max_bytes < 0:
            raise ValueError(f"max_bytes must be 0 or more (or None), got {max_bytes}")
        self.target, self.draft = target, draft
        self.snapshot_nbytes = snapshot_nbytes(target.cache)
        by_bytes = max_snapshots if max_bytes is None else max_bytes // max(self.snapshot_nbytes, 1)
        self.capacity = min(max_snapshots, by_bytes)
        if draft is not None and not hasattr(draft, "truncate"):
            self.capacity = 0          # a draft that cannot drop context positions cannot resume mid-way
        self.tokens: list[int] = []    # the tokens whose KV rows (and draft positions) fill 0..len-1
        self._epoch = None             # the cache epoch when `tokens` was recorded (None: nothing recorded)
        self._snapshots: OrderedDict[tuple, _Snapshot] = OrderedDict()   # least recently used first
        self._spare: list[_Snapshot] = []

    def __len__(self) -> int:
        return len(self._snapshots)

    @property
    def positions(self) -> list[int]:
        """The positions (token counts) of the snapshots kept, least recently used first."""
        return [len(key) for key in self._snapshots]

    @property
    def nbytes(self) -> int:
        """Device memory the snapshot buffers hold now."""
        return (len(self._snapshots) + len(self._spare)) * self.snapshot_nbytes

    def clear(self) -> None:
        """Forget every snapshot and the recorded tokens (the buffers are kept for reuse)."""
        self._spare.extend(self._snapshots.values())
        self._snapshots.clear()
        self.tokens, self._epoch = [], None

    def restore(self, prompt: list[int]) -> int:
        """Put the target (and draft) at the longest snapshot whose tokens are a proper prefix of `prompt` and of
        what the cache holds; returns its position, the prompt tokens that need no prefill (0: none usable, the
        caller starts from scratch). At least one prompt token is always left to prefill (it gives the logits)."""
        if self._epoch is None or self._epoch != self.target.cache.epoch or self.target.n_past != len(self.tokens):
            self.clear()               # someone else ran the model: nothing recorded is known to hold
            return 0
        candidates = sorted((key for key in self._snapshots
                             if len(key) < len(prompt) and _is_prefix(key, prompt) and _is_prefix(key, self.tokens)),
                            key=len, reverse=True)
        for key in candidates:
            n = len(key)
            if self.draft is not None and not self.draft.truncate(n):
                continue               # the draft's ring has overwritten positions this context needs
            self._snapshots[key].load(self.target.cache)
            self._snapshots.move_to_end(key)
            self.target.cache.n_past = n
            self.tokens = self.tokens[:n]
            self._epoch = self.target.cache.epoch
            return n
        return 0

    def save(self, tokens: list[int]) -> None:
        """Record that the cache now holds exactly `tokens` (n_past == len(tokens)) and snapshot its state."""
        if self.target.n_past != len(tokens):
            raise RuntimeError(f"the cache holds {self.target.n_past} positions, not the {len(tokens)} tokens given")
        tokens = [int(t) for t in tokens]
        for key in [k for k in self._snapshots if not _is_prefix(k, tokens)]:
            self._spare.append(self._snapshots.pop(key))       # its KV rows were overwritten
        self.tokens, self._epoch = tokens, self.target.cache.epoch
        key = tuple(tokens)
        if key in self._snapshots:
            self._snapshots.move_to_end(key)
            return
        if self.capacity == 0 or not tokens:
            return
        if self._spare:
            snap = self._spare.pop()
        elif len(self._snapshots) < self.capacity:
            snap = _Snapshot(self.target.backend, self.target.cache)
        else:
            snap = self._snapshots.popitem(last=False)[1]      # evict the least recently used
        snap.save(self.target.cache)
        self._snapshots[key] = snap

    def forget(self) -> None:
        """The cache's contents are unknown (a step was cut off half-way): reuse nothing of it."""
        self.clear()


def _is_prefix(key: tuple, tokens: list[int]) -> bool:
    return len(key) <= len(tokens) and tuple(tokens[:len(key)]) == key
