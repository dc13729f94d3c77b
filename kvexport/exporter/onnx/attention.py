"""The ONNX graph's layers: the runtime's cache buffers in and out, attention as ONNX Runtime's
``GroupQueryAttention`` (``com.microsoft``), the kernel onnxruntime-genai's own models use, on the
buffers onnxruntime-genai allocates.

- Full attention (``ExternalStaticLayer``): the buffer is head-major
  ``[1, kv_heads, max_cache_len, head_dim]``, row i holding position i. The graph takes the whole
  buffer as ``past`` and returns it, with the call's rows written at positions ``P .. P+T-1``, as
  ``present``. A runner that binds both to the same memory (``past_present_share_buffer``) has the
  rows written in place, and the kernel reads only the first ``P + T`` rows.
- Sliding window (``ExternalWindowLayer``): the same kernel with ``local_window_size`` W and
  ``sliding_window_cache=1`` over a buffer of W rows (or more: onnxruntime-genai adds a slack).
  The kernel keeps the newest positions in order at the buffer's first rows and evicts the
  oldest itself, so the runner never moves a row; a call may be longer than the window.

- Chunked attention (``ExternalChunkedLayer``): a sliding layer's buffer of one chunk, which the
  kernel writes; the attention in plain ops, masked to each query's chunk. The kernel's (dropped)
  query is that attention's output, so the graph runs every read of the past before the write.

Both read the call's lengths as onnxruntime-genai's builder derives them from ``attention_mask``
(ones, ``[1, P + T]``): ``seqlens_k`` = sum - 1 and ``total_sequence_length`` = its width
(``lengths_from_mask``). Soft-capping (Gemma 2) is the kernel's ``softcap`` and attention sinks
(gpt-oss) its ``head_sink``, so every family runs the same node.

In PyTorch the node is the op ``kvexport::group_query_attention``, a plain implementation of the
kernel's semantics (what the decoder runs eagerly); ``ONNX_TRANSLATIONS`` maps it to the node for
``torch.onnx.export``.
"""

from __future__ import annotations

import torch

from ...errors import UnsupportedModelError
from ...models.architecture import CHUNKED, RING, STATIC


def _attention(query, keys, values, num_heads: int, kv_num_heads: int, scale: float, bias, softcap: float, sinks):
    """softmax(softcap(Q K^T · scale) + bias) V in float32 for ``query [1, T, num_heads * D]`` and
    head-major ``keys``/``values [kv_num_heads, K, D]``; ``sinks [num_heads]`` (or None) join each
    head's softmax as one more logit whose value is dropped. Returns ``[1, T, num_heads * D]``."""
    t = query.shape[1]
    d = query.shape[2] // num_heads
    group = num_heads // kv_num_heads
    q = query[0].view(t, num_heads, d).transpose(0, 1).float()
    scores = q @ keys.repeat_interleave(group, dim=0).float().transpose(1, 2) * scale
    if softcap > 0:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores + bias
    if sinks is not None:
        sink = sinks.float().view(num_heads, 1, 1).expand(num_heads, t, 1)
        weights = torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1]
    else:
        weights = scores.softmax(dim=-1)
    out = weights @ values.repeat_interleave(group, dim=0).float()
    return out.transpose(0, 1).reshape(1, t, num_heads * d).to(query.dtype)


def _visible(key_positions: torch.Tensor, query_positions: torch.Tensor, window: int) -> torch.Tensor:
    """Additive bias: query q sees key k iff k <= q and, with a window, k > q - window."""
    k, q = key_positions[None, :], query_positions[:, None]
    visible = (k <= q) & ((k > q - window) if window > 0 else True)
    return torch.zeros(visible.shape).masked_fill(~visible, float("-inf"))


def quantize_to_cache(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x [kv_heads, T, D]`` as the kernel stores it in an int8 buffer with ``scale [1, kv_heads, 1, D]``:
    x / scale rounded half to even, saturated to int8."""
    return torch.round(x.float() / scale[0]).clamp(-128, 127).to(torch.int8)


def dequantize_from_cache(x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    return x if scale is None else x.float() * scale[0]


@torch.library.custom_op("kvexport::group_query_attention", mutates_args=())
def group_query_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    past_key: torch.Tensor,
    past_value: torch.Tensor,
    seqlens_k: torch.Tensor,
    total_length: torch.Tensor,
    sinks: torch.Tensor | None,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    num_heads: int,
    kv_num_heads: int,
    scale: float,
    local_window: int,
    softcap: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``GroupQueryAttention`` with past and present in one buffer, batch 1.

    ``query [1, T, num_heads * D]``, ``key``/``value [1, T, kv_num_heads * D]``, ``past_*``
    ``[1, kv_num_heads, C, D]``, ``total_length`` = P + T (0-d int32), ``seqlens_k`` = ``[P + T - 1]``.
    ``local_window`` <= 0: row i holds position i, the call's rows go to ``P .. P+T-1``.
    ``local_window`` W > 0 (``sliding_window_cache``): rows ``0 .. min(P, C)-1`` hold the newest
    positions before the call in order; the present holds the newest ``min(P + T, C)`` the same way,
    and each query sees the last W positions up to its own. ``k_scale``/``v_scale``
    ``[1, kv_num_heads, 1, D]`` (float32): the buffers are int8 with one fixed scale per channel
    (``k_quant_type``/``v_quant_type`` PER_CHANNEL); the call's rows are quantized as they are
    written, and every row is read dequantized. Returns ``(out [1, T, num_heads * D], present_key,
    present_value)``, presents shaped and typed as the pasts.
    """
    t = query.shape[1]
    end = int(total_length)
    start = end - t
    new_k = key[0].view(t, kv_num_heads, -1).transpose(0, 1)
    new_v = value[0].view(t, kv_num_heads, -1).transpose(0, 1)
    if k_scale is not None:
        new_k, new_v = quantize_to_cache(new_k, k_scale), quantize_to_cache(new_v, v_scale)
    present_key, present_value = past_key.clone(), past_value.clone()
    if local_window > 0:
        capacity = past_key.shape[2]
        held = min(start, capacity)
        keys, values = torch.cat([past_key[0, :, :held], new_k], 1), torch.cat([past_value[0, :, :held], new_v], 1)
        kept = min(held + t, capacity)
        present_key[0, :, :kept], present_value[0, :, :kept] = keys[:, -kept:], values[:, -kept:]
        key_positions = torch.arange(start - held, end)
    else:
        present_key[0, :, start:end], present_value[0, :, start:end] = new_k, new_v
        keys, values = present_key[0, :, :end], present_value[0, :, :end]
        key_positions = torch.arange(end)
    bias = _visible(key_positions, torch.arange(start, end), local_window)
    keys, values = dequantize_from_cache(keys, k_scale), dequantize_from_cache(values, v_scale)
    out = _attention(query, keys, values, num_heads, kv_num_heads, scale, bias, softcap, sinks)
    return out, present_key, present_value


@group_query_attention.register_fake
def _(query, key, value, past_key, past_value, seqlens_k, total_length, sinks, k_scale, v_scale, num_heads, kv_num_heads, scale, local_window, softcap):
    return torch.empty_like(query), torch.empty_like(past_key), torch.empty_like(past_value)


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
            param("past_key", "C"),
            param("past_value", "C"),
            param("seqlens_k", "M"),
            param("total_sequence_length", "M"),
            param("cos_cache", "T", optional=True),
            param("sin_cache", "T", optional=True),
            param("position_ids", "P", optional=True),
            param("attention_bias", "T", optional=True),
            param("head_sink", "T", optional=True),
            param("k_scale", "S", optional=True),
            param("v_scale", "S", optional=True),
        ],
        outputs=[param("output", "T"), param("present_key", "C"), param("present_value", "C")],
        type_constraints=[
            ("T", ["tensor(float)", "tensor(float16)"], ""),
            ("C", ["tensor(float)", "tensor(float16)", "tensor(int8)"], ""),
            ("S", ["tensor(float)"], ""),
            ("M", ["tensor(int32)"], ""),
            ("P", ["tensor(int64)"], ""),
        ],
        attributes=[
            OpSchema.Attribute("num_heads", OpSchema.AttrType.INT, ""),
            OpSchema.Attribute("kv_num_heads", OpSchema.AttrType.INT, ""),
            OpSchema.Attribute("scale", OpSchema.AttrType.FLOAT, ""),
            OpSchema.Attribute("local_window_size", OpSchema.AttrType.INT, ""),
            OpSchema.Attribute("sliding_window_cache", OpSchema.AttrType.INT, ""),
            OpSchema.Attribute("softcap", OpSchema.AttrType.FLOAT, ""),
            OpSchema.Attribute("k_quant_type", OpSchema.AttrType.STRING, ""),
            OpSchema.Attribute("v_quant_type", OpSchema.AttrType.STRING, ""),
            OpSchema.Attribute("kv_cache_bit_width", OpSchema.AttrType.INT, ""),
        ],
    )


def _group_query_attention_onnx(
    query, key, value, past_key, past_value, seqlens_k, total_length, sinks, k_scale, v_scale,
    num_heads: int, kv_num_heads: int, scale: float, local_window: int, softcap: float,
):  # fmt: skip
    import onnxscript

    op = onnxscript.values.Op(onnxscript.values.Opset("com.microsoft", 1), "GroupQueryAttention", _onnx_schema())
    attributes = {"num_heads": num_heads, "kv_num_heads": kv_num_heads, "scale": scale}
    if local_window > 0:
        attributes |= {"local_window_size": local_window, "sliding_window_cache": 1}
    if softcap > 0:
        attributes["softcap"] = softcap
    optional = (None, None, None, None, sinks) if sinks is not None else ()  # cos, sin, position_ids, bias, sinks
    if k_scale is not None:
        attributes |= {"k_quant_type": "PER_CHANNEL", "v_quant_type": "PER_CHANNEL", "kv_cache_bit_width": 8}
        optional = (None, None, None, None, sinks, k_scale, v_scale)
    return op(query, key, value, past_key, past_value, seqlens_k, total_length, *optional, **attributes)


ONNX_TRANSLATIONS = {torch.ops.kvexport.group_query_attention.default: _group_query_attention_onnx}


def _kernel_inputs(query, key, value, scaling):
    """transformers' ``[1, heads, T, D]`` states as the kernel's ``[1, T, heads * D]``, its head counts and scale."""
    _, heads, t, d = query.shape
    kv_heads = key.shape[1]
    flat = [x.transpose(1, 2).reshape(1, t, x.shape[1] * d) for x in (query, key, value)]
    return flat, heads, kv_heads, float(scaling if scaling is not None else d**-0.5)


class _BufferLayer:
    """A layer whose buffer lives in the runner, head-major ``[1, kv_heads, rows, head_dim]``:
    past in, present out, which a runner binds to the same memory. ``window`` > 0: a sliding
    layer's window-sized buffer (see the module's docstring).

    Not an ``nn.Module``: it holds only the tensors of the call being traced, no state; an int8
    buffer's fixed scales (``k_scale``/``v_scale``) are the decoder's buffers (``quantized_kv_cache``).
    """

    def __init__(self, window: int | None = None):
        self.window = window
        self.past_k = self.past_v = self.present_k = self.present_v = None
        self.k_scale = self.v_scale = None
        self.observe = None  # called with each call's keys and values (``quantized_kv_cache.calibrate``)
        # A window whose layers that share it attend from every token of a call (Gemma 3n): they see
        # what the window held before the call, which the kernel overwrites in place, so this layer
        # attends and writes in plain ops (``_attend_in_plain_ops``) and keeps what it attended to.
        self.in_plain_ops = False

    def bind(self, past_k: torch.Tensor, past_v: torch.Tensor) -> None:
        self.past_k, self.past_v = past_k, past_v

    def key_positions(self, positions: torch.Tensor) -> torch.Tensor:
        """For transformers' mask, which the kernel does not read (it masks by its lengths)."""
        return torch.arange(self.past_k.shape[2], device=positions.device)

    def attend(self, module, query, key, value, mask, call, scaling=None, softcap=None, s_aux=None, dropout=0.0, **kwargs):
        if dropout:
            raise UnsupportedModelError("attention dropout in the exported model: export a model in eval mode")
        t = query.shape[2]
        if self.observe is not None:
            self.observe(key, value)
        if self.in_plain_ops:
            return self._attend_in_plain_ops(query, key, value, call, scaling, softcap, s_aux)
        (q, k, v), heads, kv_heads, scale = _kernel_inputs(query, key, value, scaling)
        out = self._kernel(q, k, v, heads, kv_heads, scale, call, softcap, s_aux)
        return out.view(1, t, heads, -1), None

    def _kernel(self, q, k, v, heads, kv_heads, scale, call, softcap, s_aux):
        """The kernel on the flat ``q``/``k``/``v`` (``_kernel_inputs``): writes the call's rows into
        the present buffer and returns its attention ``[1, T, heads * D]``."""
        last = call.positions[-1:]  # P + T - 1: the kernel's lengths (the graph reads them from the mask)
        seqlens_k, total_length = last.to(torch.int32), (last[0] + 1).to(torch.int32)
        out, self.present_k, self.present_v = torch.ops.kvexport.group_query_attention(
            q, k, v, self.past_k, self.past_v, seqlens_k, total_length, s_aux, self.k_scale, self.v_scale,
            heads, kv_heads, scale, self.window or -1, float(softcap or 0.0),
        )  # fmt: skip
        return out

    def read(self, module, query, call, scaling=None, softcap=None, s_aux=None, dropout=0.0, **kwargs):
        """A shared layer's queries (the call's last ``query.shape[2]``) in plain ops (the kernel would
        write the call's rows again): over what a window in plain ops attended to in the call, else
        over the present buffer this layer's node wrote. Row ``r`` holds position ``r`` in a full
        layer's buffer, ``total - kept + r`` in a window's (the newest ``kept = min(total, rows)``
        positions in order), so a kernel's window serves the call's last query only: the rows an
        earlier one needs may be gone."""
        t = query.shape[2]
        if self.in_plain_ops:
            keys, values, key_positions = call.attended[self]
        else:
            key_positions = torch.arange(self.present_k.shape[2])
            total = call.positions[-1:] + 1
            if self.window:
                torch._check(t == 1)
                key_positions = total - torch.clamp(total, max=self.present_k.shape[2]) + key_positions
            keys = dequantize_from_cache(self.present_k[0], self.k_scale)
            values = dequantize_from_cache(self.present_v[0], self.v_scale)
        return self._plain_attention(query, keys, values, key_positions, call, scaling, softcap, s_aux)

    def _plain_attention(self, query, keys, values, key_positions, call, scaling, softcap, s_aux):
        """The kernel's attention in plain ops for queries at the call's last ``query.shape[2]``
        positions over head-major ``keys``/``values [kv_heads, K, D]`` at ``key_positions``."""
        _, heads, t, d = query.shape
        bias = _visible(key_positions, call.positions[call.positions.shape[0] - t :], self.window or 0)
        q = query.transpose(1, 2).reshape(1, t, heads * d)
        scale = float(scaling if scaling is not None else d**-0.5)
        out = _attention(q, keys, values, heads, keys.shape[0], scale, bias, float(softcap or 0.0), s_aux)
        return out.view(1, t, heads, -1), None

    def _attend_in_plain_ops(self, query, key, value, call, scaling, softcap, s_aux):
        """The kernel's window semantics in plain ops: attend over the past buffer's rows (row ``r``
        holding position ``P - held + r``, ``held = min(P, rows)``) and the call's, and write the
        present as the kernel does, the newest ``kept = min(P + T, rows)`` positions in order from
        row 0. Every read of the past comes before the present is written (the present is gathered
        from their concatenation), so the runner may still bind both to one buffer."""
        new_k, new_v = key[0], value[0]
        if self.k_scale is not None:  # the call's rows as the int8 buffer holds them
            new_k, new_v = quantize_to_cache(new_k, self.k_scale), quantize_to_cache(new_v, self.v_scale)
        rows_k, rows_v = torch.cat([self.past_k[0], new_k], 1), torch.cat([self.past_v[0], new_v], 1)
        capacity, start, end = self.past_k.shape[2], call.positions[:1], call.positions[-1:] + 1
        held, kept = torch.clamp(start, max=capacity), torch.clamp(end, max=capacity)
        rows = torch.arange(capacity)
        # A row the buffer did not hold yet gets a position no query's window reaches.
        past_positions = torch.where(rows < held, start - held + rows, -self.window - 1)
        key_positions = torch.cat([past_positions, call.positions])
        position = end - kept + rows  # what present row r holds, r < kept
        source = torch.where(position >= start, capacity + position - start, position - start + held)
        source = torch.where(rows < kept, source, rows)  # rows past kept keep what they held
        self.present_k = rows_k.index_select(1, source)[None]
        self.present_v = rows_v.index_select(1, source)[None]
        keys, values = dequantize_from_cache(rows_k, self.k_scale), dequantize_from_cache(rows_v, self.v_scale)
        call.attended[self] = keys, values, key_positions  # for the layers that share this window
        return self._plain_attention(query, keys, values, key_positions, call, scaling, softcap, s_aux)


class ExternalStaticLayer(_BufferLayer):
    """A full-attention layer: ``max_cache_len`` rows, row i holds position i."""

    def __init__(self, batch: int, kv_heads: int, slots: int, head_dim: int, dtype: torch.dtype):
        super().__init__()  # the shape is the runner's buffer's


class ExternalWindowLayer(_BufferLayer):
    """A sliding layer: a buffer of ``window`` rows (the runner may give more), the newest
    positions in order from row 0."""

    def __init__(self, batch: int, kv_heads: int, window: int, head_dim: int, dtype: torch.dtype):
        super().__init__(window)


class ExternalChunkedLayer(_BufferLayer):
    """A chunked-attention layer (Llama 4): a token at ``q`` attends to positions ``[q - q % C, q]``
    for chunks of ``C``. The buffer is a sliding layer's of ``C`` rows, written by the kernel as it
    writes a window's (every key a token attends to is among the last ``C`` positions); the kernel
    cannot mask a chunk's start, so the attention runs in plain ops over the past rows and the
    call's keys, and the kernel's own output is dropped. Row ``r`` of the past holds position
    ``P - min(P, rows) + r`` (the newest positions before the call, in order from row 0) where the
    buffer has exactly ``C`` rows, as kvexport's runner gives it; genai gives more and compacts
    (``target.genai_cannot_run``).

    The runner binds past and present to one buffer, which the kernel writes in place, so every
    plain-ops read of the past must come before the kernel runs. The graph states that as a data
    dependency, not by node order: the kernel's query (whose output is dropped, and which does not
    change the rows it writes) is the plain-ops attention's output, computed from those reads."""

    def __init__(self, batch: int, kv_heads: int, chunk: int, head_dim: int, dtype: torch.dtype):
        super().__init__(chunk)

    def attend(self, module, query, key, value, mask, call, scaling=None, softcap=None, s_aux=None, dropout=0.0, **kwargs):
        if dropout:
            raise UnsupportedModelError("attention dropout in the exported model: export a model in eval mode")
        if self.observe is not None:
            self.observe(key, value)
        _, heads, t, d = query.shape
        start = call.positions[:1]
        rows = torch.arange(self.past_k.shape[2])
        held = torch.clamp(start, max=self.past_k.shape[2])
        past_positions = torch.where(rows < held, start - held + rows, -1)
        new_k, new_v = key[0], value[0]
        if self.k_scale is not None:  # the rows as the kernel writes them into an int8 buffer
            new_k = dequantize_from_cache(quantize_to_cache(new_k, self.k_scale), self.k_scale)
            new_v = dequantize_from_cache(quantize_to_cache(new_v, self.v_scale), self.v_scale)
        keys = torch.cat([dequantize_from_cache(self.past_k[0], self.k_scale).to(new_k.dtype), new_k], dim=1)
        values = torch.cat([dequantize_from_cache(self.past_v[0], self.v_scale).to(new_v.dtype), new_v], dim=1)
        bias = _in_chunk(torch.cat([past_positions, call.positions]), call.positions, self.window)
        q = query.transpose(1, 2).reshape(1, t, heads * d)
        scale = float(scaling if scaling is not None else d**-0.5)
        out = _attention(q, keys, values, heads, keys.shape[0], scale, bias, float(softcap or 0.0), s_aux)
        # The kernel writes the call's rows only after the reads above: its query is their result.
        (_, k, v), _, kv_heads, _ = _kernel_inputs(query, key, value, scaling)
        self._kernel(out, k, v, heads, kv_heads, scale, call, softcap, s_aux)
        return out.view(1, t, heads, -1), None


def _in_chunk(key_positions: torch.Tensor, query_positions: torch.Tensor, chunk: int) -> torch.Tensor:
    """Additive bias: query q sees key k iff 0 <= k <= q and k is in q's chunk, k >= q - q % chunk."""
    k, q = key_positions[None, :], query_positions[:, None]
    visible = (k >= 0) & (k <= q) & (k >= q - torch.remainder(q, chunk))
    return torch.zeros(visible.shape).masked_fill(~visible, float("-inf"))


EXTERNAL_LAYERS = {STATIC: ExternalStaticLayer, RING: ExternalWindowLayer, CHUNKED: ExternalChunkedLayer}


def lengths_from_mask(path) -> None:
    """Rewrite the ONNX model at ``path`` (its external data untouched) so that every
    ``GroupQueryAttention`` node reads ``seqlens_k`` = int32(ReduceSum(attention_mask) - 1) and
    ``total_sequence_length`` = int32(attention_mask's width), as onnxruntime-genai's builder
    writes them; the traced graph's own position arithmetic then goes."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from .graph import prune

    model = onnx.load(str(path), load_external_data=False)
    graph = model.graph
    attention = [n for n in graph.node if n.op_type == "GroupQueryAttention" and n.domain == "com.microsoft"]
    if not attention:
        return
    graph.initializer.extend([
        numpy_helper.from_array(np.array([1], np.int64), "mask_sum_axes"),
        numpy_helper.from_array(np.array(1, np.int64), "mask_one"),
    ])  # fmt: skip
    lengths = [
        helper.make_node("ReduceSum", ["attention_mask", "mask_sum_axes"], ["mask_sum"], name="mask_sum", keepdims=0),
        helper.make_node("Sub", ["mask_sum", "mask_one"], ["mask_sum_minus_one"], name="mask_sum_minus_one"),
        helper.make_node("Cast", ["mask_sum_minus_one"], ["seqlens_k"], name="seqlens_k", to=TensorProto.INT32),
        helper.make_node("Shape", ["attention_mask"], ["mask_shape"], name="mask_shape"),
        helper.make_node("Gather", ["mask_shape", "mask_one"], ["mask_width"], name="mask_width", axis=0),
        helper.make_node("Cast", ["mask_width"], ["total_sequence_length"], name="total_sequence_length", to=TensorProto.INT32),
    ]
    for node in attention:
        node.input[5], node.input[6] = "seqlens_k", "total_sequence_length"
    nodes = [*lengths, *graph.node]
    del graph.node[:]
    graph.node.extend(nodes)
    prune(graph)
    onnx.save(model, str(path))
