"""kvexport's attention op in PyTorch against the ONNX Runtime ``GroupQueryAttention`` kernel it is
exported as: the wrapper runs the first, the ONNX artifact the second."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

from kvexport.exporter.onnx import attention  # noqa: F401  (registers the ops)

HEADS, KV_HEADS, HEAD_DIM = 6, 2, 16  # 16: the kernel's least for an int8 window
SLOTS, WINDOW = 40, 5
SCALE = 0.3
SCALES_SHAPE = [1, KV_HEADS, 1, HEAD_DIM]
INPUTS = ["query", "key", "value", "past_key", "past_value", "seqlens_k", "total_length"]


def _session(window: int, softcap: float, sinks: bool, int8: bool = False) -> ort.InferenceSession:
    """One GroupQueryAttention node, as kvexport's exporter writes it."""
    f = TensorProto.FLOAT
    cache = TensorProto.INT8 if int8 else f
    past = [1, KV_HEADS, "rows", HEAD_DIM]
    inputs = [
        helper.make_tensor_value_info("query", f, [1, "T", HEADS * HEAD_DIM]),
        helper.make_tensor_value_info("key", f, [1, "T", KV_HEADS * HEAD_DIM]),
        helper.make_tensor_value_info("value", f, [1, "T", KV_HEADS * HEAD_DIM]),
        helper.make_tensor_value_info("past_key", cache, past),
        helper.make_tensor_value_info("past_value", cache, past),
        helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, [1]),
        helper.make_tensor_value_info("total_length", TensorProto.INT32, []),
    ]
    names = list(INPUTS)
    if sinks:
        inputs.append(helper.make_tensor_value_info("sinks", f, [HEADS]))
    if sinks or int8:  # cos, sin, position_ids, bias, then the sinks' slot
        names += ["", "", "", "", "sinks" if sinks else ""]
    attributes = {"num_heads": HEADS, "kv_num_heads": KV_HEADS, "scale": SCALE}
    if int8:
        inputs += [helper.make_tensor_value_info(name, f, SCALES_SHAPE) for name in ("k_scale", "v_scale")]
        names += ["k_scale", "v_scale"]
        attributes |= {"k_quant_type": "PER_CHANNEL", "v_quant_type": "PER_CHANNEL", "kv_cache_bit_width": 8}
    if window > 0:
        attributes |= {"local_window_size": window, "sliding_window_cache": 1}
    if softcap > 0:
        attributes["softcap"] = softcap
    node = helper.make_node("GroupQueryAttention", names, ["out", "present_key", "present_value"], domain="com.microsoft", **attributes)
    outputs = [helper.make_tensor_value_info(name, type_, None) for name, type_ in (("out", f), ("present_key", cache), ("present_value", cache))]
    graph = helper.make_graph([node], "attention", inputs, outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 10  # what this onnxruntime reads
    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _random_call(generator, t):
    return [torch.randn(1, t, n * HEAD_DIM, generator=generator) for n in (HEADS, KV_HEADS, KV_HEADS)]


# Tokens per call: a prompt, decode steps, chunks, and (for a window) calls longer than the window.
CALLS = [5, 1, 3, 1, 1, 7, 1, 12, 1, 2]


@pytest.mark.parametrize(
    "rows, window, softcap, sinks, int8",
    [(SLOTS, -1, 0.0, False, False), (WINDOW, WINDOW, 0.0, False, False), (WINDOW + 3, WINDOW, 0.0, False, False),
     (SLOTS, -1, 2.0, False, False), (WINDOW, WINDOW, 2.0, True, False), (SLOTS, -1, 0.0, True, False),
     (SLOTS, -1, 0.0, False, True), (WINDOW, WINDOW, 0.0, False, True), (WINDOW, WINDOW, 2.0, True, True)],
    ids=["full", "window", "window-with-slack", "full-softcap", "window-softcap-sinks", "full-sinks",
         "full-int8", "window-int8", "window-softcap-sinks-int8"],
)  # fmt: skip
def test_attention_op_matches_onnx_runtime_over_prefill_chunks_and_decode(rows, window, softcap, sinks, int8):
    """Output of every call within 1e-5; a full layer's buffer row for row. A window's buffer
    holds the kernel's own layout, which only the kernel reads: with exactly the window's rows,
    the op keeps the same (the newest positions in order from row 0). int8 buffers: scales that
    saturate some of the random values, so the kernel's clamping is compared too."""
    session = _session(window, softcap, sinks, int8)
    generator = torch.Generator().manual_seed(0)
    head_sinks = torch.randn(HEADS, generator=generator) if sinks else None
    scales = [torch.rand(SCALES_SHAPE, generator=generator) / 64 + 1 / 128 for _ in range(2)] if int8 else [None, None]
    cache_dtype = torch.int8 if int8 else torch.float32
    torch_cache = [torch.zeros(1, KV_HEADS, rows, HEAD_DIM, dtype=cache_dtype) for _ in range(2)]
    ort_cache = [np.zeros((1, KV_HEADS, rows, HEAD_DIM), dtype=np.int8 if int8 else np.float32) for _ in range(2)]
    saturated = 0
    end = 0
    for t in CALLS:
        query, key, value = _random_call(generator, t)
        end += t
        seqlens_k, total = torch.tensor([end - 1], dtype=torch.int32), torch.tensor(end, dtype=torch.int32)
        out, *torch_cache = torch.ops.kvexport.group_query_attention(
            query, key, value, *torch_cache, seqlens_k, total, head_sinks, *scales, HEADS, KV_HEADS, SCALE, window, softcap
        )
        # ONNX Runtime with past and present in one buffer, as kvexport's runner binds them.
        binding = session.io_binding()
        arrays = {name: x.numpy() for name, x in zip(INPUTS[:3] + INPUTS[5:], (query, key, value, seqlens_k, total))}
        if sinks:
            arrays["sinks"] = head_sinks.numpy()
        if int8:
            arrays |= {"k_scale": scales[0].numpy(), "v_scale": scales[1].numpy()}
            saturated += int((torch_cache[0].abs() >= 127).sum())
        for name, array in arrays.items():
            binding.bind_input(name, "cpu", 0, array.dtype, list(array.shape), array.ctypes.data)
        expected = np.zeros((1, t, HEADS * HEAD_DIM), dtype=np.float32)
        binding.bind_output("out", "cpu", 0, np.float32, list(expected.shape), expected.ctypes.data)
        for kv, buffer in zip(("key", "value"), ort_cache):
            binding.bind_input(f"past_{kv}", "cpu", 0, buffer.dtype, list(buffer.shape), buffer.ctypes.data)
            binding.bind_output(f"present_{kv}", "cpu", 0, buffer.dtype, list(buffer.shape), buffer.ctypes.data)
        session.run_with_iobinding(binding)
        np.testing.assert_allclose(out.numpy(), expected, rtol=0, atol=1e-5, err_msg=f"call ending at {end}")
        if window < 0 or rows == window:
            for mine, theirs in zip(torch_cache, ort_cache):
                assert np.array_equal(mine.numpy(), theirs)  # rows written, not computed
    assert not int8 or saturated > 0


def test_a_window_hides_what_lies_before_it():
    """The op's window is the kernel's ``local_window_size``: each query sees its last W positions only."""
    generator = torch.Generator().manual_seed(2)
    t = 6
    query, key, value = _random_call(generator, t)
    lengths = torch.tensor([t - 1], dtype=torch.int32), torch.tensor(t, dtype=torch.int32)
    full_cache = [torch.zeros(1, KV_HEADS, SLOTS, HEAD_DIM) for _ in range(2)]
    window_cache = [torch.zeros(1, KV_HEADS, WINDOW, HEAD_DIM) for _ in range(2)]
    full, *_ = torch.ops.kvexport.group_query_attention(query, key, value, *full_cache, *lengths, None, None, None, HEADS, KV_HEADS, SCALE, -1, 0.0)
    windowed, *present = torch.ops.kvexport.group_query_attention(
        query, key, value, *window_cache, *lengths, None, None, None, HEADS, KV_HEADS, SCALE, WINDOW, 0.0
    )
    # Queries 0..W-1 see all their positions either way; query W no longer sees position 0.
    torch.testing.assert_close(windowed[:, :WINDOW], full[:, :WINDOW], rtol=0, atol=0)
    assert not torch.allclose(windowed[:, WINDOW:], full[:, WINDOW:])
    # The window's buffer keeps positions 1..5 (the call's last W) in order.
    assert torch.equal(present[0][0], key[0].view(t, KV_HEADS, HEAD_DIM).transpose(0, 1)[:, 1:])


def test_a_chunked_layer_attends_within_each_chunk_over_calls_of_any_length():
    """``ExternalChunkedLayer`` (Llama 4's chunked attention) driven as kvexport's runner drives it,
    its present bound as the next call's past (a buffer of one chunk's rows), against attention
    over the whole history masked with transformers' own chunk mask; calls that start, end and
    run across chunk boundaries, some longer than a chunk."""
    from transformers.masking_utils import and_masks, causal_mask_function, chunked_overlay

    from kvexport.exporter.kv_cache import CallState
    from kvexport.exporter.onnx.attention import ExternalChunkedLayer

    chunk, generator = WINDOW, torch.Generator().manual_seed(3)
    layer = ExternalChunkedLayer(1, KV_HEADS, chunk, HEAD_DIM, torch.float32)
    past = [torch.zeros(1, KV_HEADS, chunk, HEAD_DIM) for _ in range(2)]
    total = sum(CALLS)
    q, k, v = torch.randn(1, HEADS, total, HEAD_DIM, generator=generator), *(
        torch.randn(1, KV_HEADS, total, HEAD_DIM, generator=generator) for _ in range(2)
    )
    outs, start = [], 0
    for t in CALLS:
        layer.bind(*past)
        part = slice(start, start + t)
        call = CallState(None, torch.arange(start, start + t), total)
        out, _ = layer.attend(None, q[:, :, part], k[:, :, part], v[:, :, part], None, call, scaling=SCALE)
        outs.append(out.transpose(1, 2))
        past = [layer.present_k, layer.present_v]
        start += t
    mask_fn = and_masks(causal_mask_function, chunked_overlay(chunk, torch.zeros(1, dtype=torch.long)))
    idx = [torch.tensor(i) for i in range(total)]
    visible = torch.tensor([[bool(mask_fn(idx[0], idx[0], qi, ki)) for ki in idx] for qi in idx])
    group = HEADS // KV_HEADS
    scores = (q @ k.repeat_interleave(group, dim=1).transpose(-1, -2) * SCALE).masked_fill(~visible, float("-inf"))
    expected = torch.softmax(scores, dim=-1) @ v.repeat_interleave(group, dim=1)
    torch.testing.assert_close(torch.cat(outs, dim=2), expected, atol=1e-5, rtol=1e-5)
