"""Target model families, one module each on the shared runtime (runtime.py), chosen by the GGUF's
`general.architecture`. docs/targets.md describes what a target provides and what an architecture module adds."""
from __future__ import annotations

from ..gguf_io import GGUFError, GGUFFile


def target_classes() -> dict:
    """general.architecture -> the target class that loads it."""
    from .gemma3 import Gemma3Target
    from .llama import LlamaTarget
    from .qwen2 import Qwen2Target
    from .qwen3 import Qwen3Target
    from .qwen35 import Qwen35Target
    return {cls.ARCH: cls for cls in (Qwen35Target, LlamaTarget, Qwen2Target, Qwen3Target, Gemma3Target)}


def load_target(path, backend="auto", **options):
    """Load the target model of a GGUF (a file name or a parsed GGUFFile) with the class for its architecture
    (options go to that class). The header is parsed once, here, and handed on."""
    gf = path if isinstance(path, GGUFFile) else GGUFFile(path)
    targets = target_classes()
    arch = gf.architecture
    if arch not in targets:
        raise GGUFError(f"{gf.path}: architecture {arch!r} is not supported (supported: {sorted(targets)})")
    return targets[arch](gf, backend, **options)
