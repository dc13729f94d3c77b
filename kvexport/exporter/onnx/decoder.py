"""The decoder the ONNX target exports, and its ``torch.export``: the cache crosses the program
boundary, since ONNX graphs hold no mutable state, in onnxruntime-genai's calling convention."""

from __future__ import annotations

import torch
from torch import nn

from ...models.architecture import CONV, MAMBA2, RECURRENT
from ..decoder import ExportableDecoder
from .attention import EXTERNAL_LAYERS
from .states import ExternalConvState, ExternalGatedDeltaState, ExternalMamba2State

EXTERNAL_KINDS = {**EXTERNAL_LAYERS, CONV: ExternalConvState, RECURRENT: ExternalGatedDeltaState, MAMBA2: ExternalMamba2State}


class ExternalCacheDecoder(ExportableDecoder):
    """``forward(input_ids[1, T], attention_mask[1, P + T], past_key_0, past_value_0, ...) ->
    (logits[1, 1, vocab], present_key_0, present_value_0, ...)``: the positions already in the
    cache, P, are the mask's width less T (the mask is ones). Every past is a whole head-major
    buffer ``[1, kv_heads, rows, head_dim]`` and its present the same buffer with the call written
    (in place when the runner binds both to one buffer): ``max_cache_len`` rows for a full-attention
    layer, ``window`` or more for a sliding one; a layer that shares another's cache has none. See
    ``attention``.
    """

    def __init__(self, model: nn.Module, max_cache_len: int, max_tokens_per_call: int | None = None, verifies: bool = False):
        super().__init__(model, max_cache_len, EXTERNAL_KINDS, max_tokens_per_call)
        # A graph that verifies drafted tokens takes one more input, last: ``logits_indices`` (see forward).
        self.verifies = verifies
        # The layers whose buffers cross the graph boundary, in the graph's order, with their specs;
        # then the layers' states (``states``: of the layers that do not attend, and hybrid layers'
        # mixers), in layer order, after every KV buffer.
        self.buffer_layers = [(c, spec) for c, spec in zip(self.caches, self.specs) if spec.reads is None and spec.has_kv]
        self.state_layers = [s for s, spec in zip(self.states, self.specs) if spec.state_kind]
        for spec in self.specs:
            if spec.reads_every_token and self.specs[spec.reads].is_ring(max_cache_len):
                self.caches[spec.reads].in_plain_ops = True  # see attention._BufferLayer

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, *past: torch.Tensor):
        """With ``verifies``, the last input is ``logits_indices [n]``: the call's positions (indices
        into it, negative from its end) whose logits come out, ``[1, n, vocab]``; the graph gives it
        a default of ``[-1]`` (the last position's, onnxruntime-genai's call), and a verification of
        drafted tokens passes ``0 .. T-1``."""
        rows = None
        if self.verifies:
            *past, rows = past
        kv = 2 * len(self.buffer_layers)
        for (layer, _), past_k, past_v in zip(self.buffer_layers, past[0:kv:2], past[1:kv:2], strict=True):
            layer.bind(past_k, past_v)
        states = iter(past[kv:])
        for layer in self.state_layers:
            layer.bind(*[next(states) for _ in layer.shapes])
        t, total = input_ids.shape[1], attention_mask.shape[1]
        torch._check(t <= total)
        torch._check(total <= self.max_cache_len)
        positions = torch.arange(total - t, total, device=input_ids.device)
        logits = self.logits_at(input_ids, positions)[:, None] if rows is None else self.logits_at(input_ids, positions, rows)
        presents = [kv for layer, _ in self.buffer_layers for kv in (layer.present_k, layer.present_v)]
        return (logits, *presents, *[state for layer in self.state_layers for state in layer.presents()])


def external_cache_example_inputs(decoder: ExternalCacheDecoder) -> tuple[torch.Tensor, ...]:
    """A call of a few tokens after a few positions, sizes that differ from each other and from
    every window, so no dimension is specialised to, or equated with, another by its example value."""
    t = max(2, min(8, decoder.max_tokens_per_call, decoder.max_cache_len - 2))
    start = min(5, decoder.max_cache_len - t)
    past = []
    for layer, spec in decoder.buffer_layers:
        rows = layer.window or decoder.max_cache_len
        dtype = decoder.dtype if layer.k_scale is None else torch.int8  # int8: --kv-cache int8
        past += [torch.zeros((1, spec.kv_heads, rows, spec.head_dim), dtype=dtype) for _ in range(2)]
    past += [torch.zeros(shape, dtype=dtype) for layer in decoder.state_layers for shape, dtype in layer.shapes]
    if decoder.verifies:  # indices from the call's end fit any call; their count another size than the others'
        sizes = {t, start + t, decoder.max_cache_len, *(p.shape[2] for p in past)}
        past.append(torch.full((next(n for n in range(3, 64) if n not in sizes),), -1, dtype=torch.long))
    return (torch.zeros((1, t), dtype=torch.long), torch.ones((1, start + t), dtype=torch.long), *past)


def export_external_cache_decoder(decoder: ExternalCacheDecoder) -> torch.export.ExportedProgram:
    """``T``, the mask's width and every KV buffer's rows dynamic: onnxruntime-genai gives a full
    layer as many rows as the generation's ``max_length``, and a sliding one its window and a slack."""
    inputs = external_cache_example_inputs(decoder)
    dynamic = torch.export.Dim.DYNAMIC
    kv = 2 * len(decoder.buffer_layers)
    past_shapes = tuple({2: dynamic} if n < kv else None for n in range(len(inputs) - 2))  # a state's shape is fixed
    if decoder.verifies:
        past_shapes = (*past_shapes[:-1], {0: dynamic})  # logits_indices
    dynamic_shapes = ({1: dynamic}, {1: dynamic}, past_shapes)
    with torch.no_grad():
        return torch.export.export(decoder, inputs, dynamic_shapes=dynamic_shapes, strict=False)
