"""The 1:1 layer: cffi ABI-mode declarations generated at build time, and the loaded libraries.

Private to pydflash.ggml; nothing else imports cffi objects.
"""
from __future__ import annotations

import os
from pathlib import Path

import cffi

# Must equal GGML_EXT_ABI_VERSION in ggml_ext/include/ggml-ext.h of the libraries we load.
EXT_ABI_VERSION = 20

_PKG = Path(__file__).resolve().parent.parent
LIB_DIR = Path(os.environ.get("PYDFLASH_LIB_DIR", _PKG / "lib"))
_CDEF = Path(__file__).resolve().parent / "_cdef.h"


class BuildMissingError(ImportError):
    """pydflash's compiled ggml is not where the package expects it."""


def _quiet_aborts() -> None:
    """ggml's abort handler forks and execs gdb (or lldb) to attach to the dying process where one is installed:
    in a notebook or a server that stalls, and two threads aborting at once have deadlocked there. It reads
    GGML_NO_BACKTRACE at abort time; set it (for llama-cpp-python's ggml in this process too) unless the user
    asks for backtraces with PYDFLASH_GGML_BACKTRACE=1. The abort message itself is still printed."""
    if os.environ.get("PYDFLASH_GGML_BACKTRACE") != "1":
        os.environ.setdefault("GGML_NO_BACKTRACE", "1")


def _load():
    _quiet_aborts()
    lib_path = LIB_DIR / "libpydflash-ggml.so"
    if not _CDEF.is_file() or not lib_path.is_file():
        raise BuildMissingError(
            f"pydflash's ggml build is missing ({_CDEF.name} or {lib_path}). Install the package with "
            f"`pip install .` (which compiles it) rather than importing it from a source checkout."
        )
    ffi = cffi.FFI()
    ffi.cdef(_CDEF.read_text())
    # RTLD_LOCAL: our ggml must never be bound in place of llama-cpp-python's (or the reverse); the libraries
    # also carry unique SONAMEs, so the dynamic linker cannot confuse them.
    lib = ffi.dlopen(str(lib_path), os.RTLD_NOW | os.RTLD_LOCAL)
    found = lib.ggml_ext_abi_version()
    if found != EXT_ABI_VERSION:
        raise BuildMissingError(
            f"{lib_path} has ggml_ext ABI {found}, this pydflash expects {EXT_ABI_VERSION}: reinstall pydflash"
        )
    if os.environ.get("PYDFLASH_GGML_DEBUG") != "1":
        # ggml's default logger prints its debug lines too, on CUDA one per decode step ("CUDA Graph id N
        # reused"): keep info, warnings and errors only, unless PYDFLASH_GGML_DEBUG=1 asks for everything
        lib.ggml_log_set(lib.ggml_ext_log_no_debug, ffi.NULL)
    return ffi, lib


ffi, lib = _load()
