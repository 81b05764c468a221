"""Layer pieces shared by the model graphs. `linear` is the one entry point of every weight matmul."""
from __future__ import annotations

import os

from ..ggml import QMATMUL_MAX_COLS, QMATMUL_TYPES, Context, Tensor, qmatmul
from ..ggml._ffi import ffi, lib

# PYDFLASH_QMATMUL=0 sends every weight matmul to ggml's mul_mat (for side-by-side measurements); read at import.
USE_QMATMUL = os.environ.get("PYDFLASH_QMATMUL", "1") != "0"


def _on_device(w: Tensor) -> bool:
    """True when the weight lives in a buffer that is not host memory (a GPU backend's)."""
    ptr = w._ptr
    while ptr.view_src != ffi.NULL:
        ptr = ptr.view_src
    return ptr.buffer != ffi.NULL and not lib.ggml_backend_buffer_is_host(ptr.buffer)


def linear(ctx: Context, w: Tensor, x: Tensor) -> Tensor:
    """w [K, M] times x [K, N] -> [M, N]. Quantised weights on a GPU with 1..48 columns go through our own
    kernel (ggml_qmatmul: every column's result is bit-identical whatever N is, so a tree verify reproduces
    token-by-token decode exactly); everything else through ggml's mul_mat. The weight must already be
    allocated when the graph is built (model weights always are)."""
    if (USE_QMATMUL and w.type in QMATMUL_TYPES and w.ne[2:] == (1, 1) and x.ne[2:] == (1, 1) and 1 <= x.ne[1] <= QMATMUL_MAX_COLS
            and x.type.name == "F32" and x.nb[0] == 4 and w.is_contiguous and _on_device(w)):
        return qmatmul(ctx, w, x)
    return ctx.mul_mat(w, x)
