"""The module we export, and its ``torch.export``. The transformers model runs unchanged; only its
cache and masks are ours.

``ExportableDecoder``: ``forward(tokens[1, T], input_pos[1]) -> logits[1, vocab]`` with the cache
in mutable buffers. That is ExecuTorch's LLM-runner calling convention with a start position (the
runner passes ``[start]`` when the program's second input has one element). A target may give its
own cache kinds (``cache_kinds``) or subclass it (the ONNX target's external cache). Exported
``verifying``, the same call returns every position's logits ``[1, T, vocab]``: a speculative
decoder's verification of drafted tokens.
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import UnsupportedModelError
from ..models.adapters import fixed_rotary_frequencies, prepare_for_export
from ..models.architecture import check_rope, layer_specs
from . import attention
from .kv_cache import PLAIN_CACHES, CacheKinds, CallState, additive_mask, build_caches, build_state


def _prepare(model: nn.Module) -> nn.Module:
    """Eval mode, no grad, and kvexport's attention, which hands each layer's keys to our cache."""
    model.eval()
    model.requires_grad_(False)
    model.set_attn_implementation(attention.NAME)
    prepare_for_export(model)
    return model


class ExportableDecoder(nn.Module):
    """A causal LM with an export-safe cache, returning the logits of the last position."""

    def __init__(
        self, model: nn.Module, max_cache_len: int, cache_kinds: CacheKinds = PLAIN_CACHES, max_tokens_per_call: int | None = None,
        spare_slots: int = 0,
    ):
        super().__init__()
        # Rotary frequencies that transformers recomputes from the length are fixed to those eager
        # uses up to max_cache_len, where that is one set for every position (else refused); before
        # the adapters, one of which replaces a complex rotary module's forward with its own.
        check_rope(model.config, max_cache_len)
        fixed_rotary_frequencies(model, max_cache_len)
        self.model = _prepare(model)
        self.max_cache_len = max_cache_len
        # The bound of T; ExecuTorch plans activation memory for a call this long.
        self.max_tokens_per_call = max_tokens_per_call or max_cache_len
        self.specs = layer_specs(model.config)
        self.dtype = next(model.parameters()).dtype
        # Rings with spare slots take a call that starts up to that many positions before the previous
        # call's end (a verification's rejected drafted tokens, kv_cache.RingKVCache).
        caches = build_caches(self.specs, max_cache_len, self.dtype, cache_kinds, self.max_tokens_per_call, spare_slots)
        # Caches with state are submodules (their buffers are the program's); the ONNX target's hold none.
        self.caches = nn.ModuleList(caches) if all(isinstance(c, nn.Module) for c in caches) else caches
        # A hybrid layer (Falcon-H1) holds a state beside its KV cache: its mixer's, a submodule too.
        mixers = {i: build_state(s, self.dtype, cache_kinds, self.max_tokens_per_call)
                  for i, s in enumerate(self.specs) if s.has_kv and s.state_kind}  # fmt: skip
        self.mixer_states = nn.ModuleList(mixers.values())
        # Each layer's state, in layer order: its mixer's, else its cache (a state where it does not attend).
        self.states = [mixers.get(i, cache) for i, cache in enumerate(self.caches)]
        # One mask per layer type, built once per call from the type's first layer (one with a cache of
        # its own: a layer that shares one comes after the layer it reads, and masks for itself); none
        # for a convolution (batch 1 has no padding to mask).
        self._mask_groups = {}
        for i, spec in enumerate(self.specs):
            self._mask_groups.setdefault(spec.layer_type, (i, spec.window, spec.chunk) if spec.has_kv else None)
        # transformers takes one mask per layer type when the model mixes them, else a single one.
        self._mask_by_type = len(self._mask_groups) > 1
        # A flag, not a wrapper module: a program exported with it names the buffers as forward's
        # does, and a .pte's methods share the buffers of one name.
        self.verifying = False

    def masks(self, positions: torch.Tensor):
        masks = {}
        for layer_type, group in self._mask_groups.items():
            if group is None:
                masks[layer_type] = None
                continue
            index, window, chunk = group
            key_pos = self.caches[index].key_positions(positions)
            masks[layer_type] = additive_mask(key_pos, positions, window, self.dtype, chunk)
        if self._mask_by_type:
            return masks
        return next(iter(masks.values()))

    def forward(self, tokens: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        positions = input_pos[:1] + torch.arange(tokens.shape[1], device=tokens.device)
        return self.logits_at(tokens, positions, torch.arange(tokens.shape[1]) if self.verifying else None)

    def logits_at(self, tokens: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Run the model on ``tokens`` at ``positions``, through our caches and masks; the last
        position's logits ``[1, vocab]``, or with ``rows`` (indices into the call, negative from its
        end) those positions' ``[1, len(rows), vocab]``, as a verification of drafted tokens reads them."""
        # The bound is stated here rather than in a bounded export Dim: a named Dim with a max
        # makes torch.export reject a spurious guard from transformers' repeat_kv reshape.
        torch._check(tokens.shape[1] <= self.max_tokens_per_call)
        call = CallState(self.caches, positions, self.max_cache_len, self.states, self.specs)
        with attention.running(call):
            out = self.model(
                input_ids=tokens,
                attention_mask=self.masks(positions),
                position_ids=positions[None],
                # No transformers cache: our attention (see attention.py) writes and reads our caches.
                use_cache=False,
                kvexport_call=call,
                logits_to_keep=1 if rows is None else rows,
            )
        unreached = [i for i, spec in enumerate(self.specs) if spec.has_kv and i not in call.reached]
        if unreached:
            raise UnsupportedModelError(
                f"architecture '{self.model.config.model_type}' is not supported: the attention of layers {unreached} "
                "does not go through transformers' AttentionInterface, where kvexport's cache plugs in"
            )
        return out.logits[:, -1, :] if rows is None else out.logits


def example_inputs(max_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    # A prompt-sized example (not 1, not max) so no dimension is specialised on its example value.
    n = min(8, max_tokens)
    return torch.zeros((1, n), dtype=torch.long), torch.zeros((1,), dtype=torch.long)


def export_verifier(decoder: ExportableDecoder, tokens: int) -> torch.export.ExportedProgram:
    """The call that returns every position's logits (``verifying``), of 1 to ``tokens`` tokens: a
    verification of drafted tokens costs the tokens it verifies. ``T`` is dynamic as in
    ``export_decoder``, bounded by ``tokens`` (the size ExecuTorch plans the method's activations for)."""
    calls = decoder.max_tokens_per_call
    decoder.verifying, decoder.max_tokens_per_call = True, tokens
    try:
        with torch.no_grad():
            example = (torch.zeros((1, tokens), dtype=torch.long), torch.zeros((1,), dtype=torch.long))
            return torch.export.export(decoder, example, dynamic_shapes=({1: torch.export.Dim.DYNAMIC}, None), strict=False)
    finally:
        decoder.verifying, decoder.max_tokens_per_call = False, calls


def export_decoder(decoder: ExportableDecoder) -> torch.export.ExportedProgram:
    """One program for every call length: ``T`` dynamic from 1 to ``decoder.max_tokens_per_call``,
    or static at 1 where that is the bound (a decode-only program: torch.export specialises a
    dimension whose example is 1, and refuses to call it dynamic)."""
    # Dim.DYNAMIC, bounded by the torch._check in forward: a named Dim with a max makes
    # torch.export reject a harmless guard from transformers' repeat_kv reshape.
    dynamic_shapes = ({1: torch.export.Dim.DYNAMIC}, None) if decoder.max_tokens_per_call > 1 else None
    with torch.no_grad():
        return torch.export.export(
            decoder, example_inputs(decoder.max_tokens_per_call), dynamic_shapes=dynamic_shapes, strict=False
        )
