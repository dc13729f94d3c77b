"""``torch.export`` of the wrapper: one program, ``T`` dynamic from 1 to ``max_cache_len``."""

from __future__ import annotations

import torch

from .wrapper import ExportableDecoder


def example_inputs(max_cache_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    # A prompt-sized example (not 1, not max) so no dimension is specialised on its example value.
    n = min(8, max_cache_len)
    return torch.zeros((1, n), dtype=torch.long), torch.zeros((1,), dtype=torch.long)


def export_decoder(decoder: ExportableDecoder) -> torch.export.ExportedProgram:
    # Dim.DYNAMIC, bounded by the torch._check in forward: a named Dim with a max makes
    # torch.export reject a harmless guard from transformers' repeat_kv reshape.
    dynamic_shapes = ({1: torch.export.Dim.DYNAMIC}, None)
    with torch.no_grad():
        program = torch.export.export(
            decoder, example_inputs(decoder.max_cache_len), dynamic_shapes=dynamic_shapes, strict=False
        )
    return program
