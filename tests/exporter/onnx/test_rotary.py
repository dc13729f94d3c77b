"""kvexport's rotary op against ONNX Runtime's ``RotaryEmbedding`` kernel it is exported as, and the
swap of transformers' ``apply_rotary_pos_emb`` while the ONNX graph is traced."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

from kvexport.exporter.onnx.rotary import rotary_as_kernel
from kvexport.models.presets import build_preset

from tests.conftest import PROMPT


def _session() -> ort.InferenceSession:
    """One RotaryEmbedding node as the translation writes it: the call's tables, positions from 0."""
    f = TensorProto.FLOAT
    zero = helper.make_tensor("position_ids", TensorProto.INT64, [1], [0])
    graph = helper.make_graph(
        [helper.make_node("RotaryEmbedding", ["x", "position_ids", "cos", "sin"], ["y"], domain="com.microsoft")],
        "rotary",
        [helper.make_tensor_value_info(name, f, None) for name in ("x", "cos", "sin")],
        [helper.make_tensor_value_info("y", f, None)],
        [zero],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 10  # what this onnxruntime reads
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("t", [1, 7])
def test_rotary_op_matches_transformers_and_the_onnx_runtime_kernel(t):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    generator = torch.Generator().manual_seed(t)
    heads, head_dim = 3, 16
    x = torch.randn(1, heads, t, head_dim, generator=generator)
    positions = torch.arange(40, 40 + t, dtype=torch.float32)  # a call far into the sequence
    freqs = positions[:, None] * (10000.0 ** (-torch.arange(0, head_dim, 2) / head_dim))[None]
    cos, sin = torch.cat((freqs, freqs), -1).cos()[None], torch.cat((freqs, freqs), -1).sin()[None]  # [1, T, D]

    expected, _ = apply_rotary_pos_emb(x, x, cos, sin)
    got = torch.ops.kvexport.rotary_embedding(x, cos[0, :, : head_dim // 2], sin[0, :, : head_dim // 2])
    torch.testing.assert_close(got, expected, atol=0, rtol=0)  # the same arithmetic as transformers'

    feeds = {"x": x.numpy(), "cos": cos[0, :, : head_dim // 2].numpy(), "sin": sin[0, :, : head_dim // 2].numpy()}
    kernel = _session().run(None, feeds)[0]
    np.testing.assert_allclose(kernel, expected.numpy(), atol=1e-6, rtol=0)


def test_the_swap_is_scoped_and_changes_no_logits():
    import transformers.models.llama.modeling_llama as modeling

    model, tokenizer = build_preset("tiny-llama")
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    original = modeling.apply_rotary_pos_emb
    with torch.no_grad():
        expected = model(ids).logits
        with rotary_as_kernel(model) as swapped:
            assert swapped == 1 and modeling.apply_rotary_pos_emb is not original
            got = model(ids).logits
    assert modeling.apply_rotary_pos_emb is original
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_a_family_with_its_own_rotation_keeps_it():
    # GPT-OSS rotates with its own function (another layout): checked on inputs, it is left alone.
    model, _ = build_preset("tiny-gpt-oss")
    with rotary_as_kernel(model) as swapped:
        assert swapped == 0
