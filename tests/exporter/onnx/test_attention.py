"""kvexport's attention ops in PyTorch against the ONNX Runtime ``GroupQueryAttention`` kernel they
are exported as: the wrapper runs the first, the ONNX artifact the second."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

from kvexport.exporter.onnx import attention  # noqa: F401  (registers the ops)

HEADS, KV_HEADS, HEAD_DIM = 6, 2, 8
SLOTS, WINDOW = 32, 5
SCALE = 0.3
INPUTS = ["query", "key", "value", "past_key", "past_value", "seqlens_k", "total_length"]


def _session(past_rows: int, window: int) -> ort.InferenceSession:
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
    node = helper.make_node(
        "GroupQueryAttention", INPUTS, ["out", "present_key", "present_value"], domain="com.microsoft",
        num_heads=HEADS, kv_num_heads=KV_HEADS, scale=SCALE, **({"local_window_size": window} if window > 0 else {}),
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


# (first row, tokens) per call; a ring's calls follow the runner: before a call that would pass
# the last of its 2W rows, the last W - 1 rows move to the top and the call starts at W - 1.
STATIC_CALLS = [(0, 5), (5, 1), (6, 3), (9, 1), (10, 1), (11, 7)]  # a prompt, a decode step, a chunk, ...
RING_CALLS = [(0, 3), (3, 5), (8, 1), (9, 1), (4, 5), (9, 1), (4, 1), (5, 4)]  # moves before the 5th and 7th


@pytest.mark.parametrize("rows, window, calls", [(SLOTS, -1, STATIC_CALLS), (2 * WINDOW, WINDOW, RING_CALLS)], ids=["static", "ring"])
def test_attention_op_matches_onnx_runtime_over_prefill_chunks_and_decode(rows, window, calls):
    session = _session(rows, window)
    generator = torch.Generator().manual_seed(0)
    torch_cache = [torch.zeros(1, KV_HEADS, rows, HEAD_DIM) for _ in range(2)]
    ort_cache = [np.zeros((1, KV_HEADS, rows, HEAD_DIM), dtype=np.float32) for _ in range(2)]
    end = 0
    for start, t in calls:
        if start < end:  # the runner's move: the last W - 1 rows to the top
            for mine, theirs in zip(torch_cache, ort_cache):
                mine[:, :, :start] = mine[:, :, end - start : end].clone()
                theirs[:, :, :start] = theirs[:, :, end - start : end]
        query, key, value = _random_call(generator, t)
        end = start + t
        seqlens_k, total = torch.tensor([end - 1], dtype=torch.int32), torch.tensor(end, dtype=torch.int32)
        out, *torch_cache = torch.ops.kvexport.group_query_attention(
            query, key, value, *torch_cache, seqlens_k, total, HEADS, KV_HEADS, SCALE, window
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
        np.testing.assert_allclose(out.numpy(), expected, rtol=0, atol=1e-5, err_msg=f"call at row {start}")
        for mine, theirs in zip(torch_cache, ort_cache):
            assert np.array_equal(mine.numpy()[:, :, :end], theirs[:, :, :end])  # rows written, not computed
        if window < 0:  # (a ring's rows past the call hold what the moves left there)
            assert not torch_cache[0][:, :, end:].any()


def test_a_window_hides_what_lies_before_it():
    """The op's window is the kernel's ``local_window_size``: each query sees its last W rows only."""
    generator = torch.Generator().manual_seed(2)
    t = 6
    query, key, value = _random_call(generator, t)
    cache = [torch.zeros(1, KV_HEADS, 2 * WINDOW, HEAD_DIM) for _ in range(2)]
    lengths = torch.tensor([t - 1], dtype=torch.int32), torch.tensor(t, dtype=torch.int32)
    full, *_ = torch.ops.kvexport.group_query_attention(query, key, value, *cache, *lengths, HEADS, KV_HEADS, SCALE, -1)
    windowed, *_ = torch.ops.kvexport.group_query_attention(
        query, key, value, *cache, *lengths, HEADS, KV_HEADS, SCALE, WINDOW
    )
    # Queries 0..W-1 see all their rows either way; query W (row 5) no longer sees row 0.
    torch.testing.assert_close(windowed[:, :WINDOW], full[:, :WINDOW], rtol=0, atol=0)
    assert not torch.allclose(windowed[:, WINDOW:], full[:, WINDOW:])
