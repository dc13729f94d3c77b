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
into the cache. Each scale is a margin above the largest magnitude the runs gave (``KEY_MARGIN``,
``VALUE_MARGIN``): a prompt longer than the calibration text reaches further, and a key or value
beyond its scale is saturated, which costs more than the coarser steps (docs/quantization.md).
"""

from __future__ import annotations

import contextlib

import torch

INT8_MAX = 127
# The kernel's own limit for an int8 buffer of a sliding layer (``sliding_window_cache``).
WINDOW_HEAD_DIM_MULTIPLE = 16

# Runs of the calibration text, at rotary offsets spread evenly over the cache.
ROTARY_OFFSETS = 16
# A channel's scale: this much above the largest magnitude the runs gave.
KEY_MARGIN = 1.25
VALUE_MARGIN = 1.5


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
    """Each buffer layer's fixed key and value scales ``[1, kv_heads, 1, D]`` (float32), from eager calls
    of ``decoder`` (an ``ExternalCacheDecoder`` with float buffers) on ``ids [1, N]`` at rotary
    offsets from 0 to ``max_cache_len - N``."""
    # One call: at most the call bound a linear-attention layer's padded system takes.
    ids = ids[:, : min(decoder.max_cache_len, decoder.max_tokens_per_call)]
    n = ids.shape[1]
    peaks: list[list[torch.Tensor | None]] = [[None, None] for _ in decoder.buffer_layers]  # keys, values

    def observer(i: int):
        def observe(key: torch.Tensor, value: torch.Tensor) -> None:
            new = [x[0].float().abs().amax(dim=1) for x in (key, value)]
            peaks[i] = [m if p is None else torch.maximum(p, m) for p, m in zip(peaks[i], new)]

        return observe

    past = []
    for layer, spec in decoder.buffer_layers:
        rows = layer.window or n
        past += [torch.zeros((1, spec.kv_heads, rows, spec.head_dim), dtype=decoder.dtype) for _ in range(2)]
    past += [torch.zeros(shape, dtype=dtype) for layer in decoder.state_layers for shape, dtype in layer.shapes]
    if decoder.verifies:
        past.append(torch.tensor([-1]))  # logits_indices: the last position's, as the graph's default
    offsets = sorted({round(float(x)) for x in torch.linspace(0, decoder.max_cache_len - n, ROTARY_OFFSETS)})
    try:
        for i, (layer, _) in enumerate(decoder.buffer_layers):
            layer.observe = observer(i)
        for offset in offsets:
            with torch.no_grad(), _rotary_positions_moved(decoder.model, offset):
                decoder(ids, torch.ones_like(ids), *past)
    finally:
        for layer, _ in decoder.buffer_layers:
            layer.observe = None
    tiny = torch.finfo(torch.float32).tiny  # a channel that is always 0 still gets a usable scale
    scales = []
    for keys, values in peaks:
        scales.append(tuple((p * margin).clamp_min(tiny)[None, :, None, :] / INT8_MAX
                            for p, margin in ((keys, KEY_MARGIN), (values, VALUE_MARGIN))))
    return scales


def use_int8_buffers(decoder, scales: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Give every layer of ``decoder`` that holds buffers its fixed scales, as buffers of the decoder
    (the graph's initializers): its buffers are int8 from then on."""
    for i, ((layer, _), (k_scale, v_scale)) in enumerate(zip(decoder.buffer_layers, scales, strict=True)):
        decoder.register_buffer(f"k_scale_{i}", k_scale)
        decoder.register_buffer(f"v_scale_{i}", v_scale)
        layer.k_scale, layer.v_scale = getattr(decoder, f"k_scale_{i}"), getattr(decoder, f"v_scale_{i}")
