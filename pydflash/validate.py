"""Load-time checks of untrusted model files, run before any of their numbers reach native code.

ggml and llama.cpp assert (abort the process) or read out of bounds on inputs they do not expect; every such
condition that a file or a parameter can trigger is checked here first and reported as a Python error naming
the file, the key or tensor, what was found and what was expected.

- metadata readers (`meta_int`, `meta_float`, `meta_ints`, `meta_str`): typed, finite and in range;
- tensor roles: an architecture declares each tensor's shape and role (`TensorSpec`, docs/targets.md:
  embedding, output, matrix, norm, bias, vector, conv) and `check_tensors` holds the file to it: every tensor
  present with its shape and a type allowed for its role (`ROLE_TYPES`), and no tensor the model would not use
  (llama.cpp refuses those too: a wrong block_count would drop layers); `check_finite`: the small f32 ones;
- `check_tokenizer`: the vocabulary metadata llama.cpp's loader trusts;
- `check_memory`: the allocation plan against the device's memory, before anything is allocated.
"""
from __future__ import annotations

import math
import re

from . import ggml

REQUIRED = object()

# bounds on header sizes: far above any real model, low enough that nothing sized from them hangs or overflows
MAX_LAYERS = 1024
MAX_SIZE = 1 << 20          # any width, head count or head size
MAX_CTX_TRAIN = 1 << 40     # context_length (only caps the default max_ctx and feeds the rope)

# --- allow-lists per tensor role ---------------------------------------------------------------------------------
# A new ggml type is an explicit decision: add it here once the graph can compute it in that role.

_WEIGHT_QUANTS = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ2_XXS",
                  "IQ2_XS", "IQ3_XXS", "IQ1_S", "IQ4_NL", "IQ3_S", "IQ2_S", "IQ4_XS", "IQ1_M", "TQ1_0", "TQ2_0",
                  "MXFP4", "NVFP4")


def _types(*names) -> frozenset:
    return frozenset(getattr(ggml.Type, n) for n in names if hasattr(ggml.Type, n))


ROLE_TYPES = {
    # the weight operand of mul_mat (a weight matrix, the LM head): float and llama.cpp's weight quantisations
    # (mixes such as UD-Q4_K_XL put Q5_K/Q6_K/Q8_0/IQ4 on some matrices); whether this backend multiplies a type
    # is probed as well
    "matrix": _types("F32", "F16", "BF16", *_WEIGHT_QUANTS),
    "output": _types("F32", "F16", "BF16", *_WEIGHT_QUANTS),
    # the source of get_rows (token embeddings): any weight type with a dequantiser
    "embedding": _types("F32", "F16", "BF16", *_WEIGHT_QUANTS),
    # elementwise operands next to f32 activations (norm weights, biases, ssm_a): ggml's binary ops want f32
    # here, and llama.cpp's quantiser keeps them f32
    "norm": _types("F32"),
    "bias": _types("F32"),
    "vector": _types("F32"),
    # the kernel of ssm_conv (f32 only in ggml; llama.cpp keeps ssm_conv1d f32)
    "conv": _types("F32"),
}
SMALL_F32_ROLES = ("norm", "bias", "vector")   # read whole at load by check_finite (a few MB on a 27B model)
_MULTIPLIED = ("matrix", "output")              # roles whose tensor is the weight operand of mul_mat


def check_tensors(gf, specs: dict, *, error=None, backend=None) -> list:
    """Hold a GGUF's tensor table to a model's expectation; returns the TensorInfos of the tensors present, in
    `specs` order.

    specs: name -> TensorSpec(ne, role, optional) (pydflash/models/runtime.py) of every tensor the model reads;
    an optional tensor may be absent. A tied LM head (no `output.weight`) makes `token_embd.weight` play the
    'output' role too. backend: if given, each (role, type) pair is probed with a one-node graph on it (no
    allocation)."""
    error = error or _gguf_error()
    extra = sorted(set(gf.tensors) - set(specs))
    if extra:
        more = f" and {len(extra) - 5} more" if len(extra) > 5 else ""
        raise error(f"{gf.path}: {len(extra)} tensors the model does not use ({', '.join(extra[:5])}{more}); "
                    f"is block_count ({len(specs)} tensors expected) right?")
    tied = "output.weight" in specs and "output.weight" not in gf.tensors
    infos, probes = [], {}
    for name, spec in specs.items():
        info = gf.tensors.get(name)
        if info is None:
            if spec.optional:
                continue
            raise error(f"{gf.path}: missing tensor {name!r}")
        if tuple(info.ne) != tuple(spec.ne):
            raise error(f"{gf.path}: tensor {name!r} has shape {info.ne}, expected {tuple(spec.ne)}")
        roles = (spec.role, "output") if tied and name == "token_embd.weight" else (spec.role,)
        for role in roles:
            if info.type not in ROLE_TYPES[role]:
                allowed = ", ".join(sorted(t.name for t in ROLE_TYPES[role]))
                raise error(f"{gf.path}: tensor {name!r} is {info.type.name}, which {_a(role)} cannot be; "
                            f"expected one of {allowed}")
            probes.setdefault((role, info.type, info.ne[0]), name)
        infos.append(info)
    if backend is not None:
        for (role, type_, ne0), name in probes.items():
            if not _backend_computes(backend, role, type_, ne0):
                raise error(f"{gf.path}: tensor {name!r} is {type_.name}, which {backend.name} cannot use as "
                            f"{_a(role)}")
    return infos


def _a(role: str) -> str:
    return ("an " if role[0] in "aeiou" else "a ") + role


def _backend_computes(backend, role: str, type_, ne0: int) -> bool:
    """Whether the backend runs the op a tensor of this role feeds (a graph node only: nothing is allocated)."""
    if role not in (*_MULTIPLIED, "embedding"):
        return True   # f32 elementwise operands: every backend computes them
    ctx = ggml.Context(n_tensors=4)
    try:
        w = ctx.new_tensor(type_, (ne0, 2))
        if role in _MULTIPLIED:
            node = ctx.mul_mat(w, ctx.new_tensor(ggml.Type.F32, (ne0, 1)))
        else:
            node = ctx.get_rows(w, ctx.new_tensor(ggml.Type.I32, (1,)))
        return backend.supports(node)
    finally:
        ctx.close()


def check_finite(gf, infos, *, error=None) -> None:
    """The small f32 tensors (norm weights, ssm_a, dt bias: a few MB on a 27B model) hold finite values: a NaN
    there makes every logit NaN and the argmax token 0 forever. Matrices are not read (that would cost a pass
    over the weights)."""
    import numpy as np
    error = error or _gguf_error()
    for info in infos:
        if info.type == ggml.Type.F32:
            values = np.frombuffer(gf.data(info), dtype="<f4")
            if not np.isfinite(values).all():
                bad = int(np.flatnonzero(~np.isfinite(values))[0])
                raise error(f"{gf.path}: tensor {info.name!r} holds {values[bad]} at index {bad}: expected "
                            f"finite values")


def _gguf_error():
    from .gguf_io import GGUFError
    return GGUFError


# --- typed metadata ----------------------------------------------------------------------------------------------

def _describe(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _lookup(gf, key, default, error):
    """(value, check it?): a default is checked like a stored value (it may be derived from other keys), except
    None, which means "absent"."""
    value = gf.metadata.get(key)
    if value is None:
        if default is REQUIRED:
            raise error(f"{gf.path}: missing metadata key {key!r}")
        return default, default is not None
    return value, True


def meta_int(gf, key: str, lo: int, hi: int, default=REQUIRED, *, error=None) -> int:
    """An integer metadata value in lo..hi (a bool, float, string or list is refused, not converted)."""
    error = error or _gguf_error()
    value, found = _lookup(gf, key, default, error)
    if not found:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise error(f"{gf.path}: {key} = {_describe(value)}: expected an integer")
    if not lo <= value <= hi:
        raise error(f"{gf.path}: {key} = {value} is out of range: expected {lo}..{hi}")
    return value


def meta_float(gf, key: str, lo: float, hi: float, default=REQUIRED, *, error=None) -> float:
    """A finite number in the open interval (lo, hi)."""
    error = error or _gguf_error()
    value, found = _lookup(gf, key, default, error)
    if not found:
        return default
    return check_float(f"{gf.path}: {key}", value, lo, hi, error)


def check_float(what: str, value, lo: float, hi: float, error) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise error(f"{what} = {_describe(value)}: expected a number")
    value = float(value)
    if not math.isfinite(value) or not lo < value < hi:
        raise error(f"{what} = {value} is out of range: expected a finite number in ({lo:g}, {hi:g})")
    return value


def meta_ints(gf, key: str, lo: int, hi: int, *, max_len: int, default=REQUIRED, error=None) -> list:
    """A list of integers (bools count as 0/1) each in lo..hi, at most max_len long."""
    error = error or _gguf_error()
    value, found = _lookup(gf, key, default, error)
    if not found:
        return default
    if not isinstance(value, list) or len(value) > max_len:
        raise error(f"{gf.path}: {key} = {_describe(value)}: expected a list of at most {max_len} integers")
    for i, v in enumerate(value):
        if not isinstance(v, int) or not lo <= v <= hi:
            raise error(f"{gf.path}: {key}[{i}] = {_describe(v)}: expected an integer in {lo}..{hi}")
    return [int(v) for v in value]


def meta_str(gf, key: str, default=REQUIRED, *, choices=None, max_len: int = 1 << 20, error=None) -> str:
    error = error or _gguf_error()
    value, found = _lookup(gf, key, default, error)
    if not found:
        return default
    if not isinstance(value, str) or len(value) > max_len:
        raise error(f"{gf.path}: {key} = {_describe(value)}: expected a string of at most {max_len} characters")
    if choices is not None and value not in choices:
        raise error(f"{gf.path}: {key} = {value!r} is not supported: expected one of {sorted(choices)}")
    return value


def vocab_rows(gf, *, error=None) -> int:
    """The vocabulary size: the rows of `token_embd.weight` (2 dimensions, 1..2^31-1 rows: token ids are i32)."""
    error = error or _gguf_error()
    emb = gf.tensors.get("token_embd.weight")
    if emb is None:
        raise error(f"{gf.path}: missing tensor 'token_embd.weight'")
    if len(emb.ne) != 2 or not 1 <= emb.ne[1] < 1 << 31:
        raise error(f"{gf.path}: tensor 'token_embd.weight' has shape {emb.ne}, expected [n_embd, n_vocab]")
    return int(emb.ne[1])


# --- tokenizer metadata ------------------------------------------------------------------------------------------

TOKENIZER_MODELS = {"gpt2", "llama"}   # byte-level BPE (llama, qwen) and SentencePiece (gemma3)
MAX_TOKEN_BYTES = 1 << 16
MAX_TEMPLATE_CHARS = 1 << 20
_TOKEN_TYPE_SET = frozenset(range(0, 7))   # llama_token_type: UNDEFINED..BYTE
_BAD_MERGE = re.compile("(?:^|\0) ?[^ \0]*(?:\0|$)")    # a merge with no space after its first character
_SPECIAL_ID_KEYS = ("bos", "eos", "eot", "eom", "unknown", "seperator", "padding", "cls", "mask", "fim_pre",
                    "fim_suf", "fim_mid", "fim_pad", "fim_rep", "fim_sep")


def check_tokenizer(gf, n_vocab: int, *, error=None) -> None:
    """The vocabulary metadata that llama.cpp's loader trusts (it aborts, or fails later out of bounds, on each
    of these): model kind, one unique NUL-free string per row of the embedding, token types, merges, special
    token ids, and a chat template that is a string of bounded length."""
    error = error or _gguf_error()
    meta_str(gf, "tokenizer.ggml.model", choices=TOKENIZER_MODELS, error=error)
    tokens = gf.metadata.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens):
        raise error(f"{gf.path}: tokenizer.ggml.tokens is missing or not a list of strings")
    if len(tokens) != n_vocab:
        raise error(f"{gf.path}: tokenizer.ggml.tokens has {len(tokens)} entries, expected {n_vocab} "
                    f"(the rows of token_embd.weight)")
    # whole-list operations first (a 248K-token vocabulary is checked in milliseconds); a loop only to name
    # the offending entry once one is known to exist
    if not all(tokens) or "\0" in "".join(tokens) or max(map(len, tokens)) > MAX_TOKEN_BYTES:
        i = next(i for i, t in enumerate(tokens) if not t or "\0" in t or len(t) > MAX_TOKEN_BYTES)
        raise error(f"{gf.path}: tokenizer.ggml.tokens[{i}] = {_describe(tokens[i])}: expected a non-empty "
                    f"string without NUL of at most {MAX_TOKEN_BYTES} characters")
    if len(set(tokens)) != len(tokens):
        seen: dict[str, int] = {}
        i = next(i for i, t in enumerate(tokens) if seen.setdefault(t, i) != i)
        raise error(f"{gf.path}: tokenizer.ggml.tokens[{i}] = {_describe(tokens[i])} duplicates entry "
                    f"{seen[tokens[i]]}")
    types = gf.metadata.get("tokenizer.ggml.token_type")
    if types is not None:
        if not isinstance(types, list) or len(types) != n_vocab:
            raise error(f"{gf.path}: tokenizer.ggml.token_type has {_len(types)} entries, expected {n_vocab}")
        if not set(types) <= _TOKEN_TYPE_SET or any(type(v) is bool for v in set(types)):
            bad = next(i for i, v in enumerate(types) if type(v) is bool or v not in _TOKEN_TYPE_SET)
            raise error(f"{gf.path}: tokenizer.ggml.token_type[{bad}] = {_describe(types[bad])}: expected 0..6")
    scores = gf.metadata.get("tokenizer.ggml.scores")   # SentencePiece: llama.cpp reads one per token, unchecked
    if scores is not None and (not isinstance(scores, list) or len(scores) != n_vocab
                               or not all(type(v) is float and math.isfinite(v) for v in scores)):
        raise error(f"{gf.path}: tokenizer.ggml.scores: expected {n_vocab} finite numbers, got "
                    f"{_len(scores)} entries")
    if gf.metadata.get("tokenizer.ggml.model") == "llama":
        # SentencePiece: llama.cpp's tokenizer spells a piece it cannot merge byte by byte, through "<0xXX>" (or
        # the byte itself) -- a byte with neither aborts the process in the middle of tokenizing
        present = set(tokens)
        missing = [b for b in range(256) if f"<0x{b:02X}>" not in present and not (b < 128 and chr(b) in present)]
        if missing:
            raise error(f"{gf.path}: SentencePiece vocabulary without byte-fallback tokens: no '<0x{missing[0]:02X}>' "
                        f"(and {len(missing) - 1} more bytes); llama.cpp needs one per byte")
    merges = gf.metadata.get("tokenizer.ggml.merges")
    if merges is not None:
        # llama.cpp splits each merge at its first space after the first character: a merge without one
        # (optionally after a leading space) is refused, as is one holding NUL (the separator below)
        joined = "\0".join(merges) if isinstance(merges, list) and all(type(m) is str for m in merges) else None
        if joined is None or _BAD_MERGE.search(joined) or joined.count("\0") != len(merges) - 1:
            i = next((i for i, m in enumerate(merges or [None]) if type(m) is not str or "\0" in m
                      or m.find(" ", 1) < 1), 0) if isinstance(merges, list) else 0
            shown = _describe(merges[i]) if isinstance(merges, list) and merges else _describe(merges)
            raise error(f"{gf.path}: tokenizer.ggml.merges[{i}] = {shown}: expected 'left right'")
    for name in _SPECIAL_ID_KEYS:
        meta_int(gf, f"tokenizer.ggml.{name}_token_id", 0, n_vocab - 1, None, error=error)
    meta_str(gf, "tokenizer.chat_template", None, max_len=MAX_TEMPLATE_CHARS, error=error)


def _len(value) -> str:
    return str(len(value)) if isinstance(value, list) else "no list of"


# --- memory plan -------------------------------------------------------------------------------------------------

def check_memory(backend, plan: dict, what: str, *, error=MemoryError) -> None:
    """Refuse an allocation plan (name -> bytes) larger than the device before anything is allocated: a
    damaged header could otherwise ask for terabytes, or exhaust the host while other work runs there."""
    total = sum(plan.values())
    free, capacity = device_memory(backend)
    # a GPU reports what is free now; the CPU's free count excludes reclaimable page cache, so use its total
    limit = capacity if backend.is_cpu else free
    if limit and total > limit:
        parts = ", ".join(f"{k} {v / 2**30:.2f} GiB" for k, v in sorted(plan.items(), key=lambda kv: -kv[1])[:4])
        raise error(f"{what} needs {total / 2**30:.2f} GiB ({parts}), more than {backend.name} has "
                    f"({limit / 2**30:.2f} GiB {'in all' if backend.is_cpu else 'free'})")


def device_memory(backend) -> tuple[int, int]:
    """(free, total) bytes of a backend's device."""
    from .ggml.core import ffi, lib
    free, total = ffi.new("size_t *"), ffi.new("size_t *")
    lib.ggml_backend_dev_memory(backend._dev, free, total)
    return int(free[0]), int(total[0])


def tensor_bytes(type_, ne) -> int:
    """Bytes of a tensor in exact arithmetic (ggml's own size_t product wraps for absurd shapes)."""
    blck = ggml.block_size(type_)
    n_rows = math.prod(ne[1:])
    return ggml.row_size(type_, blck) * (-(-ne[0] // blck)) * n_rows


# --- API parameters ----------------------------------------------------------------------------------------------

def int_param(name: str, value, lo: int, hi: int) -> int:
    """An integer parameter in lo..hi: a bool, float (even 512.0 or NaN), string or None is refused."""
    import numbers
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} = {_describe(value)}: expected an integer")
    if not lo <= int(value) <= hi:
        raise ValueError(f"{name} = {value} is out of range: expected {lo}..{hi}")
    return int(value)


def choice_param(name: str, value, choices) -> str:
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name} = {_describe(value)}: expected one of {', '.join(map(repr, choices))}")
    return value


def token_ids(name: str, value, n_vocab: int) -> list[int]:
    """A non-empty sequence of token ids in 0..n_vocab-1: bytes, floats or strings are refused, not cast."""
    import numbers
    if isinstance(value, (str, bytes, bytearray, memoryview)) or not hasattr(value, "__iter__"):
        raise TypeError(f"{name}: expected text (str) or a list of token ids, got {type(value).__name__}")
    ids = list(value)
    if not ids:
        raise ValueError(f"{name} is empty")
    for i, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, numbers.Integral):
            raise TypeError(f"{name}[{i}] = {_describe(t)}: expected an integer token id")
        if not 0 <= int(t) < n_vocab:
            raise ValueError(f"{name}[{i}] = {t} is not a token id: expected 0..{n_vocab - 1}")
    return [int(t) for t in ids]
