"""The `qwen3` target (Qwen3 dense): llama's layers with per-head Q/K RMS norms before a NEOX rope and no
biases (llama.cpp's src/models/qwen3.cpp)."""
from __future__ import annotations

from dataclasses import dataclass

from . import layers
from .llama import LlamaHParams, LlamaTarget


@dataclass(frozen=True)
class Qwen3HParams(LlamaHParams):
    ARCH = "qwen3"
    ROPE_TYPE = layers.ROPE_TYPE_NEOX
    QKV_BIAS = "none"
    QK_NORM = True


class Qwen3Target(LlamaTarget):
    ARCH = Qwen3HParams.ARCH
    HParams = Qwen3HParams
