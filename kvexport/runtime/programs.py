"""Running an artifact's program: one ``forward(tokens, start) -> logits`` whatever the target.

Logits come back as a float32 numpy vector (the last position's). Each target's module is
imported only when used, so an ONNX folder runs without torch installed.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Protocol

import numpy as np

from ..artifact.manifest import Manifest, read_manifest
from ..errors import KvexportError


class Program(Protocol):
    manifest: Manifest

    def forward(self, tokens: list[int], start: int) -> np.ndarray: ...

    # An artifact exported with --max-draft-tokens: every position's logits [T, vocab].
    def verify(self, tokens: list[int], start: int) -> np.ndarray: ...

    def reset(self) -> None: ...


_RUNNERS = {"executorch": "executorch_program", "onnx": "onnx_program"}
# The package each target runs on (ExecuTorch's Python runtime brings torch).
_RUNTIME_PACKAGE = {"executorch": "executorch", "onnx": "onnxruntime"}


def load_program(folder: Path, manifest: Manifest | None = None, device: str = "cpu", runner: str = "kvexport") -> Program:
    """``runner``: ``kvexport`` (this package's runner for the artifact's target) or ``genai``
    (onnxruntime-genai, ONNX artifacts)."""
    folder = Path(folder)
    manifest = manifest or read_manifest(folder)
    target = manifest.target
    if runner == "genai":
        from . import genai_program

        return genai_program.load(folder, manifest, device)
    module = importlib.import_module(f"{__package__}.{_RUNNERS[target]}")
    try:
        return module.load(folder, manifest, device)
    except ModuleNotFoundError as e:  # a device that has only the other target's runtime
        if (e.name or "").split(".")[0] not in ("torch", "executorch", "onnxruntime"):
            raise
        package = _RUNTIME_PACKAGE[target]
        version = manifest.version(package)
        raise KvexportError(
            f"this {target} artifact needs {package} to run ({e.name} is not installed): "
            f"pip install {package}{'==' + version if version else ''}"
        )
