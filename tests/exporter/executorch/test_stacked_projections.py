"""Quantized q/k/v and gate/up as one stacked matmul while tracing: the same outputs, the model given back."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from kvexport.exporter.executorch.quantize import Int4GridLinear, _int8_per_channel, quantize_linears
from kvexport.exporter.executorch.stacked_projections import StackedMember, stack_rows, stacked_projections
from kvexport.exporter.weight_grids import int4_blocks
from kvexport.models.presets import build_preset


def test_a_model_computes_the_same_with_its_projections_stacked():
    model, tokenizer = build_preset("tiny-qwen2")  # q/k/v with biases
    quantize_linears(model)
    ids = torch.tensor([tokenizer("The quick brown fox").input_ids])
    layers = dict(model.named_modules())
    with torch.no_grad():
        before = model(ids).logits
        with stacked_projections(model):
            attention, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
            assert all(isinstance(getattr(attention, n), StackedMember) for n in ("q_proj", "k_proj", "v_proj"))
            assert all(isinstance(getattr(mlp, n), StackedMember) for n in ("gate_proj", "up_proj"))
            assert isinstance(attention.o_proj, Int4GridLinear) and isinstance(mlp.down_proj, Int4GridLinear)
            stacked = model(ids).logits
        after = model(ids).logits
    torch.testing.assert_close(stacked, before, atol=1e-5, rtol=0)
    assert dict(model.named_modules()) == layers and torch.equal(after, before)  # the model's own layers back


def test_a_member_called_on_another_input_gets_that_inputs_product():
    rng = np.random.default_rng(2)
    holder = nn.Module()
    layers = holder.q_proj, holder.k_proj, holder.v_proj = [
        Int4GridLinear.from_blocks(*int4_blocks(rng.standard_normal((n, 32)).astype(np.float32)), None) for n in (8, 4, 4)
    ]
    x, other = torch.randn(1, 3, 32), torch.randn(1, 3, 32)
    with stacked_projections(holder), torch.no_grad():
        torch.testing.assert_close(holder.q_proj(x), layers[0](x))
        torch.testing.assert_close(holder.k_proj(other), layers[1](other))  # not the cached product of x
        torch.testing.assert_close(holder.v_proj(other), layers[2](other))


@pytest.mark.parametrize("kind", ["int4 grid", "int8 per row"])
def test_layers_stack_row_for_row_and_keep_their_weights_once(kind):
    rng = np.random.default_rng(3)
    weights = [rng.standard_normal((n, 64)).astype(np.float32) for n in (32, 16, 16)]
    if kind == "int4 grid":
        layers = [Int4GridLinear.from_blocks(*int4_blocks(w), None) for w in weights]
    else:
        layers = [nn.Linear(64, w.shape[0], bias=False) for w in weights]
        for layer, w in zip(layers, weights):
            layer.weight = nn.Parameter(_int8_per_channel(torch.from_numpy(w)), requires_grad=False)
    x = torch.from_numpy(rng.standard_normal((2, 64)).astype(np.float32))
    with torch.no_grad():
        separate = torch.cat([layer(x) for layer in layers], dim=-1)
        stacked = stack_rows(layers)
        assert type(stacked) is type(layers[0])
        torch.testing.assert_close(stacked(x), separate, atol=1e-5, rtol=0)
        torch.testing.assert_close(torch.cat([layer(x) for layer in layers], dim=-1), separate, atol=0, rtol=0)

    def storage(weight):  # torchao's int8 values
        return weight.qdata.untyped_storage().data_ptr()

    # Each layer now reads its rows of the stack: the model holds every weight once.
    assert all(storage(layer.weight) == storage(stacked.weight) for layer in layers)


def test_layers_of_different_kinds_are_left_alone():
    rng = np.random.default_rng(4)
    w = rng.standard_normal((32, 64)).astype(np.float32)
    int4 = Int4GridLinear.from_blocks(*int4_blocks(w), None)
    int8 = nn.Linear(64, 32, bias=False)
    int8.weight = nn.Parameter(_int8_per_channel(torch.from_numpy(w)), requires_grad=False)
    assert stack_rows([int4, nn.Linear(64, 32, bias=False)]) is None
    assert stack_rows([nn.Linear(64, 32, bias=False), int8]) is None
    assert stack_rows([nn.Linear(64, 32, bias=False), nn.Linear(64, 32, bias=False)]) is None  # float
    biased = Int4GridLinear.from_blocks(*int4_blocks(w), torch.zeros(32))
    assert stack_rows([int4, biased]) is None  # a bias on one only
