"""Silence third-party chatter that says nothing about the user's job. Standard library only, so
the device runner uses it too."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import warnings

# Set (to anything but "" or "0") by --verbose: third-party output is left as it is.
VERBOSE_ENV = "KVEXPORT_VERBOSE"


def verbose() -> bool:
    return os.environ.get(VERBOSE_ENV, "") not in ("", "0")


def quiet() -> None:
    """Import-time noise (torchao's optional CUDA kernels failing to load on a CPU machine, torch's
    pytree deprecation notices, torch.onnx's registry missing torchvision) and export-time notices
    that are expected."""
    # torch.onnx's op registry reports torchvision's ops missing (kvexport exports no vision op).
    for name in ("torchao", "torch.utils._pytree", "torch.onnx._internal.exporter._registration"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    # ExecuTorch notes that mutated buffers start uninitialized: by design, the masks never read a
    # cache slot before it is written.
    warnings.filterwarnings("ignore", message="Mutation on a buffer in the model is detected")


@contextlib.contextmanager
def native_stderr_quiet():
    """Send file descriptor 2 to /dev/null while a native library starts (ExecuTorch prints its CPU
    probe's log lines there when a program loads), unless ``--verbose``: C++ writes past Python's
    ``sys.stderr``, so only the descriptor can be muted. Python's own errors are raised after it."""
    if verbose():
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


@contextlib.contextmanager
def transformers_progress_quiet():
    """No "Loading weights" bar from transformers while a model loads (the export's own step line
    says what loads), unless ``--verbose``. Its switch is huggingface_hub's too (a download's
    bars), so it is put back afterwards."""
    if verbose():
        yield
        return
    from transformers.utils import logging as transformers_logging

    was_on = transformers_logging.is_progress_bar_enabled()
    transformers_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            transformers_logging.enable_progress_bar()
