"""Runs ``model.pte`` with ExecuTorch's Python runtime (``executorch.runtime``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..errors import ArtifactError, InvalidOptionError
from ..logs import native_stderr_quiet
from .programs import max_tokens_per_call


class ExecuTorchProgram:
    def __init__(self, path: Path, manifest: dict, weights: Path | None = None, trace_events: bool = False):
        import torch
        from executorch.runtime import Runtime

        register_kernels()

        self.manifest = manifest
        self._chunk = max_tokens_per_call(manifest)
        self._torch = torch
        self._path = path
        try:
            # trace_events: ExecuTorch's ETDump tracer times every kernel and delegate call
            # (scripts/profile_pte.py); off, the runtime records nothing.
            with native_stderr_quiet():
                self._program = Runtime.get().load_program(path, data_path=weights, enable_etdump=trace_events)
                self._method = self._program.load_method("forward")
        except Exception as e:  # the runtime raises a bare RuntimeError for any unreadable program
            raise ArtifactError(f"ExecuTorch cannot load {path}: {e}")

    def forward(self, tokens: list[int], start: int) -> np.ndarray:
        torch = self._torch
        if not tokens:
            raise InvalidOptionError("forward needs at least one token")
        # Activation memory is planned for calls of at most `_chunk` tokens: a longer prompt takes several.
        for first in range(0, len(tokens), self._chunk):
            chunk = tokens[first : first + self._chunk]
            inputs = [torch.tensor([chunk], dtype=torch.long), torch.tensor([start + first], dtype=torch.long)]
            logits = self._method.execute(inputs)[0]
        # Copy: the runtime may reuse the output memory on the next call.
        return logits[0].to(torch.float32, copy=True).numpy()

    def write_event_trace(self, path: Path) -> None:
        """Write the ETDump of every call so far (needs ``trace_events=True``)."""
        self._program.write_etdump_result_to_file(str(path), str(Path(path).with_suffix(".debug")))

    def reset(self) -> None:
        # Nothing to clear: a call at position 0 starts a new sequence (the masks ignore older state).
        pass


def register_kernels() -> None:
    """Register the kernels of ExecuTorch's LLM custom ops (``llama::custom_sdpa``, ``llama::update_cache``)
    and of its quantized ops (``quantized_decomposed::embedding_byte`` / ``embedding_4bit``, a quantized
    embedding) with the runtime; a ``.pte`` that uses them cannot load otherwise."""
    import executorch.extension.llm.custom_ops.custom_ops  # noqa: F401
    import executorch.kernels.quantized  # noqa: F401


def load(folder: Path, manifest: dict, device: str, trace_events: bool = False) -> ExecuTorchProgram:
    if device != "cpu":
        raise InvalidOptionError("ExecuTorch artifacts run on the CPU (XNNPACK); use --device cpu")
    weights = folder / manifest["weights"] if manifest.get("weights") else None
    return ExecuTorchProgram(folder / manifest["program"], manifest, weights, trace_events)
