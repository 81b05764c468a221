"""pydflash: DFlash + DDTree speculative decoding of GGUF models on a patched ggml."""

__version__ = "0.1.0"
