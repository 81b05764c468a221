"""The thin owning layer over ggml: backends, contexts, tensors, graphs, allocators.

Every object here frees what it allocates, raises Python errors instead of letting ggml abort where the input
can be checked first, and hands out only these wrappers, never cffi objects. Any ggml graph op is reachable as
a method of Context (`ctx.mul_mat(a, b)` calls `ggml_mul_mat(ctx, a, b)`), with arguments converted from the
generated signature, so new upstream ops need no wrapper code.
"""
from __future__ import annotations

import enum
import os
from typing import Iterable, Sequence

import numpy as np

from ._ffi import ffi, lib

Type = enum.IntEnum(
    "Type",
    {k[len("GGML_TYPE_"):]: v for k, v in ffi.typeof("enum ggml_type").relements.items() if k != "GGML_TYPE_COUNT"},
)
Type.__doc__ = "ggml tensor types (GGML_TYPE_*), generated from the headers."

Op = enum.IntEnum(
    "Op", {k[len("GGML_OP_"):]: v for k, v in ffi.typeof("enum ggml_op").relements.items() if k != "GGML_OP_COUNT"}
)
Op.__doc__ = "ggml ops (GGML_OP_*), including pydflash's own."

_NUMPY_OF_TYPE = {Type.F32: np.float32, Type.F16: np.float16, Type.I32: np.int32, Type.I16: np.int16,
                  Type.I8: np.int8, Type.F64: np.float64, Type.I64: np.int64}
_TYPE_OF_NUMPY = {np.dtype(v): k for k, v in _NUMPY_OF_TYPE.items()}
_DTYPE_OF_RAW_TYPE = {int(k): np.dtype(v) for k, v in _NUMPY_OF_TYPE.items()}   # (Tensor.set, once per input a step)

_TENSOR_PTR = ffi.typeof("struct ggml_tensor *")
_CONTEXT_PTR = ffi.typeof("struct ggml_context *")

# Resolved now, not lazily in __del__: cffi resolves a library symbol under a non-reentrant lock, and a
# garbage collection that runs a destructor while that lock is held (inside any ffi.new/typeof) deadlocks.
_FREE_CONTEXT = lib.ggml_free
_FREE_BACKEND = lib.ggml_backend_free
_FREE_BUFFER = lib.ggml_backend_buffer_free
_FREE_GALLOCR = lib.ggml_gallocr_free
_FREE_EVENT = lib.ggml_backend_event_free


class GGMLError(RuntimeError):
    """A ggml call failed, or would have aborted the process on the given input."""


def type_of(dtype) -> Type:
    """The ggml type of a numpy dtype (float32, float16, int32, ...)."""
    try:
        return _TYPE_OF_NUMPY[np.dtype(dtype)]
    except KeyError:
        raise TypeError(f"no ggml type for numpy dtype {np.dtype(dtype)}") from None


def block_size(type_: Type) -> int:
    """Values per block of a type (1 for plain float types): quantised rows are whole blocks."""
    return lib.ggml_blck_size(type_)


def row_size(type_: Type, n: int) -> int:
    """Bytes of a row of n values of a (possibly quantised) type."""
    if n % block_size(type_):
        raise ValueError(f"{Type(type_).name} rows must be a multiple of {block_size(type_)}, not {n}")
    return lib.ggml_row_size(type_, n)


def quantize(type_: Type, values: np.ndarray) -> np.ndarray:
    """Quantise float32 rows (last axis) with ggml's own quantiser; returns the raw blocks as uint8."""
    values = np.ascontiguousarray(values, dtype=np.float32)
    n_per_row = values.shape[-1]
    n_rows = values.size // n_per_row
    out = np.empty(n_rows * row_size(type_, n_per_row), dtype=np.uint8)
    lib.ggml_quantize_init(type_)
    if lib.ggml_quantize_requires_imatrix(type_):
        raise ValueError(f"{Type(type_).name} needs an importance matrix")
    lib.ggml_quantize_chunk(type_, ffi.from_buffer("float[]", values), ffi.from_buffer(out), 0, n_rows,
                            n_per_row, ffi.NULL)
    return out.reshape(values.shape[:-1] + (-1,))


# --- devices and backends --------------------------------------------------------------------------------------

def devices() -> list[dict]:
    """The devices this build can use: [{'name', 'description', 'kind', 'memory_total'}]."""
    out = []
    kinds = {lib.GGML_BACKEND_DEVICE_TYPE_CPU: "cpu", lib.GGML_BACKEND_DEVICE_TYPE_GPU: "gpu",
             lib.GGML_BACKEND_DEVICE_TYPE_IGPU: "igpu", lib.GGML_BACKEND_DEVICE_TYPE_ACCEL: "accel"}
    for i in range(lib.ggml_backend_dev_count()):
        dev = lib.ggml_backend_dev_get(i)
        free, total = ffi.new("size_t *"), ffi.new("size_t *")
        lib.ggml_backend_dev_memory(dev, free, total)
        out.append({"name": ffi.string(lib.ggml_backend_dev_name(dev)).decode(),
                    "description": ffi.string(lib.ggml_backend_dev_description(dev)).decode(),
                    "kind": kinds.get(lib.ggml_backend_dev_type(dev), "other"), "memory_total": total[0]})
    return out


def _find_device(spec: str):
    spec = spec.strip().lower()
    if spec == "cpu":
        return lib.ggml_backend_dev_by_type(lib.GGML_BACKEND_DEVICE_TYPE_CPU)
    if spec == "auto":
        gpu = lib.ggml_backend_dev_by_type(lib.GGML_BACKEND_DEVICE_TYPE_GPU)
        return gpu if gpu != ffi.NULL else lib.ggml_backend_dev_by_type(lib.GGML_BACKEND_DEVICE_TYPE_CPU)
    if spec == "cuda" or spec.startswith("cuda:"):
        index = spec.partition(":")[2] or "0"
        if not index.isdigit():
            raise ValueError(f"device {spec!r}: expected cuda:N with N a number")
        dev = lib.ggml_backend_dev_by_name(f"CUDA{index}".encode())
        if dev == ffi.NULL:
            have = [d["name"] for d in devices()]
            hint = ("" if any(n.startswith("CUDA") for n in have) else
                    " pydflash was built without CUDA: reinstall with PYDFLASH_CUDA=1 (or CMAKE_ARGS=-DGGML_CUDA=on).")
            raise ValueError(f"device {spec!r} not found; this build has {have}.{hint}")
        return dev
    raise ValueError(f"unknown device {spec!r}: use 'auto', 'cpu', 'cuda' or 'cuda:N'")


class Backend:
    """One compute device (`cpu`, `cuda`, `cuda:N` or `auto`: the first GPU, else the CPU)."""

    def __init__(self, device: str = "auto", n_threads: int | None = None):
        dev = _find_device(device)
        self._ptr = lib.ggml_backend_dev_init(dev, ffi.NULL)
        if self._ptr == ffi.NULL:
            raise GGMLError(f"could not initialise device {device!r}")
        self.name = ffi.string(lib.ggml_backend_name(self._ptr)).decode()
        self.is_cpu = lib.ggml_backend_dev_type(dev) == lib.GGML_BACKEND_DEVICE_TYPE_CPU
        self._dev = dev
        if self.is_cpu:
            self.set_n_threads(n_threads or len(os.sched_getaffinity(0)))

    def set_n_threads(self, n: int) -> None:
        if not self.is_cpu:
            raise ValueError(f"{self.name} has no thread count")
        lib.ggml_backend_cpu_set_n_threads(self._ptr, n)

    def memory(self) -> tuple[int, int]:
        """(free, total) bytes of this device, as its backend reports them now."""
        free, total = ffi.new("size_t *"), ffi.new("size_t *")
        lib.ggml_backend_dev_memory(self._dev, free, total)
        return int(free[0]), int(total[0])

    def supports(self, tensor: "Tensor") -> bool:
        """Whether this backend can compute the op that produces `tensor`."""
        return bool(lib.ggml_backend_dev_supports_op(self._dev, tensor._ptr))

    def alloc_tensors(self, ctx: "Context") -> "Buffer":
        """Allocate every tensor of a no-alloc context in one device buffer (weights, caches)."""
        ptr = lib.ggml_backend_alloc_ctx_tensors(ctx._ptr, self._ptr)
        if ptr == ffi.NULL:
            raise GGMLError(f"{self.name}: could not allocate {ctx.n_tensors()} tensors (out of memory?)")
        return Buffer(ptr, ctx)

    def compute(self, graph: "Graph") -> None:
        """Run a graph that an Allocator of this backend has allocated; returns when it is done."""
        self._check_allocated(graph)
        status = lib.ggml_backend_graph_compute(self._ptr, graph._ptr)
        if status != lib.GGML_STATUS_SUCCESS:
            raise GGMLError(f"{self.name}: graph compute failed with status {status}")

    def compute_async(self, graph: "Graph") -> None:
        """Queue a graph on this backend's stream and return at once (the CPU computes it before returning).
        Results are ready after `synchronize`, or after an Event recorded behind it."""
        self._check_allocated(graph)
        status = lib.ggml_backend_graph_compute_async(self._ptr, graph._ptr)
        if status != lib.GGML_STATUS_SUCCESS:
            raise GGMLError(f"{self.name}: graph compute failed with status {status}")

    def _check_allocated(self, graph: "Graph") -> None:
        if graph._allocator is None or graph._allocator._current is not graph:
            raise GGMLError("graph is not allocated (or its allocator has since allocated another graph)")
        if graph._allocator.backend is not self:
            raise GGMLError(f"graph was allocated for {graph._allocator.backend.name}, not {self.name}")

    def synchronize(self) -> None:
        lib.ggml_backend_synchronize(self._ptr)

    def event(self) -> "Event | None":
        """A new event of this device, or None where the backend has none (the CPU: its work is done on return)."""
        ptr = lib.ggml_backend_event_new(self._dev)
        return None if ptr == ffi.NULL else Event(ptr, self)

    def close(self) -> None:
        if getattr(self, "_ptr", ffi.NULL) != ffi.NULL:
            _FREE_BACKEND(self._ptr)
            self._ptr = ffi.NULL

    __del__ = close

    def __repr__(self) -> str:
        return f"Backend({self.name})"


class Event:
    """A point in a backend's stream: `record` marks it behind the work queued so far, `synchronize` waits for it."""

    def __init__(self, ptr, backend: Backend):
        self._ptr, self._backend = ptr, backend

    def record(self) -> None:
        lib.ggml_backend_event_record(self._ptr, self._backend._ptr)

    def synchronize(self) -> None:
        lib.ggml_backend_event_synchronize(self._ptr)

    def close(self) -> None:
        if getattr(self, "_ptr", ffi.NULL) != ffi.NULL:
            _FREE_EVENT(self._ptr)
            self._ptr = ffi.NULL

    __del__ = close


class HostBuffer:
    """Host memory for a backend's asynchronous copies: page-locked where the device offers it (CUDA), so that a
    queued copy neither waits for the stream nor stages through the driver; plain memory otherwise (the CPU copies
    at once). `array` is its bytes; a queued copy reads or writes them when the stream reaches it, so the caller
    must not touch a region again before the work behind it is done (an Event)."""

    def __init__(self, backend: Backend, nbytes: int):
        self._backend, self._ptr = backend, ffi.NULL
        buft = lib.ggml_backend_dev_host_buffer_type(backend._dev)
        if buft != ffi.NULL:
            self._ptr = lib.ggml_backend_buft_alloc_buffer(buft, nbytes)
        if self._ptr != ffi.NULL:
            self._base = ffi.cast("char *", lib.ggml_backend_buffer_get_base(self._ptr))
            self.array = np.frombuffer(ffi.buffer(self._base, nbytes), dtype=np.uint8)
        else:
            self.array = np.zeros(nbytes, dtype=np.uint8)
            self._base = ffi.cast("char *", ffi.from_buffer(self.array))
        self.pinned = self._ptr != ffi.NULL

    def upload(self, tensor: "Tensor", offset: int, nbytes: int) -> None:
        """Queue a copy of bytes [offset, offset + nbytes) of this buffer into all of `tensor`."""
        tensor._check_io(nbytes, "upload")
        lib.ggml_backend_tensor_set_async(self._backend._ptr, tensor._ptr, self._base + offset, 0, nbytes)

    def download(self, tensor: "Tensor", offset: int) -> None:
        """Queue a copy of all of `tensor` into this buffer at `offset`."""
        tensor._check_io(tensor.nbytes, "download")
        lib.ggml_backend_tensor_get_async(self._backend._ptr, tensor._ptr, self._base + offset, 0, tensor.nbytes)

    def close(self) -> None:
        if getattr(self, "_ptr", ffi.NULL) != ffi.NULL:
            self.array = None
            _FREE_BUFFER(self._ptr)
            self._ptr = ffi.NULL

    __del__ = close


class Readback:
    """A device tensor copied into page-locked memory behind the work queued on a backend, and waited for later:
    `queue(t)` queues the copy and an event behind it, `wait()` waits for that event (a backend without events:
    for everything) and returns the bytes, a view valid until the next `queue`. One copy at a time."""

    def __init__(self, backend: Backend):
        self._backend = backend
        self._host: HostBuffer | None = None
        self._done: Event | None = None
        self._nbytes = 0

    def queue(self, tensor: "Tensor") -> None:
        if self._host is None or self._host.array.nbytes < tensor.nbytes:
            self._host = HostBuffer(self._backend, max(tensor.nbytes, 1024))
            self._done = self._backend.event()
        self._host.download(tensor, 0)
        self._nbytes = tensor.nbytes
        if self._done is not None:
            self._done.record()

    def wait(self) -> np.ndarray:
        if self._done is not None:
            self._done.synchronize()
        else:   # (the CPU copied when it was asked to)
            self._backend.synchronize()
        return self._host.array[:self._nbytes]


class InputBlock:
    """Graph inputs side by side in one device buffer of their own, written through a host mirror (page-locked
    where the device has it) and uploaded in one queued copy: one host-to-device call per compute instead of one
    per input (each ~5-8 us of an H100 host's time; docs/benchmarks.md, twenty-fifth session).

    `tensors` are new tensors of a graph's no-alloc context, before the graph is first allocated: placed here,
    the graph's allocator leaves them alone, so their values stay from one compute to the next, and so do the
    mirror's: write only what changed (`block[name]`: the tensor's numpy view, shaped ne[::-1]), then `upload()`.
    A view waits, when taken, for the last upload's copy to have read the mirror."""

    ALIGN = 256

    def __init__(self, backend: Backend, tensors: dict[str, "Tensor"]):
        offsets, end = {}, 0
        for name, t in tensors.items():
            if _NUMPY_OF_TYPE.get(t.type) is None:
                raise TypeError(f"InputBlock input {name} is {t.type.name}: numpy-typed inputs only")
            offsets[name] = end
            end += -(-t.nbytes // self.ALIGN) * self.ALIGN
        self._ctx = Context(n_tensors=1)
        self._whole = self._ctx.new_tensor(Type.I8, (end,), name="input_block")
        self._buffer = backend.alloc_tensors(self._ctx)
        self._host = HostBuffer(backend, end)
        self._views = {}
        for name, t in tensors.items():
            self._buffer.alias(t, self._whole, offsets[name])
            raw = self._host.array[offsets[name]: offsets[name] + t.nbytes]
            self._views[name] = raw.view(_NUMPY_OF_TYPE[t.type]).reshape(t.shape[::-1])
        self._host.array[:] = 0
        self._copied = backend.event()     # (None on the CPU: its copies are done on return)
        self._pending = False

    def __getitem__(self, name: str) -> np.ndarray:
        if self._pending:
            self._copied.synchronize()
            self._pending = False
        return self._views[name]

    def upload(self) -> None:
        """Queue the copy of the whole mirror into the device buffer (ordered before the backend's next compute)."""
        self._host.upload(self._whole, 0, self._whole.nbytes)
        if self._copied is not None:
            self._copied.record()
            self._pending = True


class Buffer:
    """A device buffer holding the tensors of one context; freed with it."""

    def __init__(self, ptr, ctx: "Context"):
        self._ptr = ptr
        self._ctx = ctx  # tensors point into this buffer: keep their metadata alive as long as it

    @property
    def nbytes(self) -> int:
        return lib.ggml_backend_buffer_get_size(self._ptr)

    def clear(self, value: int = 0) -> None:
        lib.ggml_backend_buffer_clear(self._ptr, value)

    def alias(self, tensor: "Tensor", of: "Tensor", offset: int = 0) -> "Tensor":
        """Place `tensor` (a fresh tensor of a no-alloc context) on the bytes of `of`, a tensor of this buffer, from
        byte `offset` on: the same memory under another type and shape (e.g. quantized rows seen as 32-bit words,
        moved bit for bit by get_rows/set_rows), or a part of it. Unlike a view, the alias is a leaf of the graphs
        that read it (no VIEW node between it and its consumer). It may not reach past the end of `of`."""
        if tensor.is_allocated:
            raise GGMLError(f"tensor {tensor.name or '?'} already has memory")
        if of._ptr.buffer != self._ptr or of._ptr.data == ffi.NULL:
            raise GGMLError(f"tensor {of.name or '?'} is not in this buffer")
        if offset < 0 or offset + tensor.nbytes > of.nbytes:
            raise GGMLError(f"alias {tensor.name or '?'} ({tensor.nbytes} bytes at {offset}) does not fit in "
                            f"{of.name or '?'} ({of.nbytes} bytes)")
        status = lib.ggml_backend_tensor_alloc(self._ptr, tensor._ptr, ffi.cast("char *", of._ptr.data) + offset)
        if status != lib.GGML_STATUS_SUCCESS:
            raise GGMLError(f"could not place {tensor.name or '?'} on {of.name or '?'} (status {status})")
        return tensor

    def alias_slices(self, ctx: "Context", whole: "Tensor", ne: tuple, names) -> list["Tensor"]:
        """One new tensor of `ctx` (ne, whole's type) per name, placed on consecutive equal slices of `whole` in
        order (e.g. the per-layer tensors of an all-layer one, sliced along its last axis), each by `alias`."""
        step = whole.nbytes // len(names)
        return [self.alias(ctx.new_tensor(whole.type, ne, name=name), whole, i * step) for i, name in enumerate(names)]

    def close(self) -> None:
        if getattr(self, "_ptr", ffi.NULL) != ffi.NULL:
            _FREE_BUFFER(self._ptr)
            self._ptr = ffi.NULL

    __del__ = close


# --- contexts and tensors --------------------------------------------------------------------------------------

class Tensor:
    """A ggml tensor. Shapes are in ggml order: `ne[0]` is the contiguous (fastest) dimension."""

    __slots__ = ("_ptr", "_ctx")

    def __init__(self, ptr, ctx: "Context"):
        self._ptr = ptr
        self._ctx = ctx

    @property
    def type(self) -> Type:
        return Type(self._ptr.type)

    @property
    def ne(self) -> tuple[int, int, int, int]:
        return tuple(self._ptr.ne)

    @property
    def shape(self) -> tuple[int, ...]:
        """ne without trailing 1s (at least one dimension)."""
        return self.ne[: max(1, lib.ggml_n_dims(self._ptr))]

    @property
    def nb(self) -> tuple[int, int, int, int]:
        return tuple(self._ptr.nb)

    @property
    def nbytes(self) -> int:
        return lib.ggml_nbytes(self._ptr)

    @property
    def op(self) -> Op:
        return Op(self._ptr.op)

    @property
    def src(self) -> tuple["Tensor", ...]:
        """The op's operands (what a graph node reads), in ggml's order."""
        out = []
        for p in self._ptr.src:
            if p == ffi.NULL:
                break
            out.append(Tensor(p, self._ctx))
        return tuple(out)

    @property
    def name(self) -> str:
        return ffi.string(self._ptr.name).decode()

    @name.setter
    def name(self, value: str) -> None:
        lib.ggml_set_name(self._ptr, value.encode()[:63])

    def named(self, value: str) -> "Tensor":
        self.name = value
        return self

    def mark_input(self) -> "Tensor":
        """Flag as a graph input, so the allocator gives it memory before the graph's first node runs. (Its memory
        may serve later nodes once the nodes reading it ran: set it before every compute, or use mark_constant.)"""
        lib.ggml_set_input(self._ptr)
        return self

    def mark_constant(self) -> "Tensor":
        """Flag as a graph input whose values stay from one compute to the next (set once): also an output, which
        the allocator never hands to a later node."""
        lib.ggml_set_input(self._ptr)
        lib.ggml_set_output(self._ptr)
        return self

    @property
    def is_contiguous(self) -> bool:
        return bool(lib.ggml_is_contiguous(self._ptr))

    @property
    def is_allocated(self) -> bool:
        return self._ptr.buffer != ffi.NULL or self._ptr.data != ffi.NULL

    def _check_io(self, nbytes: int, what: str) -> None:
        if self._ptr.buffer == ffi.NULL:
            raise GGMLError(f"tensor {self.name or '?'} has no device memory yet (allocate it first)")
        if not lib.ggml_is_contiguous(self._ptr):
            raise GGMLError(f"tensor {self.name or '?'} is not contiguous; {what} needs a contiguous tensor")
        if nbytes != self.nbytes:
            raise ValueError(f"tensor {self.name or '?'} ({self.type.name} {self.ne}) holds {self.nbytes} bytes, "
                             f"got {nbytes}")

    def set(self, data, backend: "Backend | None" = None) -> None:
        """Copy host data in: an array of the tensor's own numpy dtype, or raw bytes of a quantised type.

        With `backend` (the one that computes the graphs reading this tensor) the copy is queued on its stream
        instead of waited for: ordered before that backend's next compute, and no synchronisation per input in
        the decode loop. `data` may be reused on return: CUDA stages pageable host memory before returning, and
        a backend without asynchronous copies copies synchronously."""
        arr = np.ascontiguousarray(data)
        expected = _DTYPE_OF_RAW_TYPE.get(self._ptr.type)
        if expected is not None and arr.dtype != expected:
            raise TypeError(f"tensor {self.name or '?'} is {self.type.name}; got a {arr.dtype} array")
        if expected is None and arr.dtype != np.uint8:
            raise TypeError(f"tensor {self.name or '?'} is {self.type.name}: pass its raw blocks as uint8")
        self._check_io(arr.nbytes, "set")
        if backend is None:
            lib.ggml_backend_tensor_set(self._ptr, ffi.from_buffer(arr), 0, arr.nbytes)
        else:
            lib.ggml_backend_tensor_set_async(backend._ptr, self._ptr, ffi.from_buffer(arr), 0, arr.nbytes)

    def set_bytes(self, data, offset: int = 0) -> None:
        """Copy raw bytes into the tensor's memory at a byte offset (chunked uploads, partial row writes)."""
        buf = memoryview(data).cast("B")
        if self._ptr.buffer == ffi.NULL:
            raise GGMLError(f"tensor {self.name or '?'} has no device memory yet (allocate it first)")
        if offset < 0 or offset + buf.nbytes > self.nbytes:
            raise ValueError(f"tensor {self.name or '?'}: bytes [{offset}, {offset + buf.nbytes}) outside its "
                             f"{self.nbytes} bytes")
        lib.ggml_backend_tensor_set(self._ptr, ffi.from_buffer(buf), offset, buf.nbytes)

    def accumulate_f32(self) -> "Tensor":
        """Ask the op that makes this tensor (mul_mat, flash_attn_ext) to accumulate in f32."""
        if not lib.ggml_prec_set_acc(self._ptr, lib.GGML_PREC_F32):
            raise GGMLError(f"{self.op.name} cannot be set to accumulate in f32")
        return self

    def hint_src0_hadamard(self) -> "Tensor":
        """Tell a mul_mat that its first operand is a Walsh-Hadamard matrix (backends may use a fast transform)."""
        lib.ggml_mul_mat_set_hint(self._ptr, lib.GGML_HINT_SRC0_IS_HADAMARD)
        return self

    def copy_to(self, dst: "Tensor") -> None:
        """Copy this tensor's data into `dst` (same type and shape); between two tensors of one device it stays
        on the device (no host round trip)."""
        if self.type != dst.type or self.ne != dst.ne:
            raise ValueError(f"copy {self.name or '?'} ({self.type.name} {self.ne}) into {dst.name or '?'} "
                             f"({dst.type.name} {dst.ne}): type and shape must match")
        if not (self.is_allocated and dst.is_allocated):
            raise GGMLError("copy between tensors that have no data yet")
        lib.ggml_backend_tensor_copy(self._ptr, dst._ptr)

    def numpy(self) -> np.ndarray:
        """Copy out to a new array shaped ne[::-1] (C order); raw uint8 rows for quantised types."""
        self._check_io(self.nbytes, "numpy")
        dtype = _NUMPY_OF_TYPE.get(self.type)
        if dtype is None:
            shape = self.ne[::-1][:-1] + (self.nb[1],)
            dtype = np.uint8
        else:
            shape = self.ne[::-1]
        out = np.empty(shape, dtype=dtype)
        lib.ggml_backend_tensor_get(self._ptr, ffi.from_buffer(out), 0, out.nbytes)
        n_dims = len(self.shape)
        return out.reshape(out.shape[4 - n_dims:]) if dtype is not np.uint8 else out

    def __repr__(self) -> str:
        return f"Tensor({self.name!r}, {self.type.name}, ne={self.ne}, op={self.op.name})"


def _c_arg(value, ctype):
    """Convert one Python argument to the C type of a ggml function parameter."""
    if ctype is _TENSOR_PTR:
        if value is None:
            return ffi.NULL
        if not isinstance(value, Tensor):
            raise TypeError(f"expected a Tensor, got {type(value).__name__}")
        return value._ptr
    if ctype.kind == "pointer" and isinstance(value, (list, tuple, np.ndarray)):
        return ffi.new(f"{ctype.item.cname}[]", list(value))
    if ctype.kind == "enum" and isinstance(value, enum.Enum):
        return int(value)
    return value


class Context:
    """A ggml context holding tensor metadata (never data: `no_alloc`), for weights, caches or one graph."""

    _ops: dict[str, object] = {}

    def __init__(self, n_tensors: int, graph_size: int = 0):
        size = n_tensors * lib.ggml_tensor_overhead()
        if graph_size:
            size += lib.ggml_graph_overhead_custom(graph_size, False)
        params = ffi.new("struct ggml_init_params *", {"mem_size": size, "mem_buffer": ffi.NULL, "no_alloc": True})
        self._ptr = lib.ggml_init(params[0])
        if self._ptr == ffi.NULL:
            raise GGMLError("ggml_init failed")
        self.graph_size = graph_size

    def n_tensors(self) -> int:
        n, t = 0, lib.ggml_get_first_tensor(self._ptr)
        while t != ffi.NULL:
            n, t = n + 1, lib.ggml_get_next_tensor(self._ptr, t)
        return n

    def new_tensor(self, type_: Type | np.dtype | type, ne: Sequence[int], name: str | None = None) -> Tensor:
        """A new tensor of shape `ne` (ggml order, 1 to 4 dims)."""
        if not isinstance(type_, (Type, int)):
            type_ = type_of(type_)
        if not 1 <= len(ne) <= 4 or any(int(n) < 1 for n in ne):
            raise ValueError(f"bad shape {tuple(ne)}: 1 to 4 positive sizes expected")
        row_size(type_, int(ne[0]))  # rejects rows that do not fill whole blocks
        dims = ffi.new("int64_t[]", [int(n) for n in ne])
        ptr = lib.ggml_new_tensor(self._ptr, type_, len(ne), dims)
        t = Tensor(ptr, self)
        if name:
            t.name = name
        return t

    def tensors(self) -> Iterable[Tensor]:
        t = lib.ggml_get_first_tensor(self._ptr)
        while t != ffi.NULL:
            yield Tensor(t, self)
            t = lib.ggml_get_next_tensor(self._ptr, t)

    def graph(self, outputs: Tensor | Sequence[Tensor]) -> "Graph":
        """The forward graph that computes `outputs` (in this context; needs graph_size set)."""
        if not self.graph_size:
            raise GGMLError("this context was made without room for a graph (graph_size=0)")
        return Graph(self, [outputs] if isinstance(outputs, Tensor) else list(outputs))

    def __getattr__(self, name: str):
        fn = Context._ops.get(name)
        if fn is None:
            try:
                cfn = getattr(lib, "ggml_" + name)
            except AttributeError:
                raise AttributeError(f"ggml has no op ggml_{name}") from None
            ftype = ffi.typeof(cfn)
            if ftype.kind != "function" or not ftype.args or ftype.args[0] is not _CONTEXT_PTR:
                raise AttributeError(f"ggml_{name} is not a graph op (it does not take a context)")
            fn = Context._ops[name] = (cfn, ftype.args[1:], ftype.result is _TENSOR_PTR)
        cfn, arg_types, returns_tensor = fn

        def call(*args):
            if len(args) != len(arg_types):
                raise TypeError(f"ggml_{name} takes {len(arg_types)} arguments after the context, got {len(args)}")
            out = cfn(self._ptr, *[_c_arg(a, t) for a, t in zip(args, arg_types)])
            return Tensor(out, self) if returns_tensor else out

        return call

    def close(self) -> None:
        if getattr(self, "_ptr", ffi.NULL) != ffi.NULL:
            _FREE_CONTEXT(self._ptr)
            self._ptr = ffi.NULL

    __del__ = close


class Graph:
    """A forward compute graph; allocate it with an Allocator, then run it with Backend.compute."""

    def __init__(self, ctx: Context, outputs: list[Tensor]):
        self._ctx = ctx
        self._ptr = lib.ggml_new_graph_custom(ctx._ptr, ctx.graph_size, False)
        for out in outputs:
            lib.ggml_set_output(out._ptr)
            lib.ggml_build_forward_expand(self._ptr, out._ptr)
        self.outputs = outputs
        self._allocator: Allocator | None = None
        self._supported_on: Backend | None = None   # the backend every node was checked against
        self._placed: list | None = None   # tensors the allocator gives addresses (set at first allocation)

    @property
    def uid(self) -> int:
        """Renewed by every allocation; backends skip re-checking a graph whose uid they have seen (0: never)."""
        return int(lib.ggml_ext_graph_uid(self._ptr))

    @property
    def n_nodes(self) -> int:
        return lib.ggml_graph_n_nodes(self._ptr)

    def nodes(self) -> list[Tensor]:
        return [Tensor(lib.ggml_graph_node(self._ptr, i), self._ctx) for i in range(self.n_nodes)]


class Allocator:
    """Places graph tensors in one reusable compute buffer of a backend.

    Allocating a graph invalidates the previous one allocated here: set a graph's inputs after allocating it.
    """

    def __init__(self, backend: Backend):
        self.backend = backend
        self._ptr = lib.ggml_gallocr_new(lib.ggml_backend_get_default_buffer_type(backend._ptr))
        self._current: Graph | None = None

    def allocate(self, graph: Graph) -> None:
        # ggml would run an op the backend cannot do and abort the process mid-graph; refuse it here instead,
        # once per graph and backend (a graph is re-allocated whenever another one used the buffer in between)
        if graph._supported_on is not self.backend:
            for node in graph.nodes():
                if not lib.ggml_backend_supports_op(self.backend._ptr, node._ptr):
                    raise GGMLError(f"{self.backend.name} cannot compute node {node.name or '?'} ({node.op.name}, "
                                    f"{node.type.name} {node.shape}) with these shapes/types")
            graph._supported_on = self.backend
        # gallocr places only tensors whose data is NULL and treats the rest as allocated elsewhere: a graph
        # allocated before still holds its old addresses, which dangle once another graph has grown the
        # buffer. Forget the addresses of the tensors it placed last time, so it places them again.
        if graph._placed is None:
            graph._placed = [t._ptr for t in graph._ctx.tensors() if t._ptr.data == ffi.NULL]
        else:
            for ptr in graph._placed:
                ptr.data = ffi.NULL
                ptr.buffer = ffi.NULL
        if not lib.ggml_gallocr_alloc_graph(self._ptr, graph._ptr):
            raise GGMLError(f"{self.backend.name}: could not allocate the graph's compute buffer")
        # addresses may have moved: a new uid makes the CUDA backend check the graph once, then replay it
        # without a per-node comparison on every compute
        lib.ggml_ext_graph_renew_uid(graph._ptr)
        graph._allocator = self
        self._current = graph

    @property
    def current(self) -> Graph | None:
        """The graph allocated last (the only one whose tensors are valid now)."""
        return self._current

    @property
    def nbytes(self) -> int:
        return lib.ggml_gallocr_get_buffer_size(self._ptr, 0)

    def close(self) -> None:
        if getattr(self, "_ptr", ffi.NULL) != ffi.NULL:
            _FREE_GALLOCR(self._ptr)
            self._ptr = ffi.NULL

    __del__ = close
