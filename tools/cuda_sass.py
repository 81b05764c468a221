"""What the compiler made of a ggml_ext kernel, on a machine without a GPU: compile one of our CUDA sources for
sm_90a to a cubin (as tools/cuda_check.sh compiles it), disassemble it with cuobjdump, and for every kernel whose
name matches a pattern print its instruction count and the opcode mix of each basic block that holds tensor-core
instructions (HMMA, HGMMA): the inner loops, where a weight's decoding or a score's softmax costs issue slots.

    python tools/cuda_sass.py ggml_ext/cuda/qmatmul.cu 'qmm_half_shared.*type12ELi3ELi1ELi12' [--dump-block ADDR]

cuobjdump and the nvdisasm it runs are not part of the nvcc install here; they come from PyPI as wheels of their own
(no GPU needed):

    pip download --no-deps nvidia-cuda-cuobjdump==13.4.92 nvidia-cuda-nvdisasm==13.5.37 -d /tmp/whl
    for w in /tmp/whl/nvidia_cuda_*.whl; do unzip -oq $w -d /tmp/cuobjdump; done

(then --cuobjdump /tmp/cuobjdump/nvidia/cu13/bin/cuobjdump, or put that folder on PATH: nvdisasm is looked for beside
it). Extra nvcc flags go after --: e.g. `-- -DGGML_TYPE_TQ3_0=GGML_TYPE_COUNT` for tq3_0_fattn.cu (see
tools/cuda_check.sh).

--against REV compiles the same file as of git revision REV too (its ggml_ext and tools/cuda_check) and says, per
matching kernel, whether the code is the same instruction for instruction (addresses aside) and otherwise how the
opcode counts moved: for a change meant to leave the code alone (a refactor) when no GPU is at hand.
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def opcode(instr: str) -> str:
    instr = re.sub(r"^@!?U?P\w+\s+", "", instr)   # (a predicate guard)
    return instr.split()[0].split(".")[0]


def kernels(sass: str) -> dict[str, list[tuple[int, str]]]:
    out = {}
    for part in sass.split("Function : ")[1:]:
        name = part.split()[0]
        out[name] = [(int(a, 16), i.strip()) for a, i in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", part)]
    return out


def basic_blocks(code: list[tuple[int, str]]) -> list[list[tuple[int, str]]]:
    targets = {int(m.group(1), 16) for _, i in code for m in [re.search(r"BRA.*0x([0-9a-f]+)", i)] if m}
    blocks, cur = [], []
    for addr, instr in code:
        if addr in targets and cur:
            blocks.append(cur)
            cur = []
        cur.append((addr, instr))
        if opcode(instr) in ("BRA", "EXIT", "RET"):
            blocks.append(cur)
            cur = []
    return blocks + ([cur] if cur else [])


def compare(old: dict, new: dict, pattern: str, rev: str) -> int:
    """Per kernel matching pattern: the same code as at rev, or its instruction and opcode counts then and now."""
    names = sorted(n for n in set(old) | set(new) if re.search(pattern, n))
    if not names:
        print(f"no kernel matches {pattern!r}", file=sys.stderr)
        return 1
    for name in names:
        if name not in old or name not in new:
            print(f"{name}: {'new' if name not in old else 'gone'}")
            continue
        a, b = [i for _, i in old[name]], [i for _, i in new[name]]
        if a == b:
            print(f"{name}: the same {len(b)} instructions")
            continue
        ca, cb = collections.Counter(map(opcode, a)), collections.Counter(map(opcode, b))
        moved = ", ".join(f"{op} {ca[op]}->{cb[op]}" for op in sorted(set(ca) | set(cb)) if ca[op] != cb[op])
        print(f"{name}: {len(a)} -> {len(b)} instructions; {moved or 'the same opcodes, in another order'}")
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("source", help="a .cu file of ggml_ext/cuda")
    p.add_argument("pattern", help="a regular expression over the kernels' mangled names")
    p.add_argument("--cuobjdump", default=shutil.which("cuobjdump") or "cuobjdump")
    p.add_argument("--dump-block", type=lambda s: int(s, 16), help="print the block at this address (hex)")
    p.add_argument("--against", metavar="REV", help="compare with the file as of this git revision")
    args = p.parse_args(argv)

    ggml = ROOT / ".device" / "ggml-src"
    if not (ggml / "src" / "ggml-cuda").is_dir():
        p.error(f"no {ggml}: run python tools/prepare_gpu_carry.py first")
    if not (shutil.which(args.cuobjdump) or Path(args.cuobjdump).is_file()):
        p.error(f"no cuobjdump at {args.cuobjdump!r}: see this script's docstring for the PyPI wheel")
    def sass_of(tree: Path) -> str:   # the source compiled from `tree`'s ggml_ext (ggml from .device)
        with tempfile.TemporaryDirectory() as tmp:
            cubin = Path(tmp) / "k.cubin"
            includes = [tree / "tools/cuda_check", tree / "ggml_ext/include", tree / "ggml_ext/cuda",
                        ggml / "include", ggml / "src", ggml / "src/ggml-cuda"]
            subprocess.run(["nvcc", "-std=c++17", "-O3", "-arch=sm_90a", "-DGGML_EXT_WGMMA", "-cubin", "-o", str(cubin),
                            str(tree / args.source), "-DGGML_USE_CUDA", *[f"-I{i}" for i in includes], *extra],
                           cwd=ROOT, check=True)
            tools_dir = str(Path(shutil.which(args.cuobjdump) or args.cuobjdump).resolve().parent)
            env = dict(os.environ, PATH=tools_dir + os.pathsep + os.environ.get("PATH", ""))
            run = subprocess.run([args.cuobjdump, "-sass", str(cubin)], capture_output=True, text=True, env=env)
            if run.returncode != 0:
                p.error(f"cuobjdump failed: {run.stderr.strip()}")
            return run.stdout

    sass = sass_of(ROOT)
    if args.against:
        with tempfile.TemporaryDirectory() as old_tree:
            archive = subprocess.run(["git", "archive", args.against, "ggml_ext", "tools/cuda_check"], cwd=ROOT,
                                     capture_output=True, check=True).stdout
            subprocess.run(["tar", "-x", "-C", old_tree], input=archive, check=True)
            return compare(kernels(sass_of(Path(old_tree))), kernels(sass), args.pattern, args.against)
    found = {n: c for n, c in kernels(sass).items() if re.search(args.pattern, n)}
    if not found:
        print(f"no kernel matches {args.pattern!r}", file=sys.stderr)
        return 1
    for name, code in found.items():
        print(f"{name}: {len(code)} instructions")
        for block in basic_blocks(code):
            mix = collections.Counter(opcode(i) for _, i in block)
            if mix["HMMA"] or mix["HGMMA"]:
                top = ", ".join(f"{op} {n}" for op, n in mix.most_common(12))
                print(f"  block at {block[0][0]:#x}: {len(block)} instructions: {top}")
            if args.dump_block is not None and block[0][0] == args.dump_block:
                print("\n".join(f"    {a:#06x}  {i}" for a, i in block))
    return 0


if __name__ == "__main__":
    sys.exit(main())
