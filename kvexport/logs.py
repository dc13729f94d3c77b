"""Silence third-party chatter that says nothing about the user's job. Standard library only, so
the device runner uses it too."""

from __future__ import annotations

import logging
import warnings


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
