"""The `qwen2` target (Qwen2 / Qwen2.5): llama's layers with Q/K/V biases and NEOX rope (llama.cpp's
src/models/qwen2.cpp)."""
from __future__ import annotations

from dataclasses import dataclass

from . import layers
from .llama import LlamaHParams, LlamaTarget


@dataclass(frozen=True)
class Qwen2HParams(LlamaHParams):
    ARCH = "qwen2"
    ROPE_TYPE = layers.ROPE_TYPE_NEOX
    QKV_BIAS = "required"


class Qwen2Target(LlamaTarget):
    ARCH = Qwen2HParams.ARCH
    HParams = Qwen2HParams
