"""kvexport's attention ops in PyTorch against the ONNX Runtime ``GroupQueryAttention`` kernel they
are exported as: the wrapper runs the first, the ONNX artifact the second."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import torch
from onnx import TensorProto, helper

from kvexport.exporter import onnx_attention  # noqa: F401  (registers the ops)

HEADS, KV_HEADS, HEAD_DIM = 6, 2, 8
SLOTS, WINDOW = 32, 5
SCALE = 0.3
INPUTS = ["query", "key", "value", "past_key", "past_value", "seqlens_k", "total_length"]


def _session(past_rows: int, with_bias: bool) -> ort.InferenceSession:
    """One GroupQueryAttention node, as kvexport's exporter writes it."""
    f = TensorProto.FLOAT
    past = [1, KV_HEADS, past_rows, HEAD_DIM]
    inputs = [
        helper.make_tensor_value_info("query", f, [1, "T", HEADS * HEAD_DIM]),
        helper.make_tensor_value_info("key", f, [1, "T", KV_HEADS * HEAD_DIM]),
        helper.make_tensor_value_info("value", f, [1, "T", KV_HEADS * HEAD_DIM]),
        helper.make_tensor_value_info("past_key", f, past),
        helper.make_tensor_value_info("past_value", f, past),
        helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, [1]),
        helper.make_tensor_value_info("total_length", TensorProto.INT32, []),
    ]
    names = list(INPUTS)
    if with_bias:  # after the three optional rotary inputs, left out
        inputs.append(helper.make_tensor_value_info("attention_bias", f, [1, 1, "T", "K"]))
        names += ["", "", "", "attention_bias"]
    node = helper.make_node(
        "GroupQueryAttention", names, ["out", "present_key", "present_value"], domain="com.microsoft",
        num_heads=HEADS, kv_num_heads=KV_HEADS, scale=SCALE,
    )  # fmt: skip
    outputs = [helper.make_tensor_value_info(name, f, None) for name in ("out", "present_key", "present_value")]
    graph = helper.make_graph([node], "attention", inputs, outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 10  # what this onnxruntime reads
    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _random_call(generator, t):
    return [torch.randn(1, t, n * HEAD_DIM, generator=generator) for n in (HEADS, KV_HEADS, KV_HEADS)]


def test_static_layer_op_matches_onnx_runtime_over_prefill_chunks_and_decode():
    session = _session(SLOTS, with_bias=False)
    generator = torch.Generator().manual_seed(0)
    torch_cache = [torch.zeros(1, KV_HEADS, SLOTS, HEAD_DIM) for _ in range(2)]
    ort_cache = [np.zeros((1, KV_HEADS, SLOTS, HEAD_DIM), dtype=np.float32) for _ in range(2)]
    start = 0
    for t in (5, 1, 3, 1, 1, 7):  # a prompt, a decode step, a chunk with a past, ...
        query, key, value = _random_call(generator, t)
        end = start + t
        seqlens_k, total = torch.tensor([end - 1], dtype=torch.int32), torch.tensor(end, dtype=torch.int32)
        out, *torch_cache = torch.ops.kvexport.group_query_attention(
            query, key, value, *torch_cache, seqlens_k, total, HEADS, KV_HEADS, SCALE
        )
        # ONNX Runtime with past and present in one buffer, as kvexport's runner binds them.
        binding = session.io_binding()
        arrays = {name: x.numpy() for name, x in zip(INPUTS[:3] + INPUTS[5:], (query, key, value, seqlens_k, total))}
        for name, array in arrays.items():
            binding.bind_input(name, "cpu", 0, array.dtype, list(array.shape), array.ctypes.data)
        expected = np.zeros((1, t, HEADS * HEAD_DIM), dtype=np.float32)
        binding.bind_output("out", "cpu", 0, np.float32, list(expected.shape), expected.ctypes.data)
        for kv, buffer in zip(("key", "value"), ort_cache):
            binding.bind_input(f"past_{kv}", "cpu", 0, np.float32, list(buffer.shape), buffer.ctypes.data)
            binding.bind_output(f"present_{kv}", "cpu", 0, np.float32, list(buffer.shape), buffer.ctypes.data)
        session.run_with_iobinding(binding)
        np.testing.assert_allclose(out.numpy(), expected, rtol=0, atol=1e-5, err_msg=f"call at {start}")
        for mine, theirs in zip(torch_cache, ort_cache):
            assert np.array_equal(mine.numpy()[:, :, :end], theirs[:, :, :end])  # rows written, not computed
        assert not torch_cache[0][:, :, end:].any()
        start = end


def test_ring_layer_op_matches_onnx_runtime_with_a_mask():
    session = _session(WINDOW, with_bias=True)
    generator = torch.Generator().manual_seed(1)
    for t in (1, 4, 9):  # a decode step, and calls shorter and longer than the window
        query, key, value = _random_call(generator, t)
        ring_key, ring_value = (torch.randn(1, KV_HEADS, WINDOW, HEAD_DIM, generator=generator) for _ in range(2))
        # Any mask that leaves each query a visible key and hides later new keys, as a ring's does.
        hidden = torch.rand(1, 1, t, WINDOW + t, generator=generator) < 0.4
        hidden[..., WINDOW:] = torch.ones(t, t, dtype=torch.bool).triu(1)
        hidden[..., 0] = False
        bias = torch.zeros(hidden.shape).masked_fill(hidden, torch.finfo(torch.float32).min)
        seqlens_k, total = torch.tensor([WINDOW + t - 1], dtype=torch.int32), torch.tensor(WINDOW + t, dtype=torch.int32)
        inputs = (query, key, value, ring_key, ring_value, seqlens_k, total)
        out = torch.ops.kvexport.ring_attention(*inputs, bias, HEADS, KV_HEADS, SCALE)
        feeds = {name: x.numpy() for name, x in zip(INPUTS, inputs)}
        expected = session.run(["out"], {**feeds, "attention_bias": bias.numpy()})[0]
        np.testing.assert_allclose(out.numpy(), expected, rtol=0, atol=1e-5, err_msg=f"T = {t}")
