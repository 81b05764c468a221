"""Command line: `pydflash info` (build and device check), `pydflash run` (generate), `pydflash chat` (a terminal
chat), `pydflash plan` (the memory plan, no GPU needed), `pydflash demo` (synthetic models, nothing to download),
`pydflash serve` (the OpenAI/Anthropic-compatible server, pydflash.server), `pydflash bench` and
`pydflash train-draft`. `add_model_options` holds the model flags with their llama.cpp aliases, for every command
that loads a model."""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np


def cmd_info(args: argparse.Namespace) -> int:
    """Print what this build is and prove it computes: a graph through an upstream op and one of ours."""
    from . import __version__, ggml
    from .ggml import _ffi

    print(f"pydflash {__version__}")
    print(f"ggml libraries: {_ffi.LIB_DIR} (ggml_ext ABI {_ffi.lib.ggml_ext_abi_version()})")
    for dev in ggml.devices():
        print(f"device {dev['name']:8s} {dev['kind']:5s} {dev['memory_total'] / 2**30:7.1f} GiB  {dev['description']}")
    backend = ggml.Backend(args.device)
    rng = np.random.default_rng(0)
    sx = rng.standard_normal((1, 128, 3 + 8)).astype(np.float32)
    c = rng.standard_normal((128, 4)).astype(np.float32)
    ctx = ggml.Context(n_tensors=8, graph_size=8)
    t_sx = ctx.new_tensor(np.float32, sx.shape[::-1]).mark_input()
    t_c = ctx.new_tensor(np.float32, c.shape[::-1]).mark_input()
    t_p = ctx.new_tensor(np.int32, (8, 1)).mark_input()
    # a chain tree must reproduce the upstream op exactly
    diff = ctx.sub(ggml.ssm_conv_tree(ctx, t_sx, t_c, t_p), ctx.ssm_conv(t_sx, t_c))
    graph = ctx.graph(diff)
    ggml.Allocator(backend).allocate(graph)
    t_sx.set(sx)
    t_c.set(c)
    t_p.set(np.arange(8, dtype=np.int32) - 1)
    start = time.perf_counter()
    backend.compute(graph)
    elapsed = time.perf_counter() - start
    max_diff = float(np.abs(graph.outputs[0].numpy()).max())
    ok = max_diff == 0.0
    print(f"self-check on {backend.name}: ssm_conv_tree(chain) - ssm_conv = {max_diff} "
          f"({elapsed * 1e3:.2f} ms) {'OK' if ok else 'FAILED'}")
    return 0 if ok else 1


def _print_stats(stats: dict) -> None:
    line = (f"mode {stats['mode']}: {stats['new_tokens']} tokens in {stats['steps']} steps, "
            f"acceptance length {stats['acceptance_length']:.2f}, prefill {stats['prefill_tok_s']:.1f} tok/s, "
            f"decode {stats['decode_tok_s']:.1f} tok/s")
    if "verify_s" in stats and stats["steps"]:
        ms = {k: 1e3 * stats[k] / stats["steps"] for k in ("draft_s", "verify_s", "commit_s", "host_s")}
        line += (f" | per step: draft {ms['draft_s']:.2f} ms, verify {ms['verify_s']:.2f} ms, "
                 f"commit {ms['commit_s']:.2f} ms, host {ms['host_s']:.2f} ms")
    print(line, file=sys.stderr)


class UsageError(ValueError):
    """A command-line argument is wrong (exit status 2, like argparse's own errors)."""


def _check_run_args(args: argparse.Namespace) -> None:
    """The cheap checks, before any model is loaded: numbers in range, files present, the device known."""
    from .api import MAX_BUDGET, MAX_CTX, MAX_TOKENS
    from .ggml.core import _find_device

    max_ctx = _ctx_arg(args.max_ctx)
    for flag, value, hi in (("--n-gen", args.n_gen, MAX_TOKENS), ("--budget", args.budget, MAX_BUDGET),
                            ("--max-ctx", None if max_ctx == "auto" else max_ctx, MAX_CTX)):
        if value is not None and not 1 <= value <= hi:
            raise UsageError(f"{flag} {value}: expected 1..{hi}")
    if not os.path.isfile(args.target):
        raise UsageError(f"--target {args.target}: no such file")
    if args.draft is not None and not os.path.exists(args.draft):
        raise UsageError(f"--draft {args.draft}: no such folder or file")
    if args.mode in ("chain", "ddtree") and args.draft is None:
        raise UsageError(f"--mode {args.mode} needs --draft")
    try:
        _find_device(args.device)
    except ValueError as e:
        raise UsageError(f"--device: {e}") from None



def add_model_options(parser: argparse.ArgumentParser, *, target_required: bool = True) -> None:
    """The model-loading options of `run` and `chat` (and `serve`), each with its llama.cpp spelling as an alias
    so that llama-cli / llama-server muscle memory works: -m, -md, -c, -ctk, --draft-max, -ngl."""
    parser.add_argument("--target", "-m", "--model", dest="target", required=target_required,
                        help="target GGUF (e.g. Qwen3.5-27B-Q4_K_M.gguf)")
    parser.add_argument("--draft", "-md", "--model-draft", dest="draft",
                        help="DFlash draft directory (config.json + model.safetensors)")
    parser.add_argument("--mode", choices=["ar", "chain", "ddtree"], help="default: ddtree with a draft, else ar")
    parser.add_argument("--budget", "--draft-max", dest="budget", type=int, default=22,
                        help="tree nodes (ddtree) or chain length (chain) per step (default 22)")
    parser.add_argument("--kv", "-ctk", "--cache-type-k", dest="kv", default="auto",
                        choices=["auto", "f16", "q8_0", "q4_0", "tq3_0"],
                        help="KV cache type (default auto: f16 while the context fits, then q8_0, q4_0, tq3_0)")
    parser.add_argument("--max-ctx", "-c", "--ctx-size", dest="max_ctx", type=_ctx_type, default="auto",
                        help="KV cache positions, or auto (default): the most that fit, up to the training context")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (default: auto)")
    add_memory_options(parser)
    parser.add_argument("-ngl", "--n-gpu-layers", "--gpu-layers", dest="n_gpu_layers", type=int,
                        help="accepted for llama.cpp compatibility: every layer runs on --device")


def add_memory_options(parser: argparse.ArgumentParser) -> None:
    """--state-type and --draft-type (load's state_type and draft_type), for every command that loads or plans a
    speculative pair."""
    parser.add_argument("--state-type", default="auto", choices=["auto", "f32", "replay", "f16"],
                        help="verify node states: f32 (every node's state stored), replay (none stored, the commit "
                             "rebuilds the accepted one; ~2%% of the memory), f16 (half of f32; may change the "
                             "output where the top two logits are close), auto (default): replay")
    parser.add_argument("--draft-type", default="auto", choices=["auto", "stored", "q8_0", "q4_k"],
                        help="draft matrices on the device: stored (as in the file), q8_0 or q4_k (quantized at "
                             "load; output unchanged, proposals change slightly; q4_k: 28%% of bf16's bytes, rows "
                             "that are not whole 256-value blocks in q8_0), auto (default): q8_0 only where it fits "
                             "a longer context")


# keyword -> (type, help) of the sampling flags of `run` and `chat`, passed on as Engine.stream keywords
SAMPLING_OPTIONS = {
    "temperature": (float, "0 (default): greedy; > 0: sample"),
    "top_k": (int, "keep the k most likely tokens (0, default: all)"),
    "top_p": (float, "keep the most likely tokens holding this probability (1, default: all)"),
    "min_p": (float, "keep tokens at least this fraction as likely as the best (0, default: all)"),
    "seed": (int, "random seed (default: a fresh one)"),
    "repeat_penalty": (float, "penalty of tokens among the last 64 (1, default: none)"),
    "presence_penalty": (float, "subtracted from the logit of tokens among the last 64 (default 0)"),
    "frequency_penalty": (float, "subtracted per occurrence among the last 64 (default 0)"),
}


def add_sampling_options(parser: argparse.ArgumentParser) -> None:
    """--temperature (llama.cpp: --temp), --top-k, --top-p, --min-p, --seed and the three penalties; only those
    given reach the engine (none given: greedy)."""
    for name, (kind, help_) in SAMPLING_OPTIONS.items():
        flags = ["--" + name.replace("_", "-")] + (["--temp"] if name == "temperature" else [])
        parser.add_argument(*flags, dest=name, type=kind, help=help_)


def sampling_options(args: argparse.Namespace) -> dict:
    """The sampling keywords the user gave on the command line."""
    return {name: getattr(args, name) for name in SAMPLING_OPTIONS if getattr(args, name, None) is not None}


def _sampling_options(args: argparse.Namespace, command: str = "") -> dict:
    """The given sampling flags as Engine.stream keywords, checked before anything loads (a bad one is a usage
    error, reported by main() as `pydflash <command>: error: ...`)."""
    from .sampling import SamplingParams
    sampling = sampling_options(args)
    try:
        SamplingParams.from_options(sampling)
    except ValueError as e:
        raise UsageError(str(e)) from None
    return sampling


def _read_prompt(args: argparse.Namespace) -> str:
    if args.prompt is not None and args.file is not None:
        raise UsageError("give --prompt or --file, not both")
    if args.file is not None:
        try:
            with open(args.file, encoding="utf-8") as f:
                return f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise UsageError(f"--file {args.file}: {getattr(e, 'strerror', None) or e}") from None
    return args.prompt if args.prompt is not None else sys.stdin.read()


def _prompt_input(engine, args: argparse.Namespace, prompt: str):
    """What the engine decodes after: the text itself (default, --raw), or the chat template's rendering of a
    user turn (--chat), preceded by a system turn with --system."""
    if args.raw and (args.chat or args.system is not None):
        raise UsageError("--raw means no chat template; it does not go with --chat or --system")
    if args.system is None:
        return prompt
    messages = [{"role": "system", "content": args.system}, {"role": "user", "content": prompt}]
    return engine.tokenizer.chat_ids(messages)   # the turns' text stays plain text (no forged control tokens)


def cmd_run(args: argparse.Namespace) -> int:
    """Generate from a prompt (--prompt, --file, or stdin) and stream the text; stats go to stderr."""
    from .api import load

    _check_run_args(args)
    if args.raw and (args.chat or args.system is not None):
        raise UsageError("--raw means no chat template; it does not go with --chat or --system")
    prompt = _read_prompt(args)
    if not prompt:
        raise UsageError("empty prompt (give --prompt, --file or pipe text on stdin)")
    sampling = _sampling_options(args, "run")
    # a plan that does not fit (PlanError) is reported as one line by main(), like every other error
    engine = load(args.target, args.draft, device=args.device, kv_type=args.kv, max_ctx=_ctx_arg(args.max_ctx),
                  mode=args.mode, budget=args.budget, progress=True, verbose=args.verbose,
                  state_type=args.state_type, draft_type=args.draft_type)
    source = _prompt_input(engine, args, prompt)
    for piece in engine.stream(source, max_tokens=args.n_gen, chat=args.chat and args.system is None, **sampling):
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    _print_stats(engine.last_stats)
    return 0


def _ctx_arg(text):
    """--max-ctx: 'auto' or a positive count (an int where the subcommand's parser already made one)."""
    if text is None or isinstance(text, int) or text == "auto":
        return "auto" if text is None else text
    if not text.isdigit() or int(text) < 1:
        raise UsageError(f"--max-ctx {text!r}: expected a positive number of positions or 'auto'")
    return int(text)


def _ctx_type(text):
    """--max-ctx as an argparse type: a bad value is reported with what is accepted (argparse shows the message
    of an ArgumentTypeError; of a ValueError only its generic 'invalid ... value')."""
    try:
        return _ctx_arg(text)
    except UsageError as e:
        raise argparse.ArgumentTypeError(str(e).split(": ", 1)[1] + f", got {text!r}") from None


def _ubatch_arg(text: str):
    if text == "auto":
        return "auto"
    if not text.isdigit() or int(text) < 1:
        raise UsageError(f"--ubatch {text!r}: expected a positive number of tokens or 'auto'")
    return int(text)


def cmd_plan(args: argparse.Namespace) -> int:
    """Print the memory plan for a target (and draft) from their headers. With --vram no device is touched;
    without it the free memory of --device is planned for."""
    from . import plan

    vram = args.vram
    if vram is None:
        from . import ggml
        vram = ggml.Backend(args.device).memory()[0]
    # PlanError, and unreadable files or sizes (GGUFError, DraftLoadError): one line from main()
    result = plan.plan_for_load(args.target, args.draft, vram=vram, max_ctx=_ctx_arg(args.max_ctx),
                                kv_type=args.kv, budget=args.budget, mode=args.mode,
                                n_ubatch=_ubatch_arg(args.ubatch), state_type=args.state_type,
                                prefix_snapshots=args.prefix_snapshots,
                                draft_type=None if args.draft_type == "stored" else args.draft_type)
    print(result.table())
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    """Write a synthetic target (and draft), run AR and speculative decoding on it, check they agree."""
    import tempfile

    from . import testing
    from .api import load
    from .engine import _has_tree_ops

    spec_mode = "ddtree" if _has_tree_ops() else "chain"
    with tempfile.TemporaryDirectory(prefix="pydflash-demo-") as tmp:
        target_path = f"{tmp}/target.gguf"
        testing.write_qwen35_gguf(target_path, seed=args.seed)
        print(f"wrote a synthetic qwen35 target (random weights): {target_path}")
        ar = load(target_path, mode="ar", device=args.device, max_ctx=1024)
        prompt = "The quick brown fox jumps over the lazy dog."
        ref = ar.generate(prompt, max_tokens=args.n_gen)
        print(f"AR     : {len(ref.tokens)} tokens, decode {ref.stats['decode_tok_s']:.1f} tok/s")

        writer = getattr(testing, "write_dflash_draft", None)
        if writer is not None:
            draft_dir = f"{tmp}/draft"
            writer(draft_dir, target_path, seed=args.seed)
            draft, what = draft_dir, "a synthetic DFlash draft (random weights)"
            note = ("random draft weights barely ever guess the target's next token, so the acceptance length is "
                    "close to 1 and speculative decoding is slower than AR here; real draft/target pairs reach 6-8")
        else:
            prompt_ids = ar.tokenizer.tokenize(prompt, add_special=True)
            draft = testing.OracleDraft(prompt_ids + ref.tokens, ar.target.hp.n_vocab,
                                        error_positions=range(len(prompt_ids) + 5, len(prompt_ids) + 400, 9))
            what = "an oracle test double (the DFlash draft model is not in this build)"
            note = ("the oracle draft knows AR's answer and errs every 9th position, so its acceptance length is "
                    "artificially high; it shows the engine is lossless, not real draft quality")
        print(f"draft  : {what}")
        spec = load(target_path, draft, mode=spec_mode, budget=args.budget, device=args.device, max_ctx=1024)
        out = spec.generate(prompt, max_tokens=args.n_gen)
        same = out.tokens == ref.tokens
        print(f"{spec_mode:7s}: {len(out.tokens)} tokens, acceptance length {out.stats['acceptance_length']:.2f}, "
              f"{out.stats['steps']} steps, decode {out.stats['decode_tok_s']:.1f} tok/s")
        print(f"same tokens as AR: {'yes' if same else 'NO'}")
        print(f"note: {note}.")
        return 0 if same else 1


def cmd_chat(args: argparse.Namespace) -> int:
    """A terminal chat with the model (--demo: the synthetic pair, nothing to download)."""
    import tempfile

    from .api import load
    from .chat import ChatSession, repl

    sampling = _sampling_options(args)
    with tempfile.TemporaryDirectory(prefix="pydflash-chat-") as tmp:
        target, draft = args.target, args.draft
        if args.demo:
            from . import testing
            target, draft = f"{tmp}/target.gguf", f"{tmp}/draft"
            testing.write_qwen35_gguf(target, seed=0)
            testing.write_dflash_draft(draft, target, seed=0)
            print("demo: a synthetic target and DFlash draft (random weights: the replies are noise)", file=sys.stderr)
        elif target is None:
            print("pydflash chat: give --target T.gguf (or --demo)", file=sys.stderr)
            return 2
        else:
            _check_run_args(args)
        engine = load(target, draft, device=args.device, kv_type=args.kv, max_ctx=_ctx_arg(args.max_ctx),
                      mode=args.mode, budget=args.budget, progress=not args.demo,
                      prefix_cache=not args.no_prefix_cache, state_type=args.state_type,
                      draft_type=args.draft_type)
        return repl(ChatSession(engine, system=args.system, max_tokens=args.n_gen, sampling=sampling))


def cmd_bench(args: argparse.Namespace) -> int:
    """AR against speculative decoding over the benchmark prompt sets; markdown, JSON and PNG reports."""
    import tempfile

    from . import benchmark
    from .api import load

    datasets = [d.strip() for d in args.datasets.split(",") if d.strip()]
    with tempfile.TemporaryDirectory(prefix="pydflash-bench-") as tmp:
        target, draft = args.target, args.draft
        if args.demo:
            from . import testing
            target, draft = f"{tmp}/target.gguf", f"{tmp}/draft"
            testing.write_qwen35_gguf(target, seed=args.seed)
            testing.write_dflash_draft(draft, target, seed=args.seed)
        elif not target or not draft:
            print("pydflash bench: give --target and --draft (or --demo for the synthetic pair)", file=sys.stderr)
            return 2
        else:
            _check_run_args(args)
        peers = None
        if args.llama_bin:            # checked before the model loads: missing programs, a foreign draft vocabulary
            from .llama_peers import LlamaPeers, PeerError
            try:
                peers = LlamaPeers(args.llama_bin, target, args.llama_draft, args.llama_draft_max)
            except PeerError as e:
                print(f"pydflash bench: {e}", file=sys.stderr)
                return 2
        elif args.llama_draft:
            print("pydflash bench: --llama-draft needs --llama-bin (the folder of the llama.cpp programs)",
                  file=sys.stderr)
            return 2
        engine = load(target, draft, device=args.device, max_ctx=args.max_ctx, mode=args.mode, budget=args.budget,
                      progress=True)
        runs, summary = benchmark.run_bench(engine, datasets, n_prompts=args.n_prompts, n_gen=args.n_gen,
                                            seed=args.seed, prompt_format=args.format, peers=peers)
        settings = benchmark.settings_of(engine, target=target, draft=draft, device=args.device, n_gen=args.n_gen,
                                         seed=args.seed, prompt_format=args.format, peers=peers)
        paths = benchmark.write_report(args.out, runs, summary, settings)
    print(benchmark.markdown(summary, settings))
    print("wrote " + ", ".join(paths.values()), file=sys.stderr)
    return 0


def cmd_train_draft(args: argparse.Namespace) -> int:
    """Train a DFlash draft on the target GGUF's own continuations and features (needs the `train` extra)."""
    from .train_draft import train_draft

    shape = {"n_layer": args.n_layer, "n_head": args.n_head, "n_head_kv": args.n_head_kv, "head_dim": args.head_dim,
             "n_ff": args.n_ff, "block_size": args.block_size}
    if args.target_layers:
        shape["target_layer_ids"] = [int(i) for i in args.target_layers.split(",")]
    summary = train_draft(args.target, args.out, data=args.data, continuations=args.continuations,
                          n_seq=args.n_seq, n_held_out=args.held_out, n_gen=args.n_gen,
                          max_prompt_tokens=args.max_prompt_tokens, steps=args.steps, minutes=args.minutes,
                          device=args.device, target_device=args.target_device, batch=args.batch,
                          anchors=args.anchors, lr=args.lr, warmup=args.warmup, loss_gamma=args.loss_gamma,
                          grad_clip=args.grad_clip, eval_every=args.eval_every, seed=args.seed, draft_shape=shape)
    print(f"draft written to {summary['draft_dir']}: loss {summary['loss_first']:.3f} -> {summary['loss_last']:.3f}"
          f" over {summary['steps']} steps; held-out chain acceptance {summary['held_out_chain_acceptance']:.2f}"
          f" (step {summary['best_step']}), held-out acceptance length {summary['held_out_acceptance_length']:.2f}"
          f" (outputs equal AR: {'yes' if summary['outputs_equal_ar'] else 'NO'})")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pydflash", description=__doc__)
    parser.add_argument("--debug", action="store_true", help="show the full traceback of an error")
    sub = parser.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="show the build and devices, and run a self-check graph")
    info.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (default: auto)")
    info.set_defaults(func=cmd_info)

    run = sub.add_parser("run", help="generate text with a target GGUF (and a DFlash draft)",
                         description="Generate text. llama.cpp's flag spellings work as aliases (-m, -md, -c, -n, "
                                     "-p, -f, -ctk, --draft-max, -ngl, -sys, --temp, ...).")
    add_model_options(run)
    run.add_argument("--prompt", "-p", dest="prompt", help="prompt text (default: read stdin)")
    run.add_argument("--file", "-f", dest="file", help="read the prompt from this file")
    run.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    run.add_argument("--system", "-sys", "--system-prompt", dest="system",
                     help="system message (implies --chat)")
    run.add_argument("--raw", action="store_true", help="no chat template: continue the text as it is (default)")
    run.add_argument("--n-gen", "-n", "--n-predict", dest="n_gen", type=int, default=256,
                     help="new tokens at most (default 256)")
    add_sampling_options(run)
    run.add_argument("--verbose", action="store_true", help="print the memory plan on load")
    run.set_defaults(func=cmd_run)

    chat = sub.add_parser("chat", help="chat in the terminal (multi-turn, streamed, Ctrl+C stops a reply)")
    add_model_options(chat, target_required=False)
    chat.add_argument("--demo", action="store_true", help="chat with a synthetic target/draft pair (no download)")
    chat.add_argument("--system", "-sys", "--system-prompt", dest="system", help="system prompt")
    chat.add_argument("--n-gen", "-n", "--n-predict", dest="n_gen", type=int, default=512,
                      help="new tokens per reply at most (default 512)")
    chat.add_argument("--no-prefix-cache", action="store_true",
                      help="prefill every turn from scratch (no reuse of the previous turn's state)")
    add_sampling_options(chat)
    chat.set_defaults(func=cmd_chat)

    mem = sub.add_parser("plan", help="print the device-memory plan of a target (and draft); no GPU needed")
    mem.add_argument("--target", required=True, help="target GGUF (only its header is read)")
    mem.add_argument("--draft", help="DFlash draft directory or GGUF (only config and header are read)")
    mem.add_argument("--max-ctx", type=_ctx_type, default="auto", help="positions, or auto (default): the most that fit")
    mem.add_argument("--kv", default="auto", choices=["auto", "f16", "q8_0", "q4_0", "tq3_0"],
                     help="KV cache type (default auto)")
    mem.add_argument("--vram", help="device memory to plan for, e.g. 24GiB or 24GB (default: the free memory "
                                    "of --device)")
    mem.add_argument("--device", default="auto", help="device whose free memory is used without --vram")
    mem.add_argument("--mode", choices=["ar", "chain", "ddtree"], help="default: ddtree with a draft, else ar")
    mem.add_argument("--budget", type=int, default=22, help="tree nodes (ddtree) or chain length (default 22)")
    mem.add_argument("--ubatch", default="auto",
                     help="longest prefill micro-batch, or auto (default, as load: 2048 where it costs no context, "
                          "else 512)")
    add_memory_options(mem)
    mem.add_argument("--prefix-snapshots", type=int, default=4,
                     help="recurrent-state snapshots for prefix reuse (default 4, as load; fewer where they would "
                          "cost context)")
    mem.set_defaults(func=cmd_plan)

    demo = sub.add_parser("demo", help="synthetic target and draft: AR vs speculative, same tokens, speed")
    demo.add_argument("--n-gen", type=int, default=64)
    demo.add_argument("--budget", type=int, default=22)
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--device", default="cpu", help="cpu (default), cuda or auto")
    demo.set_defaults(func=cmd_demo)
    bench = sub.add_parser("bench", help="AR vs speculative tok/s on HumanEval, GSM8K and MATH-500")
    bench.add_argument("--target", help="target GGUF")
    bench.add_argument("--draft", help="DFlash draft directory")
    bench.add_argument("--demo", action="store_true", help="use a synthetic target/draft pair (no download)")
    bench.add_argument("--datasets", default="humaneval,gsm8k,math500", help="comma-separated prompt sets")
    bench.add_argument("--n-prompts", type=int, default=20, help="prompts per dataset (default 20)")
    bench.add_argument("--n-gen", type=int, default=256, help="new tokens per prompt (default 256)")
    bench.add_argument("--format", choices=["auto", "chat", "raw"], default="auto",
                       help="auto: HumanEval raw, math questions chat-templated (default)")
    bench.add_argument("--mode", choices=["chain", "ddtree"], default="ddtree")
    bench.add_argument("--budget", type=int, default=22)
    bench.add_argument("--max-ctx", type=int, default=4096)
    bench.add_argument("--seed", type=int, default=0)
    bench.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (default: auto)")
    bench.add_argument("--out", default="pydflash-bench", help="folder for bench.md/json/png")
    bench.add_argument("--llama-bin", help="folder of llama.cpp's llama-simple and llama-speculative-simple "
                       "(tools/build_llama_bench.sh): adds llama.cpp AR (and speculative) columns")
    bench.add_argument("--llama-draft", help="draft GGUF for llama.cpp's speculative decoding (same vocabulary "
                       "as the target)")
    bench.add_argument("--llama-draft-max", type=int, default=16,
                       help="llama.cpp's most draft tokens per step (--spec-draft-n-max; default 16)")
    bench.set_defaults(func=cmd_bench)

    train = sub.add_parser("train-draft", help="train a DFlash draft on a GGUF target's own outputs (needs torch)")
    train.add_argument("--target", required=True, help="target GGUF")
    train.add_argument("--out", required=True, help="work folder: data/, checkpoint.pt, draft/ (resumable)")
    train.add_argument("--data", default="sharegpt",
                       help="sharegpt, random (synthetic targets), or a .jsonl/.txt file of prompts")
    train.add_argument("--continuations", metavar="FILE.jsonl",
                       help='the target\'s outputs, one {"prompt": [ids], "output": [ids]} per line: features by one '
                            'prefill each, no generation; the last --held-out lines are held out')
    train.add_argument("--n-seq", type=int, help="training sequences (default: all continuations, or 256 prompts)")
    train.add_argument("--held-out", type=int, default=8, help="held-out prompts for acceptance (default 8)")
    train.add_argument("--n-gen", type=int, default=128,
                       help="target tokens generated per prompt and per held-out check (default 128)")
    train.add_argument("--max-prompt-tokens", type=int, default=256)
    train.add_argument("--steps", type=int, help="optimizer steps (default 2000 without --minutes)")
    train.add_argument("--minutes", type=float, help="training time budget: stop and save when it is spent")
    train.add_argument("--batch", type=int, default=16, help="sequences per step (default 16)")
    train.add_argument("--anchors", type=int, default=32, help="draft blocks per sequence per step (default 32)")
    train.add_argument("--lr", type=float, default=1e-3, help="peak AdamW learning rate (default 1e-3)")
    train.add_argument("--warmup", type=int, default=100, help="linear warmup steps, then cosine decay")
    train.add_argument("--loss-gamma", type=float, default=7.0,
                       help="block position k weighs exp(-(k-1)/gamma) in the loss; 0: all alike (default 7)")
    train.add_argument("--grad-clip", type=float, default=1.0, help="gradient norm clip; 0: none (default 1)")
    train.add_argument("--eval-every", type=int, default=250,
                       help="steps between held-out chain-acceptance checks (default 250)")
    train.add_argument("--n-layer", type=int, default=2, help="draft layers (default 2)")
    train.add_argument("--n-head", type=int, default=8)
    train.add_argument("--n-head-kv", type=int, default=2)
    train.add_argument("--head-dim", type=int, default=128)
    train.add_argument("--n-ff", type=int, default=2048)
    train.add_argument("--block-size", type=int, default=16)
    train.add_argument("--target-layers", help="comma-separated 0-based target layers (default: spread)")
    train.add_argument("--device", default="cpu", help="torch device for training: cpu or cuda")
    train.add_argument("--target-device", default="auto", help="pydflash device for the target")
    train.add_argument("--seed", type=int, default=0)
    train.set_defaults(func=cmd_train_draft)

    from .server import cli as server_cli
    serve = sub.add_parser("serve", help="OpenAI- and Anthropic-compatible HTTP server with a chat page at /")
    server_cli.add_arguments(serve)
    serve.set_defaults(func=server_cli.serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "demo":
        _check_positive(parser, "--n-gen", args.n_gen)
        _check_positive(parser, "--budget", args.budget)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print(f"pydflash {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:   # every error is the user's to read: one line, no traceback unless --debug
        if args.debug:
            raise
        message = " ".join(str(e).split()) or type(e).__name__
        print(f"pydflash {args.command}: error: {message}", file=sys.stderr)
        return 2 if isinstance(e, UsageError) else 1


def _check_positive(parser, flag: str, value: int) -> None:
    if value < 1:
        parser.error(f"{flag} {value}: expected a positive number")


if __name__ == "__main__":
    sys.exit(main())
