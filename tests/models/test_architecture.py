"""Layer kinds from configs, refusals, and the KV-cache size the artifact reports."""

from __future__ import annotations

import pytest
from transformers import AutoConfig

from kvexport.errors import UnsupportedModelError
from kvexport.exporter.pipeline import ExportOptions, plan_export
from kvexport.models.architecture import layer_specs
from kvexport.models.presets import preset_config


def test_hybrid_layers_come_from_layer_types():
    specs = layer_specs(preset_config("tiny-gemma3"))
    assert [s.window for s in specs] == [6, None]
    assert [s.is_ring(64) for s in specs] == [True, False]


def test_sliding_family_without_layer_types_slides_everywhere():
    assert all(s.window == 6 for s in layer_specs(preset_config("tiny-mistral")))


def test_a_window_as_long_as_the_cache_needs_no_ring():
    spec = layer_specs(preset_config("tiny-mistral"))[0]
    assert not spec.is_ring(6) and spec.cache_slots(6) == 6
    assert spec.is_ring(7) and spec.cache_slots(7) == 6


@pytest.mark.parametrize(
    "model_type, kwargs, phrase",
    [
        ("mamba", {}, "state-space"),
        ("t5", {}, "encoder-decoder"),
        ("qwen3_next", {}, "linear-attention"),
        # Not named anywhere in kvexport: refused by the generic rules, from the config and transformers.
        ("pegasus", {}, "encoder-decoder"),
        ("falcon_mamba", {}, "AttentionInterface"),  # no attention to route at all
        ("stablelm", {}, "AttentionInterface"),  # its layers do not pass the attention's arguments on
        ("minimax", {}, "'linear_attention' layers"),
        ("llama4_text", {}, "'chunked_attention' layers"),
        ("lfm3", {}, "'conv' layers"),
        ("roberta", {}, "encoder"),
        ("gemma3", {}, r"multimodal model \(vision_config\)"),
        ("mllama", {}, "multimodal"),
        ("distilbert", {}, "no causal-LM class"),
    ],
)
def test_unsupported_families_are_refused_with_the_reason(model_type, kwargs, phrase):
    with pytest.raises(UnsupportedModelError, match=phrase):
        layer_specs(AutoConfig.for_model(model_type, **kwargs))


@pytest.mark.parametrize(
    "model_type, kinds",
    [
        ("olmo2", {None}),
        ("granite", {None}),
        ("gpt_neox", {None}),
        ("mixtral", {None}),
        ("cohere2", {None, 4096}),
        ("olmo3", {None, 4096}),
        ("ministral", {4096}),
    ],
)
def test_families_nobody_listed_are_accepted_from_their_config(model_type, kinds):
    """Decoder-only families with full or sliding attention need no entry anywhere in kvexport."""
    assert {s.window for s in layer_specs(AutoConfig.for_model(model_type))} == kinds


def test_gemma3_270m_cache_at_8192_is_a_fraction_of_full_length_layers(tmp_path):
    """The figure kvexport.json reports (the same plan writes it), without exporting: windows of W
    rows on both targets, against 18 layers of 8192; the same bytes for the .pte and the ONNX folder."""
    plans = [plan_export(ExportOptions("gemma3-270m", target, tmp_path / target, 8192)) for target in ("executorch", "onnx")]
    for plan in plans:
        layers = plan.layers()
        assert sum(layer["cache"] == "ring" for layer in layers) == 15
        assert all(layer["slots"] == 512 for layer in layers if layer["cache"] == "ring")
        assert plan.kv_cache_bytes <= 0.22 * plan.kv_cache_bytes_if_all_full
    assert plans[0].kv_cache_bytes == plans[1].kv_cache_bytes
