"""GGUF files → device tensors: a checked reader and a chunked uploader with a progress bar.

The file is memory-mapped (gguf-py's reader); nothing is copied on the host except the chunk being uploaded.
Every header field is treated as untrusted: sizes, offsets and shapes are checked against the file before any
allocation, and each problem is reported with the file's name.
"""
from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass

import numpy as np

from . import ggml

GGUF_MAGIC = b"GGUF"
_MIN_HEADER = 4 + 4 + 8 + 8  # magic, version, n_tensors, n_kv


class GGUFError(ValueError):
    """A GGUF file is unreadable, truncated, of the wrong architecture, or lacks what the model needs."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    type: ggml.Type
    ne: tuple            # ggml order
    offset: int          # absolute byte offset of the data in the file
    nbytes: int


class GGUFFile:
    """The metadata and tensor table of one GGUF file, validated against its size."""

    def __init__(self, path):
        import gguf
        self.path = os.fspath(path)
        try:
            size = os.path.getsize(self.path)
        except OSError as e:
            raise GGUFError(f"{self.path}: cannot open ({e.strerror})") from None
        with open(self.path, "rb") as f:
            head = f.read(_MIN_HEADER)
        if len(head) < _MIN_HEADER or head[:4] != GGUF_MAGIC:
            raise GGUFError(f"{self.path}: not a GGUF file (bad magic or shorter than a header)")
        try:
            self._reader = gguf.GGUFReader(self.path, "r")
        except Exception as e:  # gguf-py raises assorted errors on damaged headers
            raise GGUFError(f"{self.path}: damaged GGUF header ({type(e).__name__}: {e})") from None
        self.size = size
        self.tensors: dict[str, TensorInfo] = {}
        for t in self._reader.tensors:
            try:
                type_ = ggml.Type(int(t.tensor_type))
            except ValueError:
                raise GGUFError(f"{self.path}: tensor {t.name} has unknown type {int(t.tensor_type)}") from None
            ne = tuple(int(n) for n in t.shape)
            nbytes = ggml.row_size(type_, ne[0]) * int(np.prod(ne[1:], dtype=np.int64))
            if t.data_offset + nbytes > size:
                raise GGUFError(f"{self.path}: truncated: tensor {t.name} needs bytes up to "
                                f"{t.data_offset + nbytes}, the file has {size}")
            self.tensors[t.name] = TensorInfo(t.name, type_, ne, int(t.data_offset), nbytes)

    # --- metadata ---

    def get(self, key: str, default=None):
        """A metadata value as a Python scalar, string or list; `default` when absent."""
        field = self._reader.fields.get(key)
        if field is None:
            return default
        return field.contents()

    def require(self, key: str):
        value = self.get(key)
        if value is None:
            raise GGUFError(f"{self.path}: missing metadata key {key!r}")
        return value

    @property
    def architecture(self) -> str:
        return str(self.get("general.architecture", "?"))

    def expect_architecture(self, arch: str) -> None:
        if self.architecture != arch:
            raise GGUFError(f"{self.path}: architecture is {self.architecture!r}, expected {arch!r}")

    def data(self, info: TensorInfo) -> np.ndarray:
        """The raw bytes of a tensor (a view into the memory map)."""
        return self._reader.data[info.offset: info.offset + info.nbytes]

    def check_tensor(self, name: str, ne: tuple) -> TensorInfo:
        info = self.tensors.get(name)
        if info is None:
            raise GGUFError(f"{self.path}: missing tensor {name!r}")
        if tuple(info.ne) != tuple(ne):
            raise GGUFError(f"{self.path}: tensor {name!r} has shape {info.ne}, expected {tuple(ne)}")
        return info


class _Progress:
    """A one-line progress bar on stderr for uploads above a size threshold."""

    def __init__(self, total: int, label: str, enabled: bool):
        self.total, self.label, self.enabled = total, label, enabled and total > 0
        self.done, self.t0, self.last = 0, time.monotonic(), 0.0

    def update(self, n: int) -> None:
        self.done += n
        now = time.monotonic()
        if self.enabled and (now - self.last > 0.2 or self.done >= self.total):
            self.last = now
            frac = self.done / self.total
            rate = self.done / max(now - self.t0, 1e-9) / 2**20
            bar = "#" * int(30 * frac)
            print(f"\r{self.label} [{bar:<30}] {frac:6.1%} {self.done / 2**30:.2f}/{self.total / 2**30:.2f} GiB "
                  f"{rate:7.0f} MiB/s", end="", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.enabled:
            print(file=sys.stderr)


def upload(gf: GGUFFile, pairs: list[tuple[TensorInfo, ggml.Tensor]], *, chunk_bytes: int = 64 << 20,
           progress: bool | None = None) -> None:
    """Copy tensors from the file into allocated device tensors, in chunks of at most `chunk_bytes`."""
    total = sum(info.nbytes for info, _ in pairs)
    bar = _Progress(total, f"loading {os.path.basename(gf.path)}",
                    total >= (1 << 30) if progress is None else progress)
    for info, tensor in pairs:
        raw = gf.data(info)
        if raw.nbytes != info.nbytes:
            raise GGUFError(f"{gf.path}: tensor {info.name} is truncated")
        for start in range(0, info.nbytes, chunk_bytes):
            piece = raw[start: start + chunk_bytes]
            tensor.set_bytes(piece, start)
            bar.update(piece.nbytes)
    bar.close()
