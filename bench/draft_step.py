"""Time one DFlash draft step at the 27B draft shape on one device.

    python bench/draft_step.py --device cuda [--ctx 2048] [--window 2048] [--top-k 8] [--reps 50] [--dir /tmp/dfb]

Shape: 5 draft layers, hidden 5120, 32 Q / 8 KV heads x 128, FFN 17408, block 16 (bf16 weights, ~3.5 GB), and a
248320-token LM head and embedding taken from a 27B-shaped qwen35 target GGUF with only 5 layers (Q4_K_M-like
types, written once into --dir and reused). The context cache is filled with --ctx random feature rows, then one
step (= `DFlashDraft.propose`: 5 layers over the block + the ring, LM head for 15 positions, top-K with log-probs, the
copy of K ids and log-probs) is timed: median and p10/p90 over --reps runs after warm-up. Also timed: committing
8 new context positions (the per-step append after a verify). Prints a markdown table.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

try:
    import pydflash  # noqa: F401  (the installed package)
except ImportError:      # running from a source checkout without installing
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

DRAFT_SHAPE = dict(n_layer=5, n_head=32, n_head_kv=8, head_dim=128, n_ff=17408, block_size=16, rope_theta=1e7)


def prepare(args) -> tuple[str, str]:
    from pydflash import testing
    os.makedirs(args.dir, exist_ok=True)
    tag = "tiny" if args.tiny else "27b"       # --tiny: a seconds-long smoke run of this script on a CPU
    target = os.path.join(args.dir, f"target-{tag}-5l.gguf")
    draft = os.path.join(args.dir, f"draft-{tag}")
    if not os.path.exists(target):
        print(f"writing {target} ...", file=sys.stderr)
        preset = testing.preset_tiny if args.tiny else testing.preset_27b
        testing.write_qwen35_gguf(target, preset(n_layer=5), progress=True)
    if not os.path.exists(os.path.join(draft, "model.safetensors")):
        print(f"writing {draft} ...", file=sys.stderr)
        shape = dict(DRAFT_SHAPE, n_head=4, n_head_kv=2, head_dim=64, n_ff=128) if args.tiny else DRAFT_SHAPE
        testing.write_dflash_draft(draft, target, target_layer_ids=[0, 1, 2, 3, 4], **shape)
    return target, draft


def percentile(xs, q):
    return float(np.percentile(np.asarray(xs), q))


def main(argv=None) -> int:
    from pydflash.api import DRAFT_TYPES   # load's choices; "auto" is load's own
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--ctx", type=int, default=2048, help="context positions in the draft cache")
    ap.add_argument("--window", type=int, default=2048, help="ring size W")
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--draft-type", default="stored", choices=[t for t in DRAFT_TYPES if t != "auto"],
                    help="the draft's matrices as stored (bf16) or quantized to q8_0 / q4_k at load")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--dir", default="/tmp/pydflash-draft-bench")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (checks the script, times nothing useful)")
    ap.add_argument("--prepare-only", action="store_true", help="write the model files into --dir and stop")
    args = ap.parse_args(argv)
    if args.prepare_only:
        prepare(args)
        return 0

    from pydflash.models.dflash_draft import DFlashDraft
    from pydflash.models.qwen35 import Qwen35Target

    target_path, draft_path = prepare(args)
    target = Qwen35Target(target_path, args.device, n_ctx=256, n_ubatch=16, progress=True)
    t0 = time.perf_counter()
    draft = DFlashDraft(draft_path, target, window=args.window, top_k=args.top_k,
                        weight_type=None if args.draft_type == "stored" else args.draft_type)
    load_s = time.perf_counter() - t0
    hp = draft.hp
    rng = np.random.default_rng(0)
    features = rng.standard_normal((args.ctx, hp.n_feat, hp.n_embd), dtype=np.float32)
    draft.append_features(features)
    backend = draft.backend

    step_ms = []
    for i in range(args.warmup + args.reps):
        backend.synchronize()
        t = time.perf_counter()
        draft.propose((1000 + i) % target.hp.n_vocab)   # returns after the top-K ids/log-probs are on the host
        dt = (time.perf_counter() - t) * 1e3
        if i >= args.warmup:
            step_ms.append(dt)

    # per-step commit of 8 positions (host features here; after a verify they come from the target's buffer)
    commit = rng.standard_normal((8, hp.n_feat, hp.n_embd), dtype=np.float32)
    commit_ms = []
    for i in range(args.warmup + args.reps):
        backend.synchronize()
        t = time.perf_counter()
        draft.append_features(commit)
        backend.synchronize()
        dt = (time.perf_counter() - t) * 1e3
        if i >= args.warmup:
            commit_ms.append(dt)

    weight_bytes = draft.weights.buffer.nbytes
    print(f"device: {backend.name}; draft load {load_s:.1f} s; draft weights {weight_bytes / 2**30:.2f} GiB "
          f"({draft.weights['layers.0.mlp.up_proj.weight'].type.name}); ring {args.window} positions, "
          f"{draft.cache.buffer.nbytes / 2**20:.0f} MiB")
    print()
    print("| what | ctx | median ms | p10 | p90 |")
    print("|---|---|---|---|---|")
    print(f"| draft step (5 layers, block 16, top-{args.top_k}) | {args.ctx} | {statistics.median(step_ms):.3f} | "
          f"{percentile(step_ms, 10):.3f} | {percentile(step_ms, 90):.3f} |")
    print(f"| commit 8 context positions (fc + K/V of 5 layers) | - | {statistics.median(commit_ms):.3f} | "
          f"{percentile(commit_ms, 10):.3f} | {percentile(commit_ms, 90):.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
