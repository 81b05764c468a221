"""pydflash: DFlash + DDTree speculative decoding of GGUF models on a patched ggml."""

__version__ = "0.1.0"

from .api import Engine, Result, load  # noqa: E402
from .llama_compat import Llama  # noqa: E402

__all__ = ["Engine", "Llama", "Result", "load", "__version__"]
