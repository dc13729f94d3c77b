"""The modules we export. The transformers model runs unchanged; only its cache and masks are ours.

- ``ExportableDecoder``: ``forward(tokens[1, T], input_pos[1]) -> logits[1, vocab]`` with the cache
  in mutable buffers. That is ExecuTorch's LLM-runner calling convention with a start position (the
  runner passes ``[start]`` when the program's second input has one element).
- ``ExternalCacheDecoder``: the same model call with the cache outside the program (ONNX): past
  rows in, new rows out.
"""

from __future__ import annotations

import torch
from torch import nn

from ..models.adapters import prepare_for_export
from ..models.architecture import LayerSpec, layer_specs
from . import attention
from .kv_cache import CallState, RingKVCache, StaticKVCache, additive_mask
from .onnx.attention import ExternalRingLayer, ExternalStaticLayer


def build_caches(specs: list[LayerSpec], max_cache_len: int, dtype: torch.dtype, batch: int = 1) -> nn.ModuleList:
    caches = []
    for spec in specs:
        if spec.is_ring(max_cache_len):
            caches.append(RingKVCache(batch, spec.kv_heads, spec.window, spec.head_dim, dtype))
        else:
            caches.append(StaticKVCache(batch, spec.kv_heads, max_cache_len, spec.head_dim, dtype))
    return nn.ModuleList(caches)


def _prepare(model: nn.Module) -> nn.Module:
    """Eval mode, no grad, and kvexport's attention, which hands each layer's keys to our cache."""
    model.eval()
    model.requires_grad_(False)
    model.set_attn_implementation(attention.NAME)
    prepare_for_export(model)
    return model


class ExportableDecoder(nn.Module):
    """A causal LM with an export-safe cache, returning the logits of the last position."""

    def __init__(self, model: nn.Module, max_cache_len: int, cache_builder=build_caches, max_tokens_per_call: int | None = None):
        super().__init__()
        self.model = _prepare(model)
        self.max_cache_len = max_cache_len
        # The bound of T; ExecuTorch plans activation memory for a call this long.
        self.max_tokens_per_call = max_tokens_per_call or max_cache_len
        self.specs = layer_specs(model.config)
        self.dtype = next(model.parameters()).dtype
        self.caches = cache_builder(self.specs, max_cache_len, self.dtype)
        # Layers sharing a mask: one per (layer_type, ring or not), built once per call.
        self._mask_groups = {}
        for i, spec in enumerate(self.specs):
            self._mask_groups.setdefault(spec.layer_type, (i, spec.window))
        # transformers takes one mask per layer type when the model mixes them, else a single one.
        self._mask_by_type = len(self._mask_groups) > 1

    def reset_cache(self) -> None:
        for cache in self.caches:
            cache.k.zero_()
            cache.v.zero_()

    def masks(self, positions: torch.Tensor):
        masks = {}
        for layer_type, (index, window) in self._mask_groups.items():
            key_pos = self.caches[index].key_positions(positions)
            masks[layer_type] = additive_mask(key_pos, positions, window, self.dtype)
        if self._mask_by_type:
            return masks
        return next(iter(masks.values()))

    def forward(self, tokens: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        return self.last_logits(tokens, input_pos)

    def last_logits(self, tokens: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        """Run the model on ``tokens`` at ``input_pos``, through our caches and masks."""
        # The bound is stated here rather than in a bounded export Dim: a named Dim with a max
        # makes torch.export reject a spurious guard from transformers' repeat_kv reshape.
        torch._check(tokens.shape[1] <= self.max_tokens_per_call)
        positions = input_pos[:1] + torch.arange(tokens.shape[1], device=tokens.device)
        out = self.model(
            input_ids=tokens,
            attention_mask=self.masks(positions),
            position_ids=positions[None],
            # No transformers cache: our attention (see attention.py) writes and reads our caches.
            use_cache=False,
            kvexport_call=CallState(self.caches, positions, self.max_cache_len),
            logits_to_keep=1,
        )
        return out.logits[:, -1, :]


def build_external_layers(specs: list[LayerSpec], max_cache_len: int, dtype: torch.dtype) -> list:
    return [ExternalRingLayer(spec.window) if spec.is_ring(max_cache_len) else ExternalStaticLayer() for spec in specs]


class ExternalCacheDecoder(ExportableDecoder):
    """The cache crosses the program boundary: ONNX graphs hold no mutable state.

    ``forward(tokens[1, T], input_pos[1], [ring_start[1],] past_key_0, past_value_0, ...) ->
    (logits[1, vocab], present_key_0, present_value_0, ...)``. Every past is a whole head-major
    buffer ``[1, kv_heads, rows, head_dim]`` and its present the same buffer with the call's rows
    written (in place when the runner binds both to one buffer): ``max_cache_len`` rows for a
    full-attention layer, ``2 * window`` for a sliding one, whose first new row is ``ring_start``
    (an input only when the model has sliding layers). See ``onnx_attention``.
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
