"""Running an artifact's program: one ``forward(tokens, start) -> logits`` whatever the target.

Logits come back as a float32 numpy vector (the last position's). Each target's module is
imported only when used, so an ONNX folder runs without torch installed.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Protocol

import numpy as np

from ..exporter.artifact import read_manifest


class Program(Protocol):
    manifest: dict

    def forward(self, tokens: list[int], start: int) -> np.ndarray: ...

    def reset(self) -> None: ...


_RUNNERS = {"executorch": "executorch_program", "onnx": "onnx_program"}


def load_program(folder: Path, manifest: dict | None = None, device: str = "cpu") -> Program:
    folder = Path(folder)
    manifest = manifest or read_manifest(folder)
    module = importlib.import_module(f"{__package__}.{_RUNNERS[manifest['target']]}")
    return module.load(folder, manifest, device)
