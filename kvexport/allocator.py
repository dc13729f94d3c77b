"""Freed memory handed back to the OS while a long step runs.

glibc keeps freed allocations below its mmap threshold (a tensor of up to 32 MB, once a larger
one has been freed) in its heap, and a heap interleaved with live tensors cannot shrink: a step
that frees many such tensors while it makes others (a load converting weights, a quantization
replacing them) holds the freed ones too, and the process's peak with them. ``malloc_trim``
returns every free page of every arena."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.cache
def _malloc_trim():
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):  # not glibc (macOS, musl)
        return None


def return_freed_memory() -> None:
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
