"""Target model families, one module each, chosen by the GGUF's `general.architecture`."""
from __future__ import annotations

from ..gguf_io import GGUFError, GGUFFile


def _targets() -> dict:
    from .qwen35 import ARCH as QWEN35, Qwen35Target
    return {QWEN35: Qwen35Target}


def load_target(path, backend="auto", **options):
    """Load the target model of a GGUF (a path, or an already parsed GGUFFile: a 248K-token header takes a
    second to parse) with the class for its architecture (options go to that class)."""
    gf = path if isinstance(path, GGUFFile) else GGUFFile(path)
    arch = gf.architecture
    targets = _targets()
    if arch not in targets:
        raise GGUFError(f"{gf.path}: architecture {arch!r} is not supported (supported: {sorted(targets)})")
    return targets[arch](gf, backend, **options)
