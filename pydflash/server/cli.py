"""`pydflash serve` and `python -m pydflash.server`: load the engine, serve it with uvicorn."""
from __future__ import annotations

import argparse
import sys
import tempfile

from ..cli import _ctx_type, add_memory_options


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", help="target GGUF (e.g. Qwen3.5-27B-Q4_K_M.gguf)")
    parser.add_argument("--draft", help="DFlash draft directory (config.json + model.safetensors)")
    parser.add_argument("--demo", action="store_true",
                        help="serve a synthetic target/draft pair (random weights; nothing to download)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8080, help="port (default 8080)")
    parser.add_argument("--mode", choices=["ar", "chain", "ddtree"], help="default: ddtree with a draft, else ar")
    parser.add_argument("--budget", type=int, default=22, help="tree nodes (ddtree) or chain length (default 22)")
    parser.add_argument("--kv", default="f16", choices=["f16", "q8_0", "q4_0", "tq3_0"],
                        help="KV cache type (default f16; tq3_0 with --mode ar only)")
    parser.add_argument("--max-ctx", type=_ctx_type, default="auto",
                        help="KV cache positions, or auto (default): the most that fit, up to the training context")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (default: auto)")
    add_memory_options(parser)
    parser.add_argument("--no-prefix-cache", action="store_true",
                        help="prefill every request from scratch (no reuse of an earlier prompt's state)")
    parser.add_argument("--api-key", help="require this key (Authorization: Bearer KEY, or x-api-key: KEY)")
    parser.add_argument("--alias", help="the model name clients use (default: the target's file name)")
    parser.add_argument("--queue-size", type=int, default=16,
                        help="requests that may wait behind the running one; more get 503 (default 16)")
    parser.add_argument("--log-level", default="info", help="uvicorn log level (default info)")


def serve(args: argparse.Namespace) -> int:
    import uvicorn

    from ..api import load
    from .app import create_app

    if args.queue_size < 0:
        print("pydflash serve: --queue-size must be 0 or more", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="pydflash-serve-") as tmp:
        target, draft = args.target, args.draft
        if args.demo:
            from .demo import write_demo_pair
            target, draft = write_demo_pair(tmp)
            print(f"demo: a synthetic target and draft with random weights (replies are gibberish): {target}",
                  file=sys.stderr)
        elif not target:
            print("pydflash serve: give --target T.gguf (and --draft D/), or --demo", file=sys.stderr)
            return 2
        mode = args.mode
        if mode is None and draft is not None:
            from ..engine import _has_tree_ops
            mode = "ddtree" if _has_tree_ops() else "chain"
        engine = load(target, draft, device=args.device, kv_type=args.kv, max_ctx=args.max_ctx, mode=mode,
                      budget=args.budget, progress=True, prefix_cache=not args.no_prefix_cache,
                      state_type=args.state_type, draft_type=args.draft_type)
        app = create_app(engine, alias=args.alias or ("pydflash-demo" if args.demo else None), api_key=args.api_key,
                         queue_size=args.queue_size, target_path=target)
        alias = app.state.server.alias
        print(f"pydflash serve: model {alias!r} ({engine.mode}) on http://{args.host}:{args.port}/ "
              f"(chat page at /, OpenAI API at /v1, Anthropic API at /v1/messages)", file=sys.stderr, flush=True)
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
        app.state.server.worker.stop()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pydflash serve", description=__doc__)
    add_arguments(parser)
    return serve(parser.parse_args(argv))
