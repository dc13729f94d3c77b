"""int8 KV buffers for the ONNX target (``--kv-cache int8``), in ONNX Runtime's scheme.

``GroupQueryAttention`` stores int8 keys and values with fixed scales given as inputs: one per
KV head and channel (``k_quant_type``/``v_quant_type`` PER_CHANNEL, symmetric, no zero point). It
quantizes each row as it writes it and dequantizes what it reads, so the runner's buffers are
int8 and nothing else changes in the graph's interface.

Fixed scales must be chosen before any prompt is seen: ``calibrate`` runs the decoder eagerly on
a calibration text (``kv_calibration``) and takes each channel's largest magnitude. A key's channel
also depends on the position, which turns each rotary pair of channels (``i`` and ``i + D/2``) by
an angle of its own, so the text is run again with every rotary embedding's positions moved on by
offsets up to ``max_cache_len`` (``_rotary_positions_moved``): attention depends on relative
positions only, so the hidden states stay the same and the keys are those the text gives that far
into the cache. A key's scale is ``KEY_MARGIN`` above the largest of those, at most the pair's
norm, which no position exceeds. A key or value beyond its scale is saturated.
"""

from __future__ import annotations

import contextlib

import torch

INT8_MAX = 127
# The kernel's own limit for an int8 buffer of a sliding layer (``sliding_window_cache``).
WINDOW_HEAD_DIM_MULTIPLE = 16

# Runs of the calibration text, at rotary offsets spread evenly over the cache.
ROTARY_OFFSETS = 16
# A key channel's scale: this much above the largest the runs gave, at most its rotary pair's norm.
KEY_MARGIN = 1.25


@contextlib.contextmanager
def _rotary_positions_moved(model: torch.nn.Module, offset: int):
    """Every rotary embedding module of ``model`` (transformers' ``*RotaryEmbedding``) computes its
    angles for ``position_ids + offset``."""
    modules = [m for m in model.modules() if type(m).__name__.endswith("RotaryEmbedding")]
    own = {m: vars(m).get("forward") for m in modules}  # a forward set on the module (fixed_rotary_frequencies)
    for module in modules:
        forward = module.forward
        module.forward = lambda x, position_ids, *args, _forward=forward, **kwargs: _forward(x, position_ids + offset, *args, **kwargs)
    try:
        yield len(modules)
    finally:
        for module, forward in own.items():
            if forward is None:
                del module.forward  # the class's own again
            else:
                module.forward = forward


def calibrate(decoder, ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's fixed key and value scales ``[1, kv_heads, 1, D]`` (float32), from eager calls
    of ``decoder`` (an ``ExternalCacheDecoder`` with float buffers) on ``ids [1, N]`` at rotary
    offsets from 0 to ``max_cache_len - N``."""
    ids = ids[:, : decoder.max_cache_len]
    n = ids.shape[1]
    peaks: list[list[torch.Tensor | None]] = [[None, None, None] for _ in decoder.caches]  # keys, values, pairs

    def observer(i: int):
        def observe(key: torch.Tensor, value: torch.Tensor) -> None:
            new = [x[0].float().abs().amax(dim=1) for x in (key, value)] + [_pair_norms(key)]
            peaks[i] = [m if p is None else torch.maximum(p, m) for p, m in zip(peaks[i], new)]

        return observe

    past = []
    for layer, spec in zip(decoder.caches, decoder.specs):
        rows = layer.window or n
        past += [torch.zeros((1, spec.kv_heads, rows, spec.head_dim), dtype=decoder.dtype) for _ in range(2)]
    offsets = sorted({round(float(x)) for x in torch.linspace(0, decoder.max_cache_len - n, ROTARY_OFFSETS)})
    try:
        for i, layer in enumerate(decoder.caches):
            layer.observe = observer(i)
        for offset in offsets:
            with torch.no_grad(), _rotary_positions_moved(decoder.model, offset):
                decoder(ids, torch.ones_like(ids), *past)
    finally:
        for layer in decoder.caches:
            layer.observe = None
    tiny = torch.finfo(torch.float32).tiny  # a channel that is always 0 still gets a usable scale
    scales = []
    for keys, values, pairs in peaks:
        keys = torch.minimum(keys * KEY_MARGIN, pairs)
        scales.append(tuple((p.clamp_min(tiny) / INT8_MAX)[None, :, None, :] for p in (keys, values)))
    return scales


def _pair_norms(key: torch.Tensor) -> torch.Tensor:
    """``key [1, kv_heads, T, D]`` -> ``[kv_heads, D]``: the largest norm of each channel's rotary
    pair (channels ``i`` and ``i + D/2``), which no position exceeds; each channel's own where D is odd."""
    k = key[0].float()
    d = k.shape[-1]
    if d % 2:
        return k.abs().amax(dim=1)
    pair = torch.hypot(k[..., : d // 2], k[..., d // 2 :]).amax(dim=1)
    return torch.cat([pair, pair], dim=-1)


def use_int8_buffers(decoder, scales: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Give every layer of ``decoder`` its fixed scales, as buffers of the decoder (the graph's
    initializers): its buffers are int8 from then on."""
    for i, (layer, (k_scale, v_scale)) in enumerate(zip(decoder.caches, scales, strict=True)):
        decoder.register_buffer(f"k_scale_{i}", k_scale)
        decoder.register_buffer(f"v_scale_{i}", v_scale)
        layer.k_scale, layer.v_scale = getattr(decoder, f"k_scale_{i}"), getattr(decoder, f"v_scale_{i}")
