"""int8 KV buffers for the ONNX target (``--kv-cache int8``), in ONNX Runtime's scheme.

``GroupQueryAttention`` stores int8 keys and values with fixed scales given as inputs: one per
KV head and channel (``k_quant_type``/``v_quant_type`` PER_CHANNEL, symmetric, no zero point). It
quantizes each row as it writes it and dequantizes what it reads, so the runner's buffers are
int8 and nothing else changes in the graph's interface.

Fixed scales must be chosen before any prompt is seen: ``calibrate`` runs the decoder eagerly on
a calibration text (``kv_calibration``) and takes each channel's largest magnitude. For keys that
is taken over the rotary pair a channel belongs to (channels ``i`` and ``i + D/2``, which
transformers' rotation turns into each other): the pair's norm does not change with the position,
so a key at a position the calibration never reached stays within its scale. A key or value
beyond its scale is saturated.
"""

from __future__ import annotations

import torch

INT8_MAX = 127
# The kernel's own limit for an int8 buffer of a sliding layer (``sliding_window_cache``).
WINDOW_HEAD_DIM_MULTIPLE = 16

def _key_peaks(key: torch.Tensor) -> torch.Tensor:
    """``key [1, kv_heads, T, D]`` -> ``[kv_heads, D]``: each channel's largest magnitude, or its
    rotary pair's largest norm where D is even."""
    k = key[0].float()
    d = k.shape[-1]
    if d % 2:
        return k.abs().amax(dim=1)
    pair = torch.hypot(k[..., : d // 2], k[..., d // 2 :]).amax(dim=1)
    return torch.cat([pair, pair], dim=-1)


def calibrate(decoder, ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's fixed key and value scales ``[1, kv_heads, 1, D]`` (float32), from one eager
    call of ``decoder`` (an ``ExternalCacheDecoder`` with float buffers) on ``ids [1, N]``."""
    ids = ids[:, : decoder.max_cache_len]
    peaks: list[list[torch.Tensor | None]] = [[None, None] for _ in decoder.caches]

    def observer(i: int):
        def observe(key: torch.Tensor, value: torch.Tensor) -> None:
            new = (_key_peaks(key), value[0].float().abs().amax(dim=1))
            peaks[i] = [n if p is None else torch.maximum(p, n) for p, n in zip(peaks[i], new)]

        return observe

    past = []
    for layer, spec in zip(decoder.caches, decoder.specs):
        rows = layer.window or ids.shape[1]
        past += [torch.zeros((1, spec.kv_heads, rows, spec.head_dim), dtype=decoder.dtype) for _ in range(2)]
    try:
        for i, layer in enumerate(decoder.caches):
            layer.observe = observer(i)
        with torch.no_grad():
            decoder(ids, torch.ones_like(ids), *past)
    finally:
        for layer in decoder.caches:
            layer.observe = None
    tiny = torch.finfo(torch.float32).tiny  # a channel that is always 0 still gets a usable scale
    return [tuple((p.clamp_min(tiny) / INT8_MAX)[None, :, None, :] for p in pair) for pair in peaks]


def use_int8_buffers(decoder, scales: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Give every layer of ``decoder`` its fixed scales, as buffers of the decoder (the graph's
    initializers): its buffers are int8 from then on."""
    for i, (layer, (k_scale, v_scale)) in enumerate(zip(decoder.caches, scales, strict=True)):
        decoder.register_buffer(f"k_scale_{i}", k_scale)
        decoder.register_buffer(f"v_scale_{i}", v_scale)
        layer.k_scale, layer.v_scale = getattr(decoder, f"k_scale_{i}"), getattr(decoder, f"v_scale_{i}")
