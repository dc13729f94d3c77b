"""The ONNX graph's layers: the runtime's cache buffers in and out, attention as ONNX Runtime's
``GroupQueryAttention`` (``com.microsoft``, the kernel onnxruntime-genai's models use).

- Full attention (``ExternalStaticLayer``): the runner's buffer is head-major
  ``[1, kv_heads, max_cache_len, head_dim]``; the graph takes the whole buffer as ``past`` and
  returns it, with the call's rows written at positions ``P .. P+T-1``, as ``present``. A runner
  that binds both to the same memory (ONNX Runtime's shared past/present buffer) has the rows
  written in place, and the kernel reads only the first ``P + T`` rows: decode cost follows the
  filled length, not ``max_cache_len``.
- Sliding window (``ExternalRingLayer``): the ring of ``W`` slots comes in whole,
  sequence-major ``[1, W, kv_heads, head_dim]``, and the call's new rows go out for the runner to
  write into their slots. Attention is the same kernel over ``ring + new`` keys with our additive
  mask as its ``attention_bias`` (slot order is not position order, and the mask knows which slot
  holds which position).

In PyTorch these are the ops ``kvexport::group_query_attention`` and ``kvexport::ring_attention``,
with plain implementations of the kernel's semantics (what the wrapper runs eagerly);
``ONNX_TRANSLATIONS`` maps both to the node for ``torch.onnx.export``.

A family whose attention needs more than softmax(QK^T·scale + mask)·V (soft-capping, attention
sinks) keeps the same interface and runs its own eager attention instead of the kernel.
"""

from __future__ import annotations

import torch

from .attention import family_eager_attention, plain_softmax_attention
from .kv_cache import ring_key_positions


def _attention(query, keys, values, num_heads: int, kv_num_heads: int, scale: float, bias):
    """softmax(Q K^T · scale + bias) V in float32 for ``query [1, T, num_heads * D]`` and
    head-major ``keys``/``values [kv_num_heads, K, D]``; returns ``[1, T, num_heads * D]``."""
    t = query.shape[1]
    d = query.shape[2] // num_heads
    group = num_heads // kv_num_heads
    q = query[0].view(t, num_heads, d).transpose(0, 1).float()
    scores = q @ keys.repeat_interleave(group, dim=0).float().transpose(1, 2) * scale + bias
    out = scores.softmax(dim=-1) @ values.repeat_interleave(group, dim=0).float()
    return out.transpose(0, 1).reshape(1, t, num_heads * d).to(query.dtype)


def _causal_bias(start: int, end: int) -> torch.Tensor:
    """Query ``start + i`` sees key columns ``0 .. start + i`` (the kernel's own causal mask)."""
    causal = torch.arange(end)[None, :] <= torch.arange(start, end)[:, None]
    return torch.zeros(causal.shape).masked_fill(~causal, float("-inf"))


@torch.library.custom_op("kvexport::group_query_attention", mutates_args=())
def group_query_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    past_key: torch.Tensor,
    past_value: torch.Tensor,
    seqlens_k: torch.Tensor,
    total_length: torch.Tensor,
    num_heads: int,
    kv_num_heads: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``GroupQueryAttention`` with past and present in one buffer, batch 1.

    ``query [1, T, num_heads * D]``, ``key``/``value [1, T, kv_num_heads * D]``, ``past_*``
    ``[1, kv_num_heads, S, D]``, ``total_length`` = P + T (0-d int32), ``seqlens_k`` = ``[P + T - 1]``.
    Returns ``(out [1, T, num_heads * D], present_key, present_value)``, presents shaped as the pasts.
    """
    t = query.shape[1]
    end = int(total_length)
    start = end - t
    present_key, present_value = past_key.clone(), past_value.clone()
    present_key[0, :, start:end] = key[0].view(t, kv_num_heads, -1).transpose(0, 1)
    present_value[0, :, start:end] = value[0].view(t, kv_num_heads, -1).transpose(0, 1)
    keys, values = present_key[0, :, :end], present_value[0, :, :end]
    out = _attention(query, keys, values, num_heads, kv_num_heads, scale, _causal_bias(start, end))
    return out, present_key, present_value


@group_query_attention.register_fake
def _(query, key, value, past_key, past_value, seqlens_k, total_length, num_heads, kv_num_heads, scale):
    return torch.empty_like(query), torch.empty_like(past_key), torch.empty_like(past_value)


@torch.library.custom_op("kvexport::ring_attention", mutates_args=())
def ring_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    ring_key: torch.Tensor,
    ring_value: torch.Tensor,
    seqlens_k: torch.Tensor,
    total_length: torch.Tensor,
    attention_bias: torch.Tensor,
    num_heads: int,
    kv_num_heads: int,
    scale: float,
) -> torch.Tensor:
    """``GroupQueryAttention`` over the whole ring then the call's keys, masked by ``attention_bias``.

    ``ring_*`` ``[1, kv_num_heads, W, D]``; ``total_length`` = W + T, ``seqlens_k`` = ``[W + T - 1]``;
    ``attention_bias [1, 1, T, W + T]``. The kernel also applies its causal mask (new key ``j``
    hidden from new query ``i < j``), which the ring's mask already implies. Returns the output only.
    """
    t = query.shape[1]
    window = ring_key.shape[2]
    keys = torch.cat([ring_key[0], key[0].view(t, kv_num_heads, -1).transpose(0, 1)], dim=1)
    values = torch.cat([ring_value[0], value[0].view(t, kv_num_heads, -1).transpose(0, 1)], dim=1)
    bias = attention_bias[0].float() + _causal_bias(window, window + t)
    return _attention(query, keys, values, num_heads, kv_num_heads, scale, bias)


@ring_attention.register_fake
def _(query, key, value, ring_key, ring_value, seqlens_k, total_length, attention_bias, num_heads, kv_num_heads, scale):
    return torch.empty_like(query)


def _onnx_schema():
    """The ``com.microsoft`` op's signature as far as we use it: onnx itself does not know the
    contrib ops, and onnxscript needs a schema to emit one."""
    from onnx.defs import OpSchema

    def param(name, type_str, optional=False):
        option = OpSchema.FormalParameterOption.Optional if optional else OpSchema.FormalParameterOption.Single
        return OpSchema.FormalParameter(name, type_str, param_option=option)

    return OpSchema(
        "GroupQueryAttention",
        "com.microsoft",
        1,
        inputs=[
            param("query", "T"),
            param("key", "T"),
            param("value", "T"),
            param("past_key", "T"),
            param("past_value", "T"),
            param("seqlens_k", "M"),
            param("total_sequence_length", "M"),
            param("cos_cache", "T", optional=True),
            param("sin_cache", "T", optional=True),
            param("position_ids", "P", optional=True),
            param("attention_bias", "T", optional=True),
        ],
        outputs=[param("output", "T"), param("present_key", "T"), param("present_value", "T")],
        type_constraints=[
            ("T", ["tensor(float)", "tensor(float16)"], ""),
            ("M", ["tensor(int32)"], ""),
            ("P", ["tensor(int64)"], ""),
        ],
        attributes=[
            OpSchema.Attribute("num_heads", OpSchema.AttrType.INT, ""),
            OpSchema.Attribute("kv_num_heads", OpSchema.AttrType.INT, ""),
            OpSchema.Attribute("scale", OpSchema.AttrType.FLOAT, ""),
        ],
    )


def _group_query_attention_node(*inputs, num_heads: int, kv_num_heads: int, scale: float):
    import onnxscript

    op = onnxscript.values.Op(onnxscript.values.Opset("com.microsoft", 1), "GroupQueryAttention", _onnx_schema())
    return op(*inputs, num_heads=num_heads, kv_num_heads=kv_num_heads, scale=scale)


def _group_query_attention_onnx(
    query, key, value, past_key, past_value, seqlens_k, total_length, num_heads: int, kv_num_heads: int, scale: float
):
    return _group_query_attention_node(
        query, key, value, past_key, past_value, seqlens_k, total_length,
        num_heads=num_heads, kv_num_heads=kv_num_heads, scale=scale,
    )  # fmt: skip


def _ring_attention_onnx(
    query, key, value, ring_key, ring_value, seqlens_k, total_length, attention_bias,
    num_heads: int, kv_num_heads: int, scale: float,
):  # fmt: skip
    # No rotary caches, no position ids: the keys come rotated already.
    out, _, _ = _group_query_attention_node(
        query, key, value, ring_key, ring_value, seqlens_k, total_length, None, None, None, attention_bias,
        num_heads=num_heads, kv_num_heads=kv_num_heads, scale=scale,
    )  # fmt: skip
    return out


ONNX_TRANSLATIONS = {
    torch.ops.kvexport.group_query_attention.default: _group_query_attention_onnx,
    torch.ops.kvexport.ring_attention.default: _ring_attention_onnx,
}


def _kernel_inputs(query, key, value, scaling):
    """transformers' ``[1, heads, T, D]`` states as the kernel's ``[1, T, heads * D]``, its head counts and scale."""
    _, heads, t, d = query.shape
    kv_heads = key.shape[1]
    flat = [x.transpose(1, 2).reshape(1, t, x.shape[1] * d) for x in (query, key, value)]
    return flat, heads, kv_heads, float(scaling if scaling is not None else d**-0.5)


# With one kv head (Gemma 3 270M and 1B) the two layouts are the same memory: a reshape, where a
# Transpose node would copy the whole ring on every call.


def _sequence_first(states: torch.Tensor) -> torch.Tensor:
    """transformers' ``[1, kv_heads, T, D]`` as the runner's rows ``[1, T, kv_heads, D]``."""
    b, kv_heads, t, d = states.shape
    return states.reshape(b, t, 1, d) if kv_heads == 1 else states.transpose(1, 2)


def _heads_first(ring: torch.Tensor) -> torch.Tensor:
    """The runner's ring ``[1, W, kv_heads, D]`` as ``[1, kv_heads, W, D]``."""
    b, w, kv_heads, d = ring.shape
    return ring.reshape(b, 1, w, d) if kv_heads == 1 else ring.transpose(1, 2)


class ExternalStaticLayer:
    """A full-attention layer whose buffer lives in the runner: past in, present (= past with the
    call's rows written) out, both ``[1, kv_heads, max_cache_len, head_dim]``.

    Not an ``nn.Module``: it holds only the tensors of the call being traced, no state.
    """

    window = None

    def __init__(self):
        self.past_k = self.past_v = self.present_k = self.present_v = None

    def bind(self, past_k: torch.Tensor, past_v: torch.Tensor) -> None:
        self.past_k, self.past_v = past_k, past_v

    def attend(self, module, query, key, value, mask, call, scaling=None, **kwargs):
        if not plain_softmax_attention(kwargs):
            self.present_k = self.past_k.index_copy(2, call.positions, key)
            self.present_v = self.past_v.index_copy(2, call.positions, value)
            return family_eager_attention(module)(
                module, query, self.present_k, self.present_v, mask, scaling=scaling, **kwargs
            )
        (q, k, v), heads, kv_heads, scale = _kernel_inputs(query, key, value, scaling)
        last = call.positions[-1:]  # P + T - 1
        lengths = last.to(torch.int32), (last[0] + 1).to(torch.int32)  # seqlens_k, total_length
        out, self.present_k, self.present_v = torch.ops.kvexport.group_query_attention(
            q, k, v, self.past_k, self.past_v, *lengths, heads, kv_heads, scale
        )
        return out.view(1, q.shape[1], heads, -1), None

    def key_positions(self, positions: torch.Tensor) -> torch.Tensor:
        """Every slot of the buffer (the fallback's mask covers them all; slot i holds position i)."""
        return torch.arange(self.past_k.shape[2], device=positions.device)


class ExternalRingLayer:
    """A sliding layer whose ring lives in the runner: the whole ring in (sequence-major
    ``[1, W, kv_heads, head_dim]``), the call's new rows out (``[1, T, kv_heads, head_dim]``),
    which the runner writes into their slots. Attention sees the ring as it was before the call
    followed by the call's keys, masked to the window, as ``kv_cache.RingKVCache`` does.

    Not an ``nn.Module``: it holds only the tensors of the call being traced, no state.
    """

    def __init__(self, window: int):
        self.window = window
        self.past_k = self.past_v = self.present_k = self.present_v = None

    def bind(self, past_k: torch.Tensor, past_v: torch.Tensor) -> None:
        self.past_k, self.past_v = past_k, past_v

    def attend(self, module, query, key, value, mask, call, scaling=None, **kwargs):
        # transformers' states are [1, kv_heads, T, head_dim]; the runner's rows are sequence-major.
        self.present_k, self.present_v = _sequence_first(key), _sequence_first(value)
        ring_k, ring_v = _heads_first(self.past_k), _heads_first(self.past_v)
        if not plain_softmax_attention(kwargs):
            keys, values = torch.cat([ring_k, key], dim=2), torch.cat([ring_v, value], dim=2)
            return family_eager_attention(module)(module, query, keys, values, mask, scaling=scaling, **kwargs)
        (q, k, v), heads, kv_heads, scale = _kernel_inputs(query, key, value, scaling)
        # The kernel's lengths, W + T, from the positions (tensors: no integer fixed at export).
        last = call.positions[-1:] - call.positions[:1] + self.window  # W + T - 1
        lengths = last.to(torch.int32), (last[0] + 1).to(torch.int32)  # seqlens_k, total_length
        out = torch.ops.kvexport.ring_attention(q, k, v, ring_k, ring_v, *lengths, mask, heads, kv_heads, scale)
        return out.view(1, q.shape[1], heads, -1), None

    def key_positions(self, positions: torch.Tensor) -> torch.Tensor:
        return ring_key_positions(positions, self.window)
