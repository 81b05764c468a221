"""GGUF files → device tensors: a checked reader and a chunked uploader with a progress bar.

The file is memory-mapped and parsed here (gguf-py's reader is slow on 248K-token vocabularies); nothing is copied on the host except the chunk being uploaded.
Every header field is treated as untrusted: sizes, offsets and shapes are checked against the file before any
allocation, and each problem is reported with the file's name.
"""
from __future__ import annotations

import os
import stat
import struct
import sys
import time
from dataclasses import dataclass

import numpy as np

from . import ggml

GGUF_MAGIC = b"GGUF"
GGML_MAX_DIMS = 4
GGML_MAX_NAME = 64         # ggml tensor names hold 63 bytes and a NUL (llama.cpp refuses longer ones)
MAX_KEY_BYTES = 1 << 16    # metadata keys are short dotted names; this only bounds a damaged file
MAX_ELEMENTS = (1 << 63) - 1   # ggml counts elements in int64

# GGUF metadata value types: id -> (name, numpy dtype for fixed-size scalars)
_SCALARS = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
            7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9
_STRUCT = {np.dtype(t): struct.Struct("<" + c) for t, c in zip(
    (np.uint8, np.int8, np.uint16, np.int16, np.uint32, np.int32, np.float32, np.bool_, np.uint64, np.int64,
     np.float64), "BbHhIif?Qqd")}
_U64 = _STRUCT[np.dtype(np.uint64)]


_TYPE_NAMES = {0: "uint8", 1: "int8", 2: "uint16", 3: "int16", 4: "uint32", 5: "int32", 6: "float32", 7: "bool",
               8: "string", 9: "array", 10: "uint64", 11: "int64", 12: "float64"}


class GGUFError(ValueError):
    """A GGUF file is unreadable, truncated, of the wrong architecture, or lacks what the model needs."""


def regular_file_size(path: str) -> int:
    """The size of a regular file; anything else (a FIFO, a device such as /dev/zero, a folder) would block or
    never end when read, so it is refused before it is opened."""
    st = os.stat(path)
    if not stat.S_ISREG(st.st_mode):
        raise OSError("not a regular file")
    return st.st_size


def _nbytes(type_: ggml.Type, ne: tuple) -> int | None:
    """Bytes of a tensor in exact integer arithmetic (ggml's size_t product would wrap); None when the first
    dimension is not a whole number of blocks."""
    blck = ggml.block_size(type_)
    if blck < 1 or ne[0] % blck:
        return None
    return ggml.row_size(type_, blck) * (ne[0] // blck) * int(np.prod(ne[1:], dtype=object))


@dataclass(frozen=True)
class TensorInfo:
    name: str
    type: ggml.Type
    ne: tuple            # ggml order
    offset: int          # absolute byte offset of the data in the file
    nbytes: int


class _Cursor:
    """Reads little-endian GGUF fields from a memory map, refusing to step past its end."""

    def __init__(self, buf, path: str):
        self.buf, self.pos, self.path, self.size = buf, 0, path, len(buf)
        self.view = memoryview(buf).cast("B") if len(buf) else memoryview(b"")

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            raise GGUFError(f"{self.path}: truncated or damaged header: {what} needs {n} bytes at offset "
                            f"{self.pos}, the file has {self.size}")

    def scalar(self, dtype, what: str):
        fmt = _STRUCT[np.dtype(dtype)]
        self.need(fmt.size, what)
        value = fmt.unpack_from(self.view, self.pos)[0]
        self.pos += fmt.size
        return value

    def string(self, what: str, *, max_bytes: int | None = None, strict: bool = False) -> str:
        """A length-prefixed string. strict: it must be valid UTF-8 (keys and tensor names, which are compared
        and must not collide after a replacement character)."""
        self.need(8, what)
        n = _U64.unpack_from(self.view, self.pos)[0]
        if max_bytes is not None and n > max_bytes:
            raise GGUFError(f"{self.path}: damaged header: {what} is {n} bytes long, at most {max_bytes} expected")
        self.pos += 8
        self.need(n, what)
        raw = self.view[self.pos: self.pos + n].tobytes()
        self.pos += n
        try:
            return raw.decode("utf-8", errors="strict" if strict else "replace")
        except UnicodeDecodeError:
            raise GGUFError(f"{self.path}: damaged header: {what} at offset {self.pos - n} is not valid UTF-8") \
                from None

    def value(self, vtype: int, what: str):
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype], what)
        if vtype == _STRING:
            return self.string(what)
        if vtype == _ARRAY:
            etype = self.scalar(np.uint32, what)
            count = self.scalar(np.uint64, what)
            if etype in _SCALARS:
                dtype = np.dtype(_SCALARS[etype]).newbyteorder("<")
                self.need(count * dtype.itemsize, what)
                arr = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos)
                self.pos += count * dtype.itemsize
                return arr.tolist()
            if etype == _STRING:
                self.need(8 * count, what)   # every string has at least its length field
                return [self.string(what) for _ in range(count)]
            raise GGUFError(f"{self.path}: {what}: unsupported array element type {etype}")
        raise GGUFError(f"{self.path}: {what}: unknown metadata value type {vtype}")


class GGUFFile:
    """The metadata and tensor table of one GGUF file (memory-mapped), validated against its size."""

    def __init__(self, path):
        self.path = os.fspath(path)
        try:
            self.size = regular_file_size(self.path)
            self._mm = np.memmap(self.path, dtype=np.uint8, mode="r") if self.size else np.zeros(0, np.uint8)
        except OSError as e:
            raise GGUFError(f"{self.path}: cannot open ({e.strerror or e})") from None
        cur = _Cursor(self._mm, self.path)
        if self.size < 24 or bytes(self._mm[:4]) != GGUF_MAGIC:
            raise GGUFError(f"{self.path}: not a GGUF file (bad magic or shorter than a header)")
        cur.pos = 4
        self.version = cur.scalar(np.uint32, "version")
        if self.version not in (2, 3):
            raise GGUFError(f"{self.path}: damaged GGUF header (unsupported version {self.version})")
        n_tensors = cur.scalar(np.uint64, "tensor count")
        n_kv = cur.scalar(np.uint64, "metadata count")
        # each metadata entry takes >= 12 bytes and each tensor entry >= 24: absurd counts fail before any loop
        if n_kv * 12 + n_tensors * 24 > self.size:
            raise GGUFError(f"{self.path}: damaged GGUF header ({n_kv} metadata entries and {n_tensors} tensors "
                            f"cannot fit in {self.size} bytes)")
        self.metadata: dict[str, object] = {}
        self.value_types: dict[str, int] = {}   # key -> GGUF value type id (arrays: 9)
        for i in range(n_kv):
            key = cur.string(f"metadata key {i}", max_bytes=MAX_KEY_BYTES, strict=True)
            if key in self.metadata:
                raise GGUFError(f"{self.path}: duplicate metadata key {key!r}")
            vtype = cur.scalar(np.uint32, key)
            self.metadata[key] = cur.value(vtype, key)
            self.value_types[key] = vtype
        infos = []
        seen = set()
        for i in range(n_tensors):
            name = cur.string(f"tensor name {i}", max_bytes=GGML_MAX_NAME - 1, strict=True)
            if name in seen:
                raise GGUFError(f"{self.path}: duplicate tensor {name!r}")
            seen.add(name)
            n_dims = cur.scalar(np.uint32, name)
            if not 1 <= n_dims <= GGML_MAX_DIMS:
                raise GGUFError(f"{self.path}: tensor {name} has {n_dims} dimensions, expected 1..{GGML_MAX_DIMS}")
            ne = tuple(cur.scalar(np.uint64, name) for _ in range(n_dims))
            type_id = cur.scalar(np.uint32, name)
            offset = cur.scalar(np.uint64, name)
            infos.append((name, ne, type_id, offset))
        alignment = self.metadata.get("general.alignment", 32)
        if "general.alignment" in self.metadata and self.value_types["general.alignment"] != 4:
            found = _TYPE_NAMES.get(self.value_types["general.alignment"])
            raise GGUFError(f"{self.path}: general.alignment is a {found}, expected a uint32")
        if alignment <= 0 or alignment & (alignment - 1):
            raise GGUFError(f"{self.path}: general.alignment {alignment} is not a power of two")
        data_start = -(-cur.pos // alignment) * alignment
        self.tensors: dict[str, TensorInfo] = {}
        expected_offset = 0
        for name, ne, type_id, offset in infos:
            try:
                type_ = ggml.Type(type_id)
            except ValueError:
                raise GGUFError(f"{self.path}: tensor {name} has unknown ggml type id {type_id}") from None
            if any(n < 1 for n in ne):
                raise GGUFError(f"{self.path}: tensor {name} has an empty dimension {ne}")
            n_elements = int(np.prod(ne, dtype=object))
            if n_elements > MAX_ELEMENTS:
                raise GGUFError(f"{self.path}: tensor {name} shape {ne} has more elements than ggml can count")
            nbytes = _nbytes(type_, ne)
            if nbytes is None:
                raise GGUFError(f"{self.path}: tensor {name}: a {type_.name} row holds whole blocks of "
                                f"{ggml.block_size(type_)} values, its first dimension is {ne[0]}")
            # llama.cpp's reader wants the data in table order, each tensor padded to the alignment: no gaps,
            # no overlaps, no two names for one block of bytes
            if offset != expected_offset:
                raise GGUFError(f"{self.path}: tensor {name} data offset {offset}, expected {expected_offset} "
                                f"(tensor data must follow the table order without gaps or overlaps)")
            expected_offset += -(-nbytes // alignment) * alignment
            start = data_start + offset
            if start + nbytes > self.size:
                raise GGUFError(f"{self.path}: truncated: tensor {name} needs bytes up to {start + nbytes}, "
                                f"the file has {self.size}")
            self.tensors[name] = TensorInfo(name, type_, ne, start, nbytes)

    # --- metadata ---

    def get(self, key: str, default=None):
        """A metadata value (a Python scalar, string or list); `default` when absent."""
        return self.metadata.get(key, default)

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
        return self._mm[info.offset: info.offset + info.nbytes]

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
           progress: bool | None = None, row_orders: dict[str, np.ndarray] | None = None) -> None:
    """Copy tensors from the file into allocated device tensors, in chunks of at most `chunk_bytes`.
    row_orders: tensor name -> the file's row for each of the device tensor's rows (a permutation)."""
    total = sum(info.nbytes for info, _ in pairs)
    bar = _Progress(total, f"loading {os.path.basename(gf.path)}",
                    total >= (1 << 30) if progress is None else progress)
    for info, tensor in pairs:
        raw = gf.data(info)
        if raw.nbytes != info.nbytes:
            raise GGUFError(f"{gf.path}: tensor {info.name} is truncated")
        order = (row_orders or {}).get(info.name)
        if order is not None:
            rows = int(np.prod(info.ne[1:]))
            if not np.array_equal(np.sort(order), np.arange(rows)):
                raise ValueError(f"{info.name}: the row order is not a permutation of its {rows} rows")
            raw = np.ascontiguousarray(raw.reshape(rows, -1)[order]).reshape(-1)
        for start in range(0, info.nbytes, chunk_bytes):
            piece = raw[start: start + chunk_bytes]
            tensor.set_bytes(piece, start)
            bar.update(piece.nbytes)
    bar.close()
