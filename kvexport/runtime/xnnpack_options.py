"""XNNPACK's runtime options in ExecuTorch, set through ExecuTorch's C++ API.

XNNPACK packs each weight for its kernels when a method loads. A `.pte` exported with
``--max-draft-tokens`` has two methods, ``forward`` and ``verify``, whose delegates name the same
weights: without XNNPACK's weight cache each method packs its own copy, and speculative decoding
holds the packed weights twice. With the cache (``weight_cache_enabled``), a weight packed once is
found by name and shared; a program's packed weights are freed with it. The packing, and so every
result, is the same. The option is read as each delegate loads, so a program can be loaded with it
off (``executorch_program``: bfloat16 programs, whose delegates crash the runtime as they load with it on).

ExecuTorch's runtime has the option (``executorch::runtime::set_option("XnnpackBackend", ...)``,
process-wide, read as each delegate loads) but its Python bindings do not expose it, hence ctypes on
the runtime's own library. A ``BackendOption`` is ``{char key[64]; std::variant<bool, int,
std::array<char, 256>> value;}`` (``include/executorch/runtime/backend/options.h`` in the wheel); a
``Span`` of them passes as a pointer and a length. Where the symbol is missing or the option does not
read back as set (another ExecuTorch), nothing changes: the methods pack their own copies, as before.
"""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path

_SET_OPTION = "_ZN10executorch7runtime10set_optionEPKcNS0_4SpanINS0_13BackendOptionEEE"
_GET_OPTION = "_ZN10executorch7runtime10get_optionEPKcNS0_4SpanINS0_13BackendOptionEEE"
_BACKEND = b"XnnpackBackend"
WEIGHT_CACHE = "weight_cache_enabled"


class _BackendOption(ctypes.Structure):
    # The variant's storage (its largest alternative: 256 chars), its index (0 = bool), and the
    # padding to the variant's alignment (an int's).
    _fields_ = [("key", ctypes.c_char * 64), ("value", ctypes.c_ubyte * 256), ("index", ctypes.c_ubyte), ("_pad", ctypes.c_ubyte * 3)]


@cache
def _functions():
    """ExecuTorch's ``set_option`` and ``get_option`` from the loaded runtime, or None."""
    import executorch

    for folder in executorch.__path__:
        try:
            library = ctypes.CDLL(str(Path(folder) / "lib" / "libexecutorch.so"))
            functions = getattr(library, _SET_OPTION), getattr(library, _GET_OPTION)
        except (OSError, AttributeError):
            continue
        for function in functions:
            function.restype = ctypes.c_uint32  # executorch::runtime::Error, 0 = Ok
            function.argtypes = [ctypes.c_char_p, ctypes.POINTER(_BackendOption), ctypes.c_size_t]
        return functions
    return None


def _bool_option(key: str, value: bool = False) -> _BackendOption:
    option = _BackendOption()
    option.key = key.encode()
    option.value[0] = int(value)
    option.index = 0
    return option


def get_bool(key: str) -> bool | None:
    """XNNPACK's boolean option ``key`` as the runtime has it; None where it cannot be read."""
    functions = _functions()
    if functions is None:
        return None
    option = _bool_option(key)
    if functions[1](_BACKEND, ctypes.byref(option), 1) != 0 or option.index != 0:
        return None
    return bool(option.value[0])


def set_bool(key: str, value: bool) -> bool:
    """Set XNNPACK's boolean option ``key`` for the delegates loaded from now on; whether the runtime
    now has it. Call after ExecuTorch's runtime is imported (``executorch_program.import_runtime``)."""
    functions = _functions()
    if functions is None:
        return False
    if functions[0](_BACKEND, ctypes.byref(_bool_option(key, value)), 1) != 0:
        return False
    return get_bool(key) is value
