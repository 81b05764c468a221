"""Long context on one card: decode and DDTree step time by depth and KV type, prefill speed by prompt length,
and the peak device memory of a long-context load against its memory plan.

    python bench/long_context.py depth   TARGET.gguf --draft DRAFT --device cuda --kv tq3_0 \
        --depths 2048,8192,32768,131072,262144 [--llama-bench PATH]
    python bench/long_context.py prefill TARGET.gguf --device cuda --lengths 2048,8192,32768 [--llama-bench PATH]
    python bench/long_context.py memory  TARGET.gguf --draft DRAFT --device cuda --ctx 262144 --kv tq3_0 \
        [--state-type replay|f16] [--draft-type q8_0|q4_k]

depth: one target allocated for the deepest depth, then at each depth the cache's fill is set to that depth
(rows past a short real prompt stay zero: attention time depends on the attended length, not the values) and
AR steps and DDTree steps (budget 22, draft ring filled to its window) are timed. With --llama-bench, llama.cpp's
`-n 128 -d DEPTH` on the same file and KV type (it has no TQ3_0) for comparison; its depth is a real prefill.
prefill: real prompts of each length, prefill tok/s with the micro-batch chosen by length (n_ubatch 2048) and a
fixed 512 one (--no-fixed: only the chosen one), beside llama-bench -p.
memory: loads target + draft for --ctx positions, then runs a prefill micro-batch and DDTree steps at the end of
the context (the largest compute buffers) and reports the device's used memory (free-memory query) after each,
beside the plan (pydflash.plan) for the same configuration. Prints markdown.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

try:
    import pydflash  # noqa: F401  (the installed package)
except ImportError:      # running from a source checkout without installing
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

GiB = 1 << 30
PROMPT = 64             # real tokens before the depth is set


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def some_tokens(target, n: int) -> list[int]:
    return [1 + i % (target.hp.n_vocab - 1) for i in range(n)]


def load_pair(args, n_ctx: int, n_ubatch: int = 512, state_type: str = "f32", draft_type: str | None = None):
    from pydflash.api import _load_draft, draft_layer_ids
    from pydflash.engine import Decoder
    from pydflash.models import load_target

    capture = draft_layer_ids(args.draft) if args.draft else ()
    target = load_target(args.target, args.device, n_ctx=n_ctx, kv_type=args.kv, n_ubatch=n_ubatch,
                         capture_layers=capture, progress=True)
    decoder = None
    if args.draft:
        draft = _load_draft(args.draft, target, top_k=8, weight_type=draft_type)
        decoder = Decoder(target, draft, mode="ddtree", budget=args.budget, state_type=state_type)
    return target, decoder


def set_depth(target, decoder, depth: int) -> None:
    """Pretend `depth` positions are filled: the target's fill, and the draft's ring holding the last window."""
    target.cache.n_past = depth
    if decoder is not None:
        ring = decoder.draft.draft.cache
        n = min(depth, ring.window)
        pos = np.arange(depth - n, depth)
        ring.slot_pos[:] = -1
        ring.slot_pos[pos % ring.window] = pos
        ring.n_ctx = depth


def time_ar(target, depth: int, n: int) -> float:
    """ms per AR step starting at `depth`."""
    set_depth(target, None, depth)
    token = target.step(1)                 # warm-up: this depth's graph
    set_depth(target, None, depth)
    target.backend.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        token = target.step(token)
    return 1e3 * (time.perf_counter() - t) / n


def time_ddtree(decoder, depth: int, n: int) -> dict:
    """Per DDTree step at `depth`: ms of draft, verify, commit, host (a random draft accepts ~1 token a step)."""
    from pydflash.engine import _Run
    target = decoder.target
    for warm in (True, False):
        set_depth(target, decoder, depth)
        run = _Run(context=list(range(1, PROMPT + 2)))
        for _ in range(3 if warm else n):
            decoder._spec_step(run, 1 << 30)
    return {k: 1e3 * getattr(run, k) / run.steps for k in ("draft_s", "verify_s", "commit_s", "host_s")}


def llama_bench(path, args, extra: list[str]) -> list[dict]:
    cmd = [path, "-m", args.target, "-fa", "1", "-ngl", "99", "-o", "json", "-r", str(args.llama_reps)] + extra
    print(f"running `{' '.join(cmd)}`", file=sys.stderr)
    return json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)


def cmd_depth(args) -> int:
    depths = _ints(args.depths)
    target, decoder = load_pair(args, max(depths) + 512, state_type=args.state_type)
    target.reset()
    target.prefill(some_tokens(target, PROMPT), return_logits=False)
    if decoder is not None:
        decoder.draft.reset()
    rows = []
    for d in depths:
        ar = time_ar(target, d, args.n_gen)
        step = time_ddtree(decoder, d, args.n_steps) if decoder is not None else None
        rows.append((d, ar, step))
        print(f"depth {d}: AR {ar:.2f} ms" + (f", ddtree step {sum(step.values()):.2f} ms" if step else ""),
              file=sys.stderr)
    ref = {}
    if args.llama_bench and args.kv != "tq3_0":
        for r in llama_bench(args.llama_bench, args, ["-p", "0", "-n", str(args.n_gen), "-d", args.depths,
                                                       "-ctk", args.kv, "-ctv", args.kv]):
            ref[int(r["n_depth"])] = r["avg_ts"]
    name = os.path.basename(args.target)
    print(f"\n### Depth sweep on {name}, {target.backend.name}, kv {args.kv}, n_ctx {target.n_ctx} allocated, "
          f"{args.state_type} verify states\n")
    print("| depth | AR ms/token | AR tok/s | llama.cpp tg tok/s | ratio | DDTree step ms (draft / verify / commit / "
          "host) |\n|---|---|---|---|---|---|")
    for d, ar, step in rows:
        llama = ref.get(d)
        split = (f"{sum(step.values()):.2f} ({step['draft_s']:.2f} / {step['verify_s']:.2f} / "
                 f"{step['commit_s']:.2f} / {step['host_s']:.2f})") if step else "-"
        print(f"| {d} | {ar:.2f} | {1e3 / ar:.1f} | {f'{llama:.1f}' if llama else '-'} | "
              f"{f'{1e3 / ar / llama:.3f}' if llama else '-'} | {split} |")
    return 0


def cmd_prefill(args) -> int:
    from pydflash.models import load_target
    lengths = _ints(args.lengths)
    target = load_target(args.target, args.device, n_ctx=max(lengths) + 256, kv_type=args.kv, n_ubatch=2048,
                         progress=True)
    rng = np.random.default_rng(0)
    rows = []
    for n in lengths:
        prompt = [int(t) for t in rng.integers(1, min(target.hp.n_vocab, 30000), n)]
        rates = {}
        for label, ubatch in (("auto", None),) + ((("512", 512),) if args.fixed else ()):
            best = 0.0
            for _ in range(args.reps + 1):                 # the first run builds the graphs
                target.reset()
                target.backend.synchronize()
                t = time.perf_counter()
                target.prefill(prompt, return_logits=False, ubatch=ubatch)
                target.backend.synchronize()
                best = max(best, n / (time.perf_counter() - t))
            rates[label] = best
        rows.append((n, rates))
        print(f"prefill {n}: {rates}", file=sys.stderr)
    ref = {}
    if args.llama_bench:
        for r in llama_bench(args.llama_bench, args, ["-p", args.lengths, "-n", "0", "-ctk", args.kv, "-ctv", args.kv]):
            ref[int(r["n_prompt"])] = r["avg_ts"]
    from pydflash.models.runtime import prefill_ubatch
    print(f"\n### Prefill on {os.path.basename(args.target)}, {target.backend.name}, kv {args.kv} (best of "
          f"{args.reps})\n")
    print("| prompt | micro-batch (auto) | tok/s auto | tok/s fixed 512 | llama.cpp pp tok/s | auto / llama.cpp |")
    print("|---|---|---|---|---|---|")
    for n, rates in rows:
        llama = ref.get(n)
        versus = f"{rates['auto'] / llama:.3f}" if llama else "-"
        fixed = f"{rates['512']:.0f}" if "512" in rates else "-"
        print(f"| {n} | {prefill_ubatch(n, 2048)} | {rates['auto']:.0f} | {fixed} | "
              f"{f'{llama:.0f}' if llama else '-'} | {versus} |")
    return 0


def cmd_memory(args) -> int:
    from pydflash import ggml, plan
    backend = ggml.Backend(args.device)
    free0, total = backend.memory()
    args.device = backend                          # load on this backend (one CUDA context)
    state_type = "f16" if args.f16_states else args.state_type
    draft_type = None if args.draft_type == "stored" else args.draft_type
    target, decoder = load_pair(args, args.ctx, n_ubatch=args.ubatch, state_type=state_type, draft_type=draft_type)
    used = {"after load": free0 - backend.memory()[0]}
    target.reset()
    target.prefill(some_tokens(target, PROMPT), return_logits=False)
    # the largest prefill micro-batch at the end of the context: its mask spans every cell
    set_depth(target, None, args.ctx - args.ubatch)
    target.prefill(some_tokens(target, args.ubatch), return_logits=False, ubatch=args.ubatch)
    used["after a prefill micro-batch at the end"] = free0 - backend.memory()[0]
    if decoder is not None:
        time_ddtree(decoder, args.ctx - 8 * (args.budget + 1), 2)   # 5 steps of at most budget + 1 tokens
        used["after DDTree steps at the end"] = free0 - backend.memory()[0]
    want = plan.plan_for_files(args.target, args.draft, max_ctx=args.ctx, kv_type=args.kv, budget=args.budget,
                               n_ubatch=args.ubatch, state_type=state_type, draft_type=draft_type)
    print(f"\n### Device memory, {os.path.basename(args.target)}"
          f"{' + ' + os.path.basename(args.draft.rstrip('/')) if args.draft else ''}, {backend.name} "
          f"({total / GiB:.1f} GiB, {free0 / GiB:.2f} GiB free before loading)\n")
    print(f"context {args.ctx}, kv {args.kv}, {state_type} verify states, draft matrices {args.draft_type}, "
          f"prefill micro-batch {args.ubatch}\n")
    print("| measured (device free-memory query) | GiB |\n|---|---|")
    for k, v in used.items():
        print(f"| used {k} | {v / GiB:.2f} |")
    print(f"| peak | {max(used.values()) / GiB:.2f} |")
    print(f"\nplan (its reserve of {plan.RESERVE / GiB:.2f} GiB included in the total):\n\n```\n{want.table()}\n```")
    peak = max(used.values())
    print(f"\npeak measured {peak / GiB:.2f} GiB vs planned {want.total / GiB:.2f} GiB; a 24 GiB card: "
          f"{'fits' if peak <= 24 * GiB else 'does NOT fit'}; the goal <= 24 GB (22.35 GiB): "
          f"{'met' if peak <= 24e9 else 'NOT met'}")
    return 0


def main(argv=None) -> int:
    from pydflash.api import DRAFT_TYPES, STATE_TYPES   # load's choices; "auto" is load's own
    state_types, draft_types = [t for t in STATE_TYPES if t != "auto"], [t for t in DRAFT_TYPES if t != "auto"]
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="what", required=True)
    for name, fn in (("depth", cmd_depth), ("prefill", cmd_prefill), ("memory", cmd_memory)):
        s = sub.add_parser(name)
        s.add_argument("target")
        s.add_argument("--draft", help="DFlash draft directory (depth, memory)")
        s.add_argument("--device", default="auto")
        s.add_argument("--kv", default="f16", choices=["f16", "q8_0", "q4_0", "tq3_0"])
        s.add_argument("--budget", type=int, default=22)
        s.add_argument("--llama-bench", help="llama-bench built on the same ggml (depth, prefill)")
        s.add_argument("--llama-reps", type=int, default=1)
        s.set_defaults(func=fn)
        if name == "depth":
            s.add_argument("--depths", default="2048,8192,32768,131072")
            s.add_argument("--state-type", default="f32", choices=state_types,
                           help="the verify's node states (default f32)")
            s.add_argument("--n-gen", type=int, default=64, help="AR steps timed per depth")
            s.add_argument("--n-steps", type=int, default=16, help="DDTree steps timed per depth")
        if name == "prefill":
            s.add_argument("--lengths", default="2048,8192,32768")
            s.add_argument("--reps", type=int, default=2)
            s.add_argument("--no-fixed", dest="fixed", action="store_false",
                           help="time only the micro-batch chosen by length, not also a fixed 512")
        if name == "memory":
            s.add_argument("--ctx", type=int, default=262144)
            s.add_argument("--ubatch", type=int, default=512)
            s.add_argument("--state-type", default="f32", choices=state_types,
                           help="the verify's node states (TargetRuntime.enable_verify; default f32)")
            s.add_argument("--f16-states", action="store_true", help="the same as --state-type f16")
            s.add_argument("--draft-type", default="stored", choices=draft_types,
                           help="the draft's matrices: as stored (default) or quantized to q8_0 / q4_k at load")
    args = p.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
