"""`pydflash bench`: AR against speculative decoding on the benchmark prompt sets, per prompt and per dataset.

Each prompt is decoded twice on the same loaded target: plain AR (greedy) and the engine's speculative mode
(chain or ddtree with its draft). Decode tok/s excludes the prefill, which is reported on its own; acceptance
length is tokens committed per verify step. Every speculative output is compared with AR's token for token
(on the CPU they must be identical; on CUDA a batched verify rounds differently from a single-token decode,
see docs/benchmarks.md, so the count of differing outputs is reported rather than asserted, with AR's top-2
logit gap at each output's first difference: "11/20 (gap <= 0.05)" says the outputs that part from AR do so at
near-ties).

Prompt format: `auto` feeds HumanEval prompts raw (code completion, as they are written) and wraps the math
questions in the chat template as a user turn; `chat` and `raw` force one format for all.
llama.cpp peers (`--llama-bin DIR`, pydflash/llama_peers.py): llama.cpp's greedy AR (llama-simple) and, with
`--llama-draft GGUF`, its classic draft-model speculative decoding (llama-speculative-simple) decode the same
prompt tokens for n_gen tokens; their tok/s, acceptance rate and whether llama.cpp's AR text equals pydflash's
AR text are added per prompt and per dataset.
Outputs: a markdown table (stdout and bench.md), bench.json (settings, per-prompt and per-dataset numbers) and,
when matplotlib is installed (`pip install pydflash[plot]`), bench.png: decode tok/s per dataset (pydflash AR and
speculative, and the llama.cpp peers when run) and the acceptance-length histogram.
"""
from __future__ import annotations

import json
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass

import numpy as np

from .datasets import BENCHMARKS, load_prompts

FORMATS = ("auto", "chat", "raw")


@dataclass
class PromptRun:
    dataset: str
    id: str
    chat: bool
    prompt_tokens: int
    ar_tokens: int             # new tokens of each run (equal whenever the outputs are)
    spec_tokens: int
    ar_decode_s: float
    ar_prefill_s: float
    spec_decode_s: float
    spec_steps: int
    spec_committed: int
    identical: bool
    histogram: list            # index = tokens committed in one step
    # where a speculative output first leaves AR's (None when identical), and AR's top-2 logit gap there: a
    # small gap is a near-tie that CUDA's batched verify may resolve the other way (docs/benchmarks.md)
    first_diff: int | None = None
    first_diff_gap: float | None = None
    # llama.cpp peers (None when not run): tokens and seconds as their own timers count them
    llama_ar_decoded: int | None = None
    llama_ar_s: float | None = None
    llama_ar_equal: bool | None = None       # llama.cpp's AR text == pydflash's AR text
    llama_spec_decoded: int | None = None
    llama_spec_s: float | None = None
    llama_drafted: int | None = None
    llama_accepted: int | None = None
    llama_spec_equal: bool | None = None     # llama.cpp's speculative text starts with pydflash's AR text

    @property
    def ar_tok_s(self) -> float:       # the first new token comes out of the prefill, not the decode
        return (self.ar_tokens - 1) / self.ar_decode_s if self.ar_decode_s > 0 else 0.0

    @property
    def spec_tok_s(self) -> float:
        return (self.spec_tokens - 1) / self.spec_decode_s if self.spec_decode_s > 0 else 0.0

    @property
    def llama_ar_tok_s(self) -> float | None:
        return None if self.llama_ar_s is None else _rate(self.llama_ar_decoded, self.llama_ar_s)

    @property
    def llama_spec_tok_s(self) -> float | None:
        return None if self.llama_spec_s is None else _rate(self.llama_spec_decoded, self.llama_spec_s)

    def add_peers(self, result: dict, ar_text: bytes) -> None:
        """Record llama_peers.LlamaPeers.run's result; ar_text: pydflash's AR output as the peers print it."""
        ar, spec = result["ar"], result["spec"]
        self.llama_ar_decoded, self.llama_ar_s, self.llama_ar_equal = ar.decoded, ar.decode_s, ar.text == ar_text
        if spec is not None:
            self.llama_spec_decoded, self.llama_spec_s = spec.decoded, spec.decode_s
            self.llama_drafted, self.llama_accepted = spec.drafted, spec.accepted
            self.llama_spec_equal = spec.text.startswith(ar_text)    # its last step may pass n_gen


def first_difference(target, prompt_ids, ar_tokens, spec_tokens) -> tuple[int, float] | None:
    """(index, AR's top-2 logit gap there) of the first token where `spec_tokens` leaves `ar_tokens`, from one
    teacher-forced forward over the prompt and AR's tokens before it; None when the outputs are equal. Leaves the
    target reset (the next generation prefills from scratch)."""
    n = min(len(ar_tokens), len(spec_tokens))
    first = next((i for i in range(n) if ar_tokens[i] != spec_tokens[i]), n)
    if first == len(ar_tokens) == len(spec_tokens):
        return None
    target.reset()
    logits = target.prefill(list(prompt_ids) + list(ar_tokens[:first]))
    top2 = np.sort(logits)[-2:]
    target.reset()
    return first, float(top2[1] - top2[0])


def _rate(n, seconds) -> float:
    return n / seconds if seconds > 0 else 0.0


def _peer_summary(runs: list[PromptRun]) -> dict:
    """The llama.cpp columns of a dataset (empty when no peer ran): totals over totals, like pydflash's."""
    out = {}
    ar = [r for r in runs if r.llama_ar_s is not None]
    if ar:
        out["llama_ar_tok_s"] = _rate(sum(r.llama_ar_decoded for r in ar), sum(r.llama_ar_s for r in ar))
        out["llama_ar_equal_outputs"] = sum(bool(r.llama_ar_equal) for r in ar)
    spec = [r for r in runs if r.llama_spec_s is not None]
    if spec:
        out["llama_spec_tok_s"] = _rate(sum(r.llama_spec_decoded for r in spec), sum(r.llama_spec_s for r in spec))
        drafted = sum(r.llama_drafted for r in spec)
        out["llama_accept_rate"] = sum(r.llama_accepted for r in spec) / drafted if drafted else 0.0
        out["llama_spec_equal_outputs"] = sum(bool(r.llama_spec_equal) for r in spec)
    return out


def summarize(runs: list[PromptRun]) -> dict:
    """Per-dataset totals: tok/s as total decoded tokens over total decode time, acceptance length as total
    committed over total steps (so long outputs weigh by their length, not by one vote per prompt)."""
    ar_decoded = sum(r.ar_tokens - 1 for r in runs)
    spec_decoded = sum(r.spec_tokens - 1 for r in runs)
    ar_s = sum(r.ar_decode_s for r in runs)
    spec_s = sum(r.spec_decode_s for r in runs)
    steps = sum(r.spec_steps for r in runs)
    hist = np.zeros(max((len(r.histogram) for r in runs), default=1), np.int64)
    for r in runs:
        hist[:len(r.histogram)] += r.histogram
    ar_tok_s = ar_decoded / ar_s if ar_s > 0 else 0.0
    spec_tok_s = spec_decoded / spec_s if spec_s > 0 else 0.0
    prompt_tokens = sum(r.prompt_tokens for r in runs)
    prefill_s = sum(r.ar_prefill_s for r in runs)
    return {
        "prompts": len(runs),
        "decoded_tokens": ar_decoded,
        "ar_tok_s": ar_tok_s,
        "spec_tok_s": spec_tok_s,
        "speedup": spec_tok_s / ar_tok_s if ar_tok_s > 0 else 0.0,
        "acceptance_length": sum(r.spec_committed for r in runs) / steps if steps else 0.0,
        "prefill_tok_s": prompt_tokens / prefill_s if prefill_s > 0 else 0.0,
        "identical_outputs": sum(r.identical for r in runs),
        # the largest AR top-2 gap at which an output left AR's (None: all identical)
        "max_first_diff_gap": max((r.first_diff_gap for r in runs if r.first_diff_gap is not None), default=None),
        "acceptance_histogram": hist.tolist(),
        **_peer_summary(runs),
    }


def run_bench(engine, datasets=BENCHMARKS, *, n_prompts: int = 20, n_gen: int = 256, seed: int = 0,
              prompt_format: str = "auto", max_prompt_tokens: int | None = None, progress: bool = True,
              peers=None) -> tuple[list[PromptRun], dict]:
    """Decode `n_prompts` of each dataset with AR and with `engine` (a speculative pydflash Engine), and with
    the llama.cpp `peers` (a llama_peers.LlamaPeers on the same target file) when given.

    Returns the per-prompt runs and {dataset: summary}. Prompts whose tokens (plus n_gen and the verify
    slots) would not fit the engine's context are skipped with a note, never truncated silently."""
    from tqdm import tqdm

    from .api import Engine
    from .engine import Decoder
    from .llama_peers import generated_bytes

    if engine.mode == "ar":
        raise ValueError("pydflash bench compares AR with a speculative mode: load the engine with a draft")
    if prompt_format not in FORMATS:
        raise ValueError(f"prompt format {prompt_format!r}: expected one of {FORMATS}")
    if engine.tokenizer is None:
        raise ValueError("pydflash bench needs the target's tokenizer (load with tokenizer=True)")
    ar = Engine(Decoder(engine.target, None, mode="ar", tokenizer=engine.tokenizer), engine.tokenizer)
    room = engine.target.n_ctx - n_gen - engine.decoder.budget
    limit = room if max_prompt_tokens is None else min(room, max_prompt_tokens)
    runs: list[PromptRun] = []
    for name in datasets:
        prompts = load_prompts(name, n_prompts, seed=seed)
        bar = tqdm(prompts, desc=f"bench {name}", unit="prompt", disable=not progress, file=sys.stderr)
        for p in bar:
            chat = p.chat if prompt_format == "auto" else prompt_format == "chat"
            ids = engine.prompt_ids(p.text, chat=chat)
            n_prompt = len(ids)
            if n_prompt > limit:
                bar.write(f"skipped {p.id}: {n_prompt} prompt tokens > {limit} that fit the context")
                continue
            ref = ar.generate(ids, max_tokens=n_gen)
            out = engine.generate(ids, max_tokens=n_gen)
            s = out.stats
            runs.append(PromptRun(
                dataset=name, id=p.id, chat=chat, prompt_tokens=n_prompt, ar_tokens=len(ref.tokens),
                spec_tokens=len(out.tokens),
                ar_decode_s=ref.stats["decode_s"], ar_prefill_s=ref.stats["prefill_s"],
                spec_decode_s=s["decode_s"], spec_steps=s["steps"], spec_committed=sum(s["committed_per_step"]),
                identical=out.tokens == ref.tokens, histogram=list(s["acceptance_histogram"])))
            diff = first_difference(engine.target, ids, ref.tokens, out.tokens)
            if diff is not None:
                runs[-1].first_diff, runs[-1].first_diff_gap = diff
                engine.decoder.reset()      # the target's cache moved under the engine's prefix snapshots
            if peers is not None:
                result = peers.run(engine.tokenizer, p.text, chat, ids, n_gen)
                runs[-1].add_peers(result, generated_bytes(engine.tokenizer, ref.tokens))
    summary = {name: summarize([r for r in runs if r.dataset == name]) for name in datasets}
    return runs, summary


# llama.cpp columns: (summary key, header, format); a column shows when any dataset has its key
PEER_COLUMNS = (("llama_ar_tok_s", "llama.cpp AR tok/s", "{:.1f}"),
                ("llama_spec_tok_s", "llama.cpp speculative tok/s", "{:.1f}"),
                ("llama_accept_rate", "llama.cpp acceptance rate", "{:.1%}"))


def markdown(summary: dict, settings: dict) -> str:
    peers = [c for c in PEER_COLUMNS if any(c[0] in s for s in summary.values())]
    equal = any("llama_ar_equal_outputs" in s for s in summary.values())
    head = (["dataset", "prompts", "AR tok/s", "speculative tok/s", "speed-up", "acceptance length",
             "prefill tok/s", "outputs equal to AR"] + [c[1] for c in peers] +
            (["llama.cpp AR text equal"] if equal else []))
    peer_note = ""
    if "llama" in settings:
        lc = settings["llama"]
        peer_note = (f" llama.cpp peers: {lc['ar']} (AR)" + (f", {lc['spec']} with draft `{lc['draft']}`, drafts "
                     f"of up to {lc['draft_max']} tokens" if lc.get("draft") else "") + ", greedy.")
    lines = [f"Target `{settings['target']}`, draft `{settings['draft']}`, mode {settings['mode']} (budget "
             f"{settings['budget']}), device {settings['device']}, n_gen {settings['n_gen']}, prompt format "
             f"{settings['prompt_format']}, seed {settings['seed']}.{peer_note}", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, s in summary.items():
        cells = [name, str(s["prompts"]), f"{s['ar_tok_s']:.1f}", f"{s['spec_tok_s']:.1f}", f"{s['speedup']:.2f}x",
                 f"{s['acceptance_length']:.2f}", f"{s['prefill_tok_s']:.1f}",
                 f"{s['identical_outputs']}/{s['prompts']}" + (f" (gap <= {s['max_first_diff_gap']:.3g})"
                                                               if s.get("max_first_diff_gap") is not None else "")]
        cells += [fmt.format(s[key]) if key in s else "-" for key, _, fmt in peers]
        if equal:
            cells.append(f"{s['llama_ar_equal_outputs']}/{s['prompts']}" if "llama_ar_equal_outputs" in s else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(summary: dict, path: str) -> bool:
    """Speed-up per dataset and the acceptance-length histogram as a PNG; False when matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    names = list(summary)
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    bars = [("ar_tok_s", "pydflash AR"), ("spec_tok_s", "pydflash speculative"), ("llama_ar_tok_s", "llama.cpp AR"),
            ("llama_spec_tok_s", "llama.cpp speculative")]
    bars = [(k, label) for k, label in bars if any(k in summary[n] for n in names)]
    x, width = np.arange(len(names)), 0.8 / len(bars)
    for i, (key, label) in enumerate(bars):          # decode tok/s side by side per dataset
        left.bar(x + (i - (len(bars) - 1) / 2) * width, [summary[n].get(key, 0.0) for n in names], width,
                 label=label)
    left.set_xticks(x, names)
    left.set_ylabel("decode tok/s")
    left.set_title("decode speed (speed-up over pydflash AR: " +
                   ", ".join(f"{summary[n]['speedup']:.2f}x" for n in names) + ")", fontsize=9)
    left.legend(fontsize=8)
    for i, n in enumerate(names):
        hist = np.asarray(summary[n]["acceptance_histogram"], np.float64)
        if hist.sum() > 0:
            right.plot(np.arange(hist.size), hist / hist.sum(), marker="o", label=f"{n} (AL "
                       f"{summary[n]['acceptance_length']:.2f})")
    right.set_xlabel("tokens committed per step")
    right.set_ylabel("fraction of steps")
    right.set_title("acceptance length histogram")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def write_report(out_dir: str, runs: list[PromptRun], summary: dict, settings: dict) -> dict:
    """bench.md, bench.json and (with matplotlib) bench.png under out_dir; returns {kind: path}."""
    os.makedirs(out_dir, exist_ok=True)
    paths = {"md": os.path.join(out_dir, "bench.md"), "json": os.path.join(out_dir, "bench.json")}
    with open(paths["md"], "w", encoding="utf-8") as f:
        f.write(markdown(summary, settings))
    record = {"settings": settings, "datasets": summary,
              "prompts": [dict(asdict(r), ar_tok_s=r.ar_tok_s, spec_tok_s=r.spec_tok_s, llama_ar_tok_s=r.llama_ar_tok_s,
                               llama_spec_tok_s=r.llama_spec_tok_s) for r in runs]}
    with open(paths["json"], "w", encoding="utf-8") as f:
        json.dump(record, f, indent=1)
    png = os.path.join(out_dir, "bench.png")
    if plot(summary, png):
        paths["png"] = png
    return paths


def merge_reports(dirs, out_dir: str) -> dict:
    """Join the bench.json of separate runs (one dataset each, same settings otherwise) into one report under
    out_dir; returns write_report's paths."""
    from dataclasses import fields

    names = {f.name for f in fields(PromptRun)}
    runs, settings = [], None
    for d in dirs:
        with open(os.path.join(d, "bench.json"), encoding="utf-8") as f:
            record = json.load(f)
        settings = settings or record["settings"]
        runs += [PromptRun(**{k: v for k, v in p.items() if k in names}) for p in record["prompts"]]
    if settings is None:
        raise ValueError("merge_reports: no report folder given")
    order = list(dict.fromkeys(r.dataset for r in runs))
    summary = {name: summarize([r for r in runs if r.dataset == name]) for name in order}
    return write_report(out_dir, runs, summary, settings)


def settings_of(engine, *, target: str, draft: str, device: str, n_gen: int, seed: int, prompt_format: str,
                peers=None) -> dict:
    settings = {"target": os.path.basename(str(target)), "draft": os.path.basename(str(draft).rstrip("/")),
            "mode": engine.mode, "budget": engine.decoder.budget, "device": device, "n_gen": n_gen, "seed": seed,
            "prompt_format": prompt_format, "host": platform.node(), "python": platform.python_version(),
            "date": time.strftime("%Y-%m-%d")}
    if peers is not None:
        from .llama_peers import AR_PROGRAM, SPEC_PROGRAM
        settings["llama"] = {"bin": peers.bin_dir, "ar": AR_PROGRAM, "spec": SPEC_PROGRAM if peers.draft else None,
                             "draft": os.path.basename(peers.draft) if peers.draft else None,
                             "draft_max": peers.draft_max}
    return settings
