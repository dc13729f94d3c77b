"""One BLAS thread on the calling thread while an ExecuTorch method runs a call of several tokens.

ExecuTorch's LLM kernels (``llama::custom_sdpa``) make their matrix products through BLAS from
inside ExecuTorch's threadpool, which already splits the work over its threads, the calling
thread among them. In the pip wheels that BLAS is the MKL linked into libtorch, which opens an
OpenMP team of its own in every call: more threads than cores, and an attention call of several
query rows (a speculative verification, a prefill) many times slower than a one-row one.
``one_blas_thread`` sets the calling thread's MKL count to one for such a call and gives it back
after (eager transformers in the same process keeps torch's). Only the calling thread's: MKL's
default, which the pool's workers use, is left alone, since changing it (even back again) slowed
one-token calls (docs/performance.md#one-blas-thread).

The setter is the symbol libtorch exports, ``mkl_set_num_threads_local``, whose exported name is
MKL's Fortran interface (its argument by reference); where it is missing (a torch built without
MKL), nothing is changed.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
from pathlib import Path


@functools.cache
def _mkl() -> ctypes.CDLL | None:
    """libtorch's MKL, or None without it."""
    import torch

    library = Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"
    try:
        mkl = ctypes.CDLL(str(library))  # already loaded by torch: this is a handle to it
        mkl.mkl_set_num_threads_local.restype = ctypes.c_int
    except (OSError, AttributeError):
        return None
    return mkl


@contextlib.contextmanager
def one_blas_thread():
    """MKL runs one thread on the calling thread while the block runs; its count is restored after."""
    mkl = _mkl()
    if mkl is None:
        yield
        return
    previous = mkl.mkl_set_num_threads_local(ctypes.byref(ctypes.c_int(1)))
    try:
        yield
    finally:
        mkl.mkl_set_num_threads_local(ctypes.byref(ctypes.c_int(previous)))
