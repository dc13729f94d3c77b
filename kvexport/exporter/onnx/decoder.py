"""The decoder the ONNX target exports, and its ``torch.export``: the cache crosses the program
boundary, since ONNX graphs hold no mutable state."""

from __future__ import annotations

import torch
from torch import nn

from ...models.architecture import LayerSpec
from ..decoder import ExportableDecoder, example_inputs
from .attention import ExternalRingLayer, ExternalStaticLayer


def build_external_layers(specs: list[LayerSpec], max_cache_len: int, dtype: torch.dtype) -> list:
    return [ExternalRingLayer(spec.window) if spec.is_ring(max_cache_len) else ExternalStaticLayer() for spec in specs]


class ExternalCacheDecoder(ExportableDecoder):
    """``forward(tokens[1, T], input_pos[1], [ring_start[1],] past_key_0, past_value_0, ...) ->
    (logits[1, vocab], present_key_0, present_value_0, ...)``. Every past is a whole head-major
    buffer ``[1, kv_heads, rows, head_dim]`` and its present the same buffer with the call's rows
    written (in place when the runner binds both to one buffer): ``max_cache_len`` rows for a
    full-attention layer, ``2 * window`` for a sliding one, whose first new row is ``ring_start``
    (an input only when the model has sliding layers). See ``attention``.
    """

    def __init__(self, model: nn.Module, max_cache_len: int):
        super().__init__(model, max_cache_len, build_external_layers)
        self.has_rings = any(layer.window for layer in self.caches)

    def reset_cache(self) -> None:  # the runner owns the cache
        pass

    def forward(self, tokens: torch.Tensor, input_pos: torch.Tensor, *inputs: torch.Tensor):
        ring_start, past = (inputs[0], inputs[1:]) if self.has_rings else (None, inputs)
        for layer, past_k, past_v in zip(self.caches, past[0::2], past[1::2], strict=True):
            layer.bind(past_k, past_v, ring_start)
        logits = self.last_logits(tokens, input_pos)
        return (logits, *[kv for layer in self.caches for kv in (layer.present_k, layer.present_v)])


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
    """``T`` dynamic as in ``export_decoder``; ``ring_start`` and every past have a fixed shape (whole buffers)."""
    inputs = external_cache_example_inputs(decoder)
    dynamic_shapes = ({1: torch.export.Dim.DYNAMIC}, None, tuple(None for _ in inputs[2:]))
    with torch.no_grad():
        return torch.export.export(decoder, inputs, dynamic_shapes=dynamic_shapes, strict=False)
