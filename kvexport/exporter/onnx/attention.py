"""The ONNX graph's layers: the runtime's cache buffers in and out, attention as ONNX Runtime's
``GroupQueryAttention`` (``com.microsoft``, the kernel onnxruntime-genai's models use).

- Full attention (``ExternalStaticLayer``): the runner's buffer is head-major
  ``[1, kv_heads, max_cache_len, head_dim]``; the graph takes the whole buffer as ``past`` and
  returns it, with the call's rows written at positions ``P .. P+T-1``, as ``present``. A runner
  that binds both to the same memory (ONNX Runtime's shared past/present buffer) has the rows
  written in place, and the kernel reads only the first ``P + T`` rows: decode cost follows the
  filled length, not ``max_cache_len``.
- Sliding window (``ExternalRingLayer``): the same kernel and layout over a buffer of ``2W``
  rows (``local_window_size`` W), shared past/present too. The runner keeps the rows contiguous
  in positions and passes ``ring_start``, the row the call's first token goes to: when a call
  would run past the last row, it first moves the last ``W - 1`` rows to the top (once every ~W
  tokens). The kernel reads only the window, and only the filled part of it.

In PyTorch this is the op ``kvexport::group_query_attention``, a plain implementation of the
kernel's semantics (what the decoder runs eagerly); ``ONNX_TRANSLATIONS`` maps it to the node for
``torch.onnx.export``.

A family whose attention needs more than softmax(QK^T·scale + mask)·V (soft-capping, attention
sinks) keeps the same interface and runs its own eager attention instead of the kernel.
"""

from __future__ import annotations

import torch

from ..attention import family_eager_attention, plain_softmax_attention


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


def _causal_bias(start: int, end: int, window: int) -> torch.Tensor:
    """Query ``start + i`` sees key rows ``0 .. start + i``, the last ``window`` of them when
    ``window`` > 0 (the kernel's own causal mask and ``local_window_size``)."""
    rows, queries = torch.arange(end)[None, :], torch.arange(start, end)[:, None]
    visible = (rows <= queries) & ((rows > queries - window) if window > 0 else True)
    return torch.zeros(visible.shape).masked_fill(~visible, float("-inf"))


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
    local_window: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``GroupQueryAttention`` with past and present in one buffer, batch 1.

    ``query [1, T, num_heads * D]``, ``key``/``value [1, T, kv_num_heads * D]``, ``past_*``
    ``[1, kv_num_heads, S, D]``, ``total_length`` = R + T (0-d int32), ``seqlens_k`` = ``[R + T - 1]``:
    the call's rows go to ``R .. R+T-1``. ``local_window`` > 0: each query sees only the last
    ``local_window`` rows up to its own. Returns ``(out [1, T, num_heads * D], present_key,
    present_value)``, presents shaped as the pasts.
    """
    t = query.shape[1]
    end = int(total_length)
    start = end - t
    present_key, present_value = past_key.clone(), past_value.clone()
    present_key[0, :, start:end] = key[0].view(t, kv_num_heads, -1).transpose(0, 1)
    present_value[0, :, start:end] = value[0].view(t, kv_num_heads, -1).transpose(0, 1)
    keys, values = present_key[0, :, :end], present_value[0, :, :end]
    out = _attention(query, keys, values, num_heads, kv_num_heads, scale, _causal_bias(start, end, local_window))
    return out, present_key, present_value


@group_query_attention.register_fake
def _(query, key, value, past_key, past_value, seqlens_k, total_length, num_heads, kv_num_heads, scale, local_window):
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
            param("past_key", "T"),
            param("past_value", "T"),
            param("seqlens_k", "M"),
            param("total_sequence_length", "M"),
            param("cos_cache", "T", optional=True),
            param("sin_cache", "T", optional=True),
            param("position_ids", "P", optional=True),
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
            OpSchema.Attribute("local_window_size", OpSchema.AttrType.INT, ""),
        ],
    )


def _group_query_attention_onnx(
    query, key, value, past_key, past_value, seqlens_k, total_length,
    num_heads: int, kv_num_heads: int, scale: float, local_window: int,
):  # fmt: skip
    import onnxscript

    op = onnxscript.values.Op(onnxscript.values.Opset("com.microsoft", 1), "GroupQueryAttention", _onnx_schema())
    # A full-attention node has no local_window_size: that is how the rotary fold tells them apart.
    window = {"local_window_size": local_window} if local_window > 0 else {}
    return op(
        query, key, value, past_key, past_value, seqlens_k, total_length,
        num_heads=num_heads, kv_num_heads=kv_num_heads, scale=scale, **window,
    )  # fmt: skip


ONNX_TRANSLATIONS = {torch.ops.kvexport.group_query_attention.default: _group_query_attention_onnx}


def _kernel_inputs(query, key, value, scaling):
    """transformers' ``[1, heads, T, D]`` states as the kernel's ``[1, T, heads * D]``, its head counts and scale."""
    _, heads, t, d = query.shape
    kv_heads = key.shape[1]
    flat = [x.transpose(1, 2).reshape(1, t, x.shape[1] * d) for x in (query, key, value)]
    return flat, heads, kv_heads, float(scaling if scaling is not None else d**-0.5)


class _BufferLayer:
    """A layer whose buffer lives in the runner, head-major ``[1, kv_heads, rows, head_dim]``:
    past in, present (= past with the call's rows written) out, which a runner binds to the same
    memory. The call's rows go to ``first_row(call) ..``; ``window`` > 0 limits what each query sees.

    Not an ``nn.Module``: it holds only the tensors of the call being traced, no state.
    """

    window = None

    def __init__(self):
        self.past_k = self.past_v = self.present_k = self.present_v = None

    def first_row(self, call) -> torch.Tensor:
        raise NotImplementedError

    def attend(self, module, query, key, value, mask, call, scaling=None, **kwargs):
        t = query.shape[2]
        first = self.first_row(call)  # [1]
        if not plain_softmax_attention(kwargs):
            rows = first + torch.arange(t, device=first.device)
            self.present_k = self.past_k.index_copy(2, rows, key)
            self.present_v = self.past_v.index_copy(2, rows, value)
            return family_eager_attention(module)(
                module, query, self.present_k, self.present_v, mask, scaling=scaling, **kwargs
            )
        (q, k, v), heads, kv_heads, scale = _kernel_inputs(query, key, value, scaling)
        last = first + (t - 1)  # the call's last row
        lengths = last.to(torch.int32), (last[0] + 1).to(torch.int32)  # seqlens_k, total_length
        out, self.present_k, self.present_v = torch.ops.kvexport.group_query_attention(
            q, k, v, self.past_k, self.past_v, *lengths, heads, kv_heads, scale, self.window or -1
        )
        return out.view(1, t, heads, -1), None


class ExternalStaticLayer(_BufferLayer):
    """A full-attention layer: ``max_cache_len`` rows, row i holds position i."""

    def bind(self, past_k: torch.Tensor, past_v: torch.Tensor, ring_start: torch.Tensor | None) -> None:
        self.past_k, self.past_v = past_k, past_v

    def first_row(self, call) -> torch.Tensor:
        return call.positions[:1]

    def key_positions(self, positions: torch.Tensor) -> torch.Tensor:
        """Every row of the buffer (the fallback's mask covers them all)."""
        return torch.arange(self.past_k.shape[2], device=positions.device)


class ExternalRingLayer(_BufferLayer):
    """A sliding layer: ``2W`` rows that the runner keeps contiguous in positions, the call's
    first token at row ``ring_start`` (a graph input), so row r holds position
    ``P - ring_start + r``. Rows ``ring_start - W + 1 .. ring_start - 1`` hold the window before
    the call; rows before those and after the call's hold anything finite, which attention never
    sees (outside every query's window, or past the kernel's lengths).
    """

    def __init__(self, window: int):
        super().__init__()
        self.window = window
        self.ring_start = None

    def bind(self, past_k: torch.Tensor, past_v: torch.Tensor, ring_start: torch.Tensor | None) -> None:
        self.past_k, self.past_v, self.ring_start = past_k, past_v, ring_start

    def first_row(self, call) -> torch.Tensor:
        return self.ring_start

    def key_positions(self, positions: torch.Tensor) -> torch.Tensor:
        return positions[:1] - self.ring_start + torch.arange(self.past_k.shape[2], device=positions.device)


# The kernel's total_sequence_length (input 6) is a host-memory input on ONNX Runtime's CUDA
# provider. Computed in the graph (input_pos + T), the value's chain runs on the GPU and is copied
# back for it, and onnxruntime-gpu 1.31 then feeds the kernel a wrong value (docs/onnx.md). So the
# runtime passes each total as a graph input, in host memory, as it does input_pos.
TOTAL_LENGTH_INPUTS = {"static": "total_length", "ring": "ring_total_length"}


def lengths_as_inputs(path) -> None:
    """Rewrite the ONNX model at ``path`` (its external data untouched) so that every
    ``GroupQueryAttention`` node reads its ``total_sequence_length`` from a graph input:
    ``total_length`` (= input_pos + T) for full-attention nodes, ``ring_total_length``
    (= ring_start + T) for sliding ones; a graph without such nodes is left as it is."""
    import onnx
    from onnx import TensorProto, helper

    from .graph import prune

    model = onnx.load(str(path), load_external_data=False)
    graph = model.graph
    used = set()
    for node in graph.node:
        if node.op_type == "GroupQueryAttention" and node.domain == "com.microsoft":
            kind = "ring" if any(a.name == "local_window_size" for a in node.attribute) else "static"
            node.input[6] = TOTAL_LENGTH_INPUTS[kind]
            used.add(kind)
    if not used:
        return
    for kind in ("static", "ring"):
        if kind in used:
            graph.input.append(helper.make_tensor_value_info(TOTAL_LENGTH_INPUTS[kind], TensorProto.INT32, []))
    prune(graph)
    onnx.save(model, str(path))
