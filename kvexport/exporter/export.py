"""``torch.export`` of the wrappers: one program, ``T`` dynamic from 1 to the wrapper's ``max_tokens_per_call``."""

from __future__ import annotations

import torch

from .decoder import ExportableDecoder, ExternalCacheDecoder


def example_inputs(max_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    # A prompt-sized example (not 1, not max) so no dimension is specialised on its example value.
    n = min(8, max_tokens)
    return torch.zeros((1, n), dtype=torch.long), torch.zeros((1,), dtype=torch.long)


def export_decoder(decoder: ExportableDecoder) -> torch.export.ExportedProgram:
    # Dim.DYNAMIC, bounded by the torch._check in forward: a named Dim with a max makes
    # torch.export reject a harmless guard from transformers' repeat_kv reshape.
    dynamic_shapes = ({1: torch.export.Dim.DYNAMIC}, None)
    with torch.no_grad():
        program = torch.export.export(
            decoder, example_inputs(decoder.max_tokens_per_call), dynamic_shapes=dynamic_shapes, strict=False
        )
    return program


# Example start position: any P >= 2 that differs from T and every window, so no dimension is
# specialised to, or equated with, another by its example value.
_EXAMPLE_START = 5
_EXAMPLE_RING_START = 3


def external_cache_example_inputs(decoder: ExternalCacheDecoder) -> tuple[torch.Tensor, ...]:
    tokens, _ = example_inputs(decoder.max_cache_len)
    ring_start = (torch.tensor([_EXAMPLE_RING_START]),) if decoder.has_rings else ()
    past = []
    for layer, spec in zip(decoder.caches, decoder.specs):
        rows = 2 * layer.window if layer.window else decoder.max_cache_len  # GroupQueryAttention's layout
        past += [torch.zeros((1, spec.kv_heads, rows, spec.head_dim), dtype=decoder.dtype) for _ in range(2)]
    return (tokens, torch.tensor([_EXAMPLE_START]), *ring_start, *past)


def export_external_cache_decoder(decoder: ExternalCacheDecoder) -> torch.export.ExportedProgram:
    """T dynamic as above; ``ring_start`` and every past have a fixed shape (whole buffers)."""
    inputs = external_cache_example_inputs(decoder)
    dynamic_shapes = ({1: torch.export.Dim.DYNAMIC}, None, tuple(None for _ in inputs[2:]))
    with torch.no_grad():
        program = torch.export.export(
            decoder, inputs, dynamic_shapes=dynamic_shapes, strict=False
        )
    return program
