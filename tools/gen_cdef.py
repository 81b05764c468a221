#!/usr/bin/env python3
"""Generate the cffi declarations of pydflash.ggml from the patched ggml headers.

Run by the build (CMakeLists.txt). The C preprocessor expands the public headers against empty stand-ins for
the libc headers (cffi knows size_t, int64_t, bool and FILE itself); what pycparser cannot read is then
removed. The result is the exact API of the libraries built next to it, so the bindings never drift.
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

HEADERS = ["ggml.h", "ggml-alloc.h", "ggml-backend.h", "ggml-cpu.h", "gguf.h", "ggml-ext.h"]
SIZES = {"int8_t": 1, "uint8_t": 1, "int16_t": 2, "uint16_t": 2, "int32_t": 4, "uint32_t": 4, "float": 4,
         "int64_t": 8, "uint64_t": 8, "double": 8}
LIBC = ["stdbool.h", "stddef.h", "stdint.h", "stdio.h", "stdlib.h", "string.h"]


def preprocess(cc: str, includes: list[str]) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        for name in LIBC:
            Path(tmp, name).write_text("")
        wrapper = Path(tmp, "all.h")
        wrapper.write_text("".join(f'#include "{h}"\n' for h in HEADERS))
        cmd = [cc, "-E", "-P", "-nostdinc", "-U__GNUC__", "-U__clang__", f"-I{tmp}"] + [f"-I{i}" for i in includes] + [str(wrapper)]
        return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout


def clean(text: str) -> str:
    text = re.sub(r"\b_Noreturn\b", "", text)
    text = re.sub(r"\b__restrict__\b|\b__restrict\b|\brestrict\b", "", text)
    # cffi wants plain numbers for array sizes: `int32_t op_params[64 / sizeof(int32_t)]` -> `[16]`
    for ctype, size in SIZES.items():
        text = text.replace(f"sizeof({ctype})", str(size))
    text = re.sub(r"\[([0-9 ()*/+-]+)\]", lambda m: f"[{int(eval(m.group(1), {'__builtins__': {}}))}]", text)
    # C allows repeating a typedef (ggml-alloc.h and ggml-backend.h both declare the buffer types); cffi not.
    lines, seen = [], set()
    for line in (ln.rstrip() for ln in text.splitlines() if ln.strip()):
        if line.lstrip().startswith("typedef") and line.endswith(";"):
            if line.strip() in seen:
                continue
            seen.add(line.strip())
        lines.append(line)
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cc", required=True)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("-I", dest="includes", action="append", default=[])
    args = parser.parse_args()
    cdef = clean(preprocess(args.cc, args.includes))
    import cffi  # checked here so a cdef that cffi cannot parse fails the build, not the import

    cffi.FFI().cdef(cdef)
    args.out.write_text(cdef)
    return 0


if __name__ == "__main__":
    sys.exit(main())
