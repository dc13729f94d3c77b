"""``vector_state.clear_vector_state``: an exact zero added to the query after a subtraction wide
enough to reach every thread of XNNPACK's pool, before each ``custom_sdpa`` call, inside the
delegate call that computes the query; none before kvexport's own kernel."""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from kvexport.exporter.decoder import ExportableDecoder, export_decoder
from kvexport.exporter.executorch.custom_op_cache import custom_op_caches
from kvexport.exporter.executorch.quantized_kv_cache import QUANTIZED_CACHES, quantized_caches
from kvexport.exporter.executorch.vector_state import SPREAD_ELEMENTS, clear_vector_state
from kvexport.models.architecture import layer_specs
from kvexport.models.presets import build_preset

from tests.conftest import TEST_CACHE_LEN


def subtractions(graph: torch.fx.Graph) -> list[torch.Size]:
    return [n.meta["val"].shape for n in graph.nodes if n.target == torch.ops.aten.sub.Tensor]


@pytest.mark.parametrize("shape", [(1, 9, 1, 64), (1, 9, 5, 64), (1, 4, 3, 16), (1, 1, 1, 8)])
def test_the_query_comes_back_bit_for_bit(shape):
    torch.manual_seed(0)
    query = torch.randn(shape) * torch.logspace(-30, 30, shape[-1])  # tiny to huge, all finite
    got = clear_vector_state(query)
    assert torch.equal(got.view(torch.int32), query.view(torch.int32))


@pytest.mark.parametrize("heads, head_dim", [(9, 64), (4, 16), (1, 8)])
def test_the_subtraction_spans_the_spread_or_every_pair_of_rows(heads, head_dim):
    query = torch.randn(1, heads, 1, head_dim)
    [shape] = subtractions(make_fx(clear_vector_state)(query).graph)
    values = heads * head_dim
    assert shape == (values, min(values, -(-SPREAD_ELEMENTS // values)))
    if values * values >= SPREAD_ELEMENTS:
        assert shape.numel() >= SPREAD_ELEMENTS


KINDS = {"grouped": custom_op_caches(grouped=True), "per-head": custom_op_caches(grouped=False), "int8": QUANTIZED_CACHES}


@pytest.mark.parametrize("kinds", list(KINDS))
@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-mistral"])
def test_one_subtraction_before_each_layers_kernel(preset, kinds):
    """Each layer's attention (a static buffer's causal call, a ring's masked one; float or int8
    rows) clears the pool threads' vector state once, outside the branch on the call's length."""
    model, _ = build_preset(preset)
    config = model.config
    values = config.num_attention_heads * (getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
    forward = export_decoder(ExportableDecoder(model, TEST_CACHE_LEN, KINDS[kinds]))
    wide = [s for s in subtractions(forward.graph) if s[0] == values and len(s) == 2]
    assert len(wide) == config.num_hidden_layers


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-mistral"])
def test_no_subtraction_before_kvexports_kernel(preset):
    """With ``--decode-attention kvexport`` a full layer clears nothing (the kernel is compiled for the
    CPU's vector extensions); a ring's ``custom_sdpa`` still does."""
    model, _ = build_preset(preset)
    config = model.config
    values = config.num_attention_heads * (getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
    rings = sum(spec.window is not None for spec in layer_specs(config))
    for kinds in (custom_op_caches(grouped=False, decode_kernel=True), quantized_caches(decode_kernel=True)):
        forward = export_decoder(ExportableDecoder(model, TEST_CACHE_LEN, kinds))
        wide = [s for s in subtractions(forward.graph) if s[0] == values and len(s) == 2]
        assert len(wide) == rings


def test_the_subtraction_is_inside_each_layers_delegate_call(artifact):
    """A float ``.pte`` makes one call into XNNPACK's delegate per layer (and a few around them):
    every op of the clearing is one XNNPACK takes with the call's dynamic number of tokens. (A
    select of the first token's rows ran outside the delegate and split each layer's call in three.)"""
    from kvexport.artifact.manifest import read_manifest

    manifest = read_manifest(artifact("tiny-llama", "executorch", sdpa_query="per-head")).to_json()
    assert manifest["delegated_calls"] <= len(manifest["layers"]) + 4, manifest["delegated_calls"]
