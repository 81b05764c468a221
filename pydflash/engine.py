"""The decoding engine: autoregressive, chain and DDTree speculative decoding behind one loop.

Plain step functions, each one concern: `prefill`, `draft_step`, `verify_step`, `commit_step`. A speculative
step proposes per-position top-K tokens with the draft, lays them out as a tree (or a chain), verifies every
slot with one target forward, walks the target's argmaxes down the tree and commits the accepted path on the
device. Greedy verification is lossless: the output equals plain AR decoding token for token.

Sampling (pydflash.sampling) keeps the same walk: the verify draws the target's own token at every slot on the
device (from that slot's filtered distribution), the walk follows the child carrying the drawn token and stops
with the drawn token where none does (sample-and-match). The committed text then has exactly the distribution of
plain sampling (docs/sampling.md).

A draft is any object with
    block_size: int                                  proposals cover block_size - 1 positions after the root
    reset() -> None
    append_context(target, first_position, slots)    the target's captured features of verify/prefill `slots`
                                                     (rows of target.captured) become context positions
                                                     first_position, first_position + 1, ...
    propose(tokens, k) -> (logp [B-1, k], ids [B-1, k])   tokens: every committed token, the root last
    truncate(n) -> bool   (optional, for prefix reuse) keep context positions 0..n-1; False if it cannot
    queue_propose(tokens, k, then) -> take   (optional) propose queued on the device: take() waits and returns
                          what propose would; then() queues more work behind the draft's forward first
    stage_context(target, first_position, depths)   (optional) start on the context of every slot of the verify
                          just queued (slot s at first_position + depths[s]) before the accepted ones are known
The DFlash draft (pydflash.models.dflash_draft.DFlashDraft) is adapted to it by `engine_draft`, with all three.
Then the device waits little for the host between one verify and the next: the verify's slots are staged into
the draft's context while the host waits for the verify's tokens; the next draft forward (which first copies the
accepted path's staged rows into the draft's context) and, behind it, the target's commit of the path are queued
before the step returns its tokens, so they run while the consumer takes them and while the host builds the next
tree (docs/benchmarks.md, twenty-third session: where the device still waits).
"""
from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from . import ddtree
from .sampling import GREEDY, Sampler, SamplingParams

MODES = ("ar", "chain", "ddtree")


@dataclass
class _Run:
    """What one generation accumulates: committed ids, and the counters the stats come from."""
    context: list[int]                       # prompt + everything committed so far (the root last)
    sampler: Sampler | None = None           # None: greedy (argmax) decoding
    uncommitted: list[int] | None = None     # the last step's accepted path, until the target commits it (queued
                                             # behind the next draft forward, or at the end of the run)
    proposals: Callable[[], tuple[np.ndarray, np.ndarray]] | None = None   # the next step's, queued (take())
    new: list[int] = field(default_factory=list)
    done: bool = False
    steps: int = 0
    committed_per_step: list[int] = field(default_factory=list)   # accepted nodes + 1 per verify step
    off_chain_steps: int = 0                 # steps whose accepted path was not slots 0, 1, 2, .. (KV compacted)
    draft_s: float = 0.0
    verify_s: float = 0.0
    commit_s: float = 0.0
    host_s: float = 0.0


class _DFlashAdapter:
    """The engine's draft interface over a DFlashDraft: features come from the target's captured rows on the
    device (a verify's staged while it runs; appends queued: the draft's next forward is ordered after them on the
    same stream), proposals from its on-device top-K, queued."""

    def __init__(self, draft):
        self.draft = draft
        self.block_size = draft.block_size

    def reset(self) -> None:
        self.draft.reset()

    def truncate(self, n: int) -> bool:
        return self.draft.truncate(n)

    def append_context(self, target, first_position: int, slots) -> None:
        if first_position != self.draft.n_ctx:
            raise RuntimeError(f"draft context holds {self.draft.n_ctx} positions, got features for {first_position}")
        self.draft.append_from_target(list(slots), wait=False)

    def stage_context(self, target, first_position: int, depths) -> None:
        self.draft.stage_from_target(first_position, depths, wait=False)

    def queue_propose(self, tokens, k: int, then=None):
        if k > self.draft.top_k:
            raise ValueError(f"the draft was built for top_k {self.draft.top_k}, the engine asks for {k}")
        wait = self.draft.queue_propose(tokens[-1], then)

        def take():
            ids, logp = wait()
            return logp[:, :k], ids[:, :k]
        return take

    def propose(self, tokens, k: int):
        return self.queue_propose(tokens, k)()


def engine_draft(draft):
    """`draft` as the engine's draft interface (objects that already implement it pass through)."""
    if draft is None or hasattr(draft, "append_context"):
        return draft
    if hasattr(draft, "append_from_target"):
        return _DFlashAdapter(draft)
    raise TypeError(f"{type(draft).__name__} is not a draft (needs append_context/propose or a DFlashDraft)")


# --- step functions ---

def prefill(target, draft, prompt_ids: list[int], prefix=None, sampler: Sampler | None = None) -> tuple[int, int]:
    """Run the prompt through the target (the draft takes its features); returns (the first new token, prompt
    tokens reused). The token is drawn by `sampler` when given (its penalties see the whole prompt), else the
    argmax. With a PrefixCache the prompt resumes from its longest usable snapshot, else from scratch."""
    reused = prefix.restore(prompt_ids) if prefix is not None else 0
    if reused == 0:
        target.reset()
        if draft is not None:
            draft.reset()
    rest = prompt_ids[reused:]
    if sampler is not None:
        target.sample_inputs = sampler.for_context(prompt_ids)
    if draft is None:
        target.prefill(rest, return_logits=False)
    else:
        target.prefill(rest, return_logits=False,
                       on_ubatch=lambda first, n: draft.append_context(target, first, list(range(n))))
    if prefix is not None:
        prefix.save(prompt_ids)
    return (int(target.sampled()[0]) if sampler is not None else target.argmax()), reused


def queue_draft_step(draft, context: list[int], k: int, then: Callable[[], None] | None = None
                     ) -> Callable[[], tuple[np.ndarray, np.ndarray]]:
    """Queue the draft's top-k proposals for the block after context[-1]; returns the call that waits for them and
    returns (log-probs, ids). then: work to queue on the device before the proposals are waited for (a deferred
    target commit): behind the draft's forward where the draft queues (queue_propose), else at once (and the
    draft's propose runs when its proposals are asked for)."""
    if hasattr(draft, "queue_propose"):
        take = draft.queue_propose(context, k, then)
    else:
        if then is not None:
            then()
        take = functools.partial(draft.propose, list(context), k)

    def proposals():
        logp, ids = take()
        return np.asarray(logp, np.float32), np.asarray(ids, np.int64)
    return proposals


def draft_step(draft, context: list[int], k: int, then: Callable[[], None] | None = None
               ) -> tuple[np.ndarray, np.ndarray]:
    """The draft's top-k proposals (log-probs, ids) for the block after context[-1] (queue_draft_step, waited for)."""
    return queue_draft_step(draft, context, k, then)()


def make_tree(mode: str, logp, ids, budget: int, seed_chain: bool) -> ddtree.Tree:
    if mode == "chain":
        return ddtree.chain_tree(ids[:, 0], budget)
    return ddtree.build_tree(logp, ids, budget, seed_chain=seed_chain)


def verify_step(target, tree: ddtree.Tree, context: list[int], sampler: Sampler | None = None,
                then: Callable[[np.ndarray], None] | None = None) -> np.ndarray:
    """One target forward over the root (context[-1]) and the tree (padded to the target's fixed slots): the
    target's token per slot, its argmax, or with `sampler` a draw from the slot's filtered distribution (each
    slot's penalties see its own path). then(depths): work to queue behind the forward before its tokens are
    waited for, given the padded slots' depths (the draft's staging of their context)."""
    tokens, parents, depths = ddtree.padded(tree, target.n_slots)
    tokens[0] = context[-1]
    if sampler is not None:
        target.sample_inputs = sampler.for_tree(context, tokens, parents)
    if then is None:
        return target.verify(tokens, parents, depths)
    return target.verify(tokens, parents, depths, then=functools.partial(then, depths))


def commit_step(target, draft, path: list[int], commit_target: bool = True) -> None:
    """Commit the accepted slots on the device and hand their features to the draft's context (the verify's
    captured rows, which the target's commit does not change). commit_target=False leaves the target's commit to
    the caller (before the next verify: the engine queues it behind the next draft forward)."""
    first = target.n_past
    if draft is not None:
        draft.append_context(target, first, path)
    if commit_target:
        target.commit(path)


# --- the engine ---

class Decoder:
    """Decoding of `target` (greedy, or sampled: see iter_generate) in one of MODES; `draft` is needed by
    `chain` and `ddtree`.

    budget: tree nodes per step (ddtree) or chain length (chain, capped by the draft block). top_k: proposals
    per position the draft hands over (ddtree). seed_chain: seed the tree with the draft's top-1 chain.
    state_type: 'f32', 'f16' or 'replay' recurrent states of the tree nodes (TargetRuntime.enable_verify; f16 and
    replay need the tree ops).
    eog: a predicate on token ids that ends generation (the tokenizer's end-of-generation test); stop_tokens:
    more ids that do. prefix_snapshots / prefix_bytes: the bound of the prefix cache (pydflash.prefix_cache)
    that lets a prompt extending an earlier one resume from it; 0 snapshots turn prefix reuse off."""

    def __init__(self, target, draft=None, *, mode: str | None = None, budget: int = 22, top_k: int | None = None,
                 seed_chain: bool = False, state_type: str = "f32", tokenizer=None, stop_tokens=(),
                 prefix_snapshots: int = 0, prefix_bytes: int | None = None):
        mode = mode or ("ddtree" if draft is not None else "ar")
        if mode not in MODES:
            raise ValueError(f"mode {mode!r}: expected one of {MODES}")
        if mode != "ar" and draft is None:
            raise ValueError(f"mode {mode!r} needs a draft model")
        if budget < 1:
            raise ValueError("budget must be at least 1")
        if mode != "ddtree" and (seed_chain or top_k not in (None, 1)):
            raise ValueError(f"top_k and seed_chain shape ddtree trees; mode {mode!r} does not use them")
        if mode == "ar" and state_type != "f32":
            raise ValueError("state_type concerns the speculative verify; mode 'ar' does not use it")
        draft = engine_draft(draft)
        self.target, self.draft, self.mode = target, draft, mode
        self.tokenizer = tokenizer
        self.stop_tokens = frozenset(int(t) for t in stop_tokens)
        self.seed_chain = seed_chain
        self.state_type = state_type
        self.last_stats: dict = {}
        if mode == "ar":
            self.budget, self.top_k = 0, 0
        elif mode == "chain":
            self.budget, self.top_k = min(budget, draft.block_size - 1), 1
            target.enable_verify(self.budget + 1, tree=_has_tree_ops(), state_type=state_type)
        else:
            if not _has_tree_ops():
                raise RuntimeError("ddtree mode needs the tree ops (ggml.gated_delta_net_tree_persist), which this "
                                   "build lacks; use mode='chain'")
            self.budget = budget
            self.top_k = min(top_k or min(budget, 8), budget)
            target.enable_verify(budget + 1, tree=True, state_type=state_type)
        self.prefix = None
        if prefix_snapshots:
            from .prefix_cache import PrefixCache
            self.prefix = PrefixCache(target, draft, max_snapshots=prefix_snapshots, max_bytes=prefix_bytes)

    def reset(self) -> None:
        """Forget earlier prompts: the next one is prefilled from scratch."""
        if self.prefix is not None:
            self.prefix.clear()

    def _ends(self, token: int) -> bool:
        if token in self.stop_tokens:
            return True
        return self.tokenizer is not None and self.tokenizer.is_end_of_generation(token)

    def _take(self, run: _Run, tokens: list[int], max_tokens: int) -> list[int]:
        """Append committed tokens to the output up to max_tokens or an ending token (kept); returns them."""
        taken = []
        for t in tokens:
            taken.append(t)
            run.new.append(t)
            if self._ends(t) or len(run.new) >= max_tokens:
                run.done = True
                break
        return taken

    def generate_ids(self, prompt_ids, max_tokens: int = 256, on_tokens=None,
                     sampling: SamplingParams | None = None) -> tuple[list[int], dict]:
        """Decoding after `prompt_ids` (greedy, or with `sampling`): (new token ids, stats). on_tokens(list)
        sees each batch of committed tokens as it is committed."""
        out = []
        for tokens in self.iter_generate(prompt_ids, max_tokens, sampling):
            out.extend(tokens)
            if on_tokens:
                on_tokens(tokens)
        return out, self.last_stats

    def iter_generate(self, prompt_ids, max_tokens: int = 256, sampling: SamplingParams | None = None):
        """Yield the new tokens step by step (lists; the first holds the prefill's token). The stats of the run
        are in `last_stats` once the generator is exhausted. sampling: the settings (None or temperature 0
        without penalties: greedy, today's argmax path)."""
        sampling = sampling or GREEDY
        if not isinstance(sampling, SamplingParams):
            raise TypeError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
        prompt_ids = [int(t) for t in prompt_ids]
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        if max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        need = len(prompt_ids) + max_tokens + self.budget
        if need > self.target.n_ctx:
            raise ValueError(f"prompt ({len(prompt_ids)} tokens) + {max_tokens} new tokens"
                             f"{f' + {self.budget} verify slots' if self.budget else ''} exceed the context "
                             f"({self.target.n_ctx}); raise max_ctx")
        if self.mode != "ar" and self.target.n_slots != self.budget + 1:   # another decoder re-sized the verify
            self.target.enable_verify(self.budget + 1, tree=self.mode == "ddtree" or _has_tree_ops(),
                                      state_type=self.state_type)
        sampler = None if sampling.greedy else Sampler(sampling)
        self.target.enable_sampling(sampler is not None)
        t0 = time.perf_counter()
        root, reused = prefill(self.target, self.draft, prompt_ids, self.prefix, sampler)
        t1 = time.perf_counter()
        run = _Run(context=prompt_ids + [root], sampler=sampler)
        # AR on a model that can take a queued step back, greedy or sampled without penalties: the next step runs
        # while this one's token is handled (TargetRuntime.decode_ahead)
        ahead = None
        if self.mode == "ar" and getattr(self.target, "decodes_ahead", False) and \
                (sampler is None or not sampler.params.penalised):
            ahead = self.target.decode_ahead(root, max_tokens - 1, sampler)
        t_yield = 0.0        # time spent in the consumer between steps is not decode time
        settled = True       # the cache holds run.context[:-1], once run.uncommitted is committed (false while a
                             # step is under way)
        try:
            ty = time.perf_counter()
            yield self._take(run, [root], max_tokens)
            t_yield += time.perf_counter() - ty
            while not run.done:
                settled = False
                if self.mode == "ar":
                    taken = self._ar_step(run, max_tokens, ahead)
                else:
                    taken = self._spec_step(run, max_tokens)
                settled = True       # (with `ahead`, once its queued step is taken back below)
                ty = time.perf_counter()
                yield taken
                t_yield += time.perf_counter() - ty
        finally:
            # also when the consumer stops early (generator closed at a yield) or a step raised
            if ahead is not None:
                ahead.close()        # takes the queued step back: the cache holds run.context[:-1]
            if run.proposals is not None:      # a stop before the run's end: the next step's draft forward and this
                run.proposals = None           # step's target commit behind it are queued; let them finish
                self.target.backend.synchronize()
            path, run.uncommitted = run.uncommitted, None
            if path is not None and settled:
                self.target.commit(path)     # the last step's, waited for (the prefix cache copies the states)
            if self.prefix is not None:
                if settled:
                    self.prefix.save(run.context[:-1])
                else:
                    self.prefix.forget()
            t2 = time.perf_counter()
            self.last_stats = self._stats(run, len(prompt_ids), reused, t1 - t0, t2 - t1 - t_yield)
            if sampler is not None:
                self.last_stats["sampling"] = dict(sampling.__dict__)

    def _ar_step(self, run: _Run, max_tokens: int, ahead=None) -> list[int]:
        """One token: the next of `ahead` (TargetRuntime.decode_ahead) where it runs, else one step."""
        if ahead is not None:
            token = next(ahead)
        else:
            if run.sampler is not None:
                self.target.sample_inputs = run.sampler.for_context(run.context)
            token = self.target.step(run.context[-1])
        run.context.append(token)
        run.steps += 1
        run.committed_per_step.append(1)
        return self._take(run, [token], max_tokens)

    def _spec_step(self, run: _Run, max_tokens: int) -> list[int]:
        t0 = time.perf_counter()
        take, run.proposals = run.proposals or self._queue_proposals(run), None   # (a run's first step queues its own)
        logp, ids = take()
        t1 = time.perf_counter()
        tree = make_tree(self.mode, logp, ids, self.budget, self.seed_chain)
        t2 = time.perf_counter()
        stage = getattr(self.draft, "stage_context", None)
        n_past = self.target.n_past

        def while_verifying(depths):     # queued and host work that needs the verify queued, not its tokens
            if stage is not None:
                stage(self.target, n_past, depths)
            tree.children()              # the walk's lookup
        drawn = verify_step(self.target, tree, run.context, run.sampler, while_verifying)
        t3 = time.perf_counter()
        path, new = ddtree.accept(tree, drawn)     # greedy: argmax per slot; sampling: sample-and-match
        taken = self._take(run, new, max_tokens)
        # commit no further than the output goes (max_tokens, an ending token): the cache then holds exactly the
        # prompt and the output but its last token, a state the next turn of a chat can resume from
        path, new = path[:len(taken)], taken
        t4 = time.perf_counter()
        commit_step(self.target, self.draft, path, commit_target=False)
        run.uncommitted = path
        run.context.extend(new)
        t5 = time.perf_counter()
        if not run.done:         # the next step's draft forward, and this path's target commit behind it
            run.proposals = self._queue_proposals(run)
        t6 = time.perf_counter()
        run.steps += 1
        run.committed_per_step.append(len(new))
        run.off_chain_steps += path != list(range(len(path)))
        run.draft_s += (t1 - t0) + (t6 - t5)   # queueing the next forward, and waiting for this step's
        run.verify_s += t3 - t2                # (with the draft's staging of the slots queued behind the forward)
        run.commit_s += t5 - t4                # (the draft's append queued; the target's commit is the next step's)
        run.host_s += (t2 - t1) + (t4 - t3) + (time.perf_counter() - t6)
        return taken

    def _queue_proposals(self, run: _Run) -> Callable[[], tuple[np.ndarray, np.ndarray]]:
        """The draft's proposals after run.context, queued, with the target's commit of the last path behind them."""
        path, run.uncommitted = run.uncommitted, None     # (taken first: committed once, even if the draft raises)
        then = None if path is None else functools.partial(self.target.commit, path, wait=False)
        return queue_draft_step(self.draft, run.context, self.top_k, then)

    def _stats(self, run: _Run, n_prompt: int, reused: int, prefill_s: float, decode_s: float) -> dict:
        n_decoded = len(run.new) - 1          # the first token comes out of the prefill
        hist = np.bincount(run.committed_per_step, minlength=1).tolist() if run.committed_per_step else []
        stats = {
            "mode": self.mode,
            "prompt_tokens": n_prompt,
            "reused_tokens": reused,               # prompt tokens resumed from the prefix cache
            "prefilled_tokens": n_prompt - reused,
            "new_tokens": len(run.new),
            "steps": run.steps,
            "acceptance_length": (sum(run.committed_per_step) / run.steps) if run.steps else 0.0,
            "prefill_s": prefill_s,
            "decode_s": decode_s,
            "prefill_tok_s": (n_prompt - reused) / prefill_s if prefill_s > 0 else 0.0,
            "decode_tok_s": n_decoded / decode_s if decode_s > 0 and n_decoded > 0 else 0.0,
            "committed_per_step": list(run.committed_per_step),
            "acceptance_histogram": hist,      # index = tokens committed in a step
        }
        if self.mode != "ar":
            stats.update(budget=self.budget, top_k=self.top_k, seed_chain=self.seed_chain,
                         state_type=self.state_type, off_chain_steps=run.off_chain_steps, draft_s=run.draft_s,
                         verify_s=run.verify_s, commit_s=run.commit_s, host_s=run.host_s)
        return stats


def _has_tree_ops() -> bool:
    from . import ggml
    return hasattr(ggml, "gated_delta_net_tree_persist")
