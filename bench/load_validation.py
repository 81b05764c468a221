"""What the load-time validation costs next to a whole load: header parse, each check, and (with --full) the
complete `pydflash.load` of the same file.

    python bench/load_validation.py MODEL.gguf [--device cpu] [--full] [--repeat 3]
    python bench/load_validation.py /tmp/q27.gguf --write-sparse-27b      # writes the file first

--write-sparse-27b writes the Qwen3.5-27B-shaped synthetic GGUF (pydflash.testing's 27b preset: the real
header, 248,320-token vocabulary and tensor table) with its ~16 GB of weights left as a sparse hole of zeros:
the checks read only headers, so their cost is that of the real file, and a full load of it reads zeros from
the page cache, the fastest a load can be (so the ratio printed is an upper bound). Prints markdown rows.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

try:
    import pydflash  # noqa: F401  (the installed package)
except ImportError:      # running from a source checkout without installing
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from _timing import call_times  # noqa: E402  (bench/_timing.py: this folder is on sys.path when run as a script)


def write_sparse_27b(path: str) -> None:
    from pydflash import testing

    end = [0]

    def skip_data(writer, spec, type_name, seed, pools):
        info = writer.tensors[0].pop(spec.name)
        fout = writer.fout[0]
        writer.write_padding(fout, fout.tell())
        fout.seek(info.nbytes, os.SEEK_CUR)      # a hole: no bytes written, reads as zeros
        end[0] = fout.tell()
        writer.write_padding(fout, info.nbytes)

    real = testing._write_tensor_data
    testing._write_tensor_data = skip_data
    try:
        testing.write_qwen35_gguf(path, testing.preset_27b())
    finally:
        testing._write_tensor_data = real
    if os.path.getsize(path) < end[0]:
        os.truncate(path, end[0])


def best(fn, repeat: int) -> float:
    """The fastest of `repeat` calls of fn, in seconds (no warm-up: the first call is a real load's)."""
    return min(call_times(fn, repeat, warmup=0))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--device", default="cpu")
    p.add_argument("--full", action="store_true", help="also time a complete pydflash.load (allocates the weights)")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--write-sparse-27b", action="store_true")
    args = p.parse_args(argv)
    if args.write_sparse_27b:
        t = time.perf_counter()
        write_sparse_27b(args.model)
        print(f"wrote {args.model} ({os.path.getsize(args.model) / 2**30:.2f} GiB, sparse) in "
              f"{time.perf_counter() - t:.1f} s", file=sys.stderr)

    import pydflash
    from pydflash import ggml
    from pydflash.gguf_io import GGUFFile
    from pydflash.models import target_classes
    from pydflash.tokenizer import check_vocabulary
    from pydflash.validate import SMALL_F32_ROLES, check_finite, check_tensors

    backend = ggml.Backend(args.device)
    gf = GGUFFile(args.model)
    HParams = target_classes()[gf.architecture].HParams      # noqa: N806 (a class)
    hp = HParams.from_gguf(gf)
    specs = hp.tensors()
    small = [gf.tensors[n] for n, s in specs.items() if s.role in SMALL_F32_ROLES and n in gf.tensors]
    rows = {
        "GGUF header parse (GGUFFile)": best(lambda: GGUFFile(args.model), args.repeat),
        "hyperparameter checks": best(lambda: HParams.from_gguf(gf), args.repeat),
        "tensor table: shapes, roles, backend probes": best(
            lambda: check_tensors(gf, hp.tensors(), backend=backend), args.repeat),
        "tokenizer metadata checks": best(lambda: check_vocabulary(gf), args.repeat),
        "small f32 tensors finite (norms, biases, ssm_a)": best(lambda: check_finite(gf, small), args.repeat),
    }
    checks = sum(v for k, v in rows.items() if "parse" not in k)
    print(f"| {os.path.basename(args.model)}: {len(gf.tensors)} tensors, {hp.n_vocab} tokens | seconds |")
    print("| --- | ---: |")
    for name, seconds in rows.items():
        print(f"| {name} | {seconds:.3f} |")
    print(f"| all validation checks | {checks:.3f} |")
    if args.full:
        t = time.perf_counter()
        engine = pydflash.load(args.model, mode="ar", device=args.device, max_ctx=4096, progress=False)
        full = time.perf_counter() - t
        del engine
        weights = sum(i.nbytes for i in gf.tensors.values()) / 2**30
        print(f"| complete pydflash.load ({args.device}, weights {weights:.1f} GiB) | {full:.3f} |")
        print(f"| validation checks / complete load | {100 * checks / full:.2f} % |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
