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
        ("olmo_hybrid", {}, "convolve queries, keys and values apart"),
        # Not named anywhere in kvexport: refused by the generic rules, from the config and transformers.
        ("pegasus", {}, "encoder-decoder"),
        ("falcon_mamba", {}, "AttentionInterface"),  # no attention to route at all
        ("stablelm", {}, "AttentionInterface"),  # its layers do not pass the attention's arguments on
        ("minimax", {}, "'linear_attention' layers"),
        ("llama4", {}, "multimodal"),
        ("roberta", {}, "encoder"),
        ("gemma3", {}, r"multimodal model \(vision_config\)"),
        ("mllama", {}, "multimodal"),
        ("distilbert", {}, "no causal-LM class"),
        ("deepseek_v3", {}, "multi-head latent attention"),
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


def test_every_causal_lm_of_transformers_is_accepted_or_refused_in_one_line():
    """The export plan's first step (no weights) for every model type AutoModelForCausalLM takes,
    each config at transformers' defaults: it is accepted, or refused with one line that says why;
    never a traceback (docs/design.md#supported-families has the counts)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    accepted, refused, unbuildable = [], [], []
    for model_type in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        try:
            config = AutoConfig.for_model(model_type)
        except Exception:  # a config with no usable defaults, which no export can start from
            unbuildable.append(model_type)
            continue
        try:
            assert layer_specs(config), model_type
            accepted.append(model_type)
        except UnsupportedModelError as e:
            assert "\n" not in str(e) and str(e).startswith(f"architecture '{model_type}' is not supported: "), str(e)
            refused.append(model_type)
    assert unbuildable == ["gemma4_assistant"]  # a drafter: its config needs its target model's
    assert {"llama", "gemma3_text", "gemma3n_text", "gemma4_text", "cohere2", "gpt_oss", "lfm2", "lfm2_moe", "lfm3",
            "qwen3_5_text", "qwen3_5_moe_text", "qwen3_next", "llama4_text", "nemotron_h", "falcon_h1"} <= set(accepted)
    # Among them, layers kvexport cannot cache or trace as the config describes them: values of their own
    # head size, two attention calls per layer (differential attention; layers run in cycles), experts
    # sized by the call's routing.
    assert {"deepseek_v3", "mamba", "olmo_hybrid", "mimo_v2_flash", "diffllama", "hrm_text", "dbrx", "jetmoe"} <= set(refused)
    assert len(accepted) + len(refused) + len(unbuildable) == len(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def test_gemma4_layers_have_their_own_shapes_and_share_caches_as_transformers_builds_them():
    """Each layer's KV shape and the layer whose cache it reads, from the config alone, against the
    attention modules transformers builds from it (Gemma 4: full layers with their own head size and
    KV heads, the last layer of each type reading the last earlier one of its type)."""
    from kvexport.models.presets import build_preset

    model, _ = build_preset("tiny-gemma4")
    specs = layer_specs(model.config)
    assert [s.reads for s in specs] == [None, None, 0, 1]
    for spec, layer in zip(specs, model.model.layers):
        attention = layer.self_attn
        assert spec.head_dim == attention.head_dim
        assert spec.kv_heads == model.config.num_attention_heads // attention.num_key_value_groups
        assert (spec.reads is not None) == attention.is_kv_shared_layer
        assert spec.window == attention.sliding_window
    assert {(s.head_dim, s.kv_heads) for s in specs} == {(16, 2), (32, 1)}


def test_gemma3n_layers_share_caches_from_every_token_as_transformers_runs_them():
    """Gemma 3n: the last layer of each type reads the last earlier one of its type, as Gemma 4's
    do, but transformers runs them on every token of a call (Gemma 4's model slices their inputs to
    the last one), which a sharing layer of a ring must be served from."""
    from kvexport.models.presets import build_preset

    model, _ = build_preset("tiny-gemma3n")
    specs = layer_specs(model.config)
    assert [s.reads for s in specs] == [None, None, 0, 1]
    assert [s.reads_every_token for s in specs] == [False, False, True, True]
    assert [s.cache_kind(64) for s in specs] == ["ring", "static", "shared", "shared"]
    for spec, layer in zip(specs, model.model.layers):
        assert (spec.reads is not None) == layer.self_attn.is_kv_shared_layer
        assert spec.window == layer.self_attn.sliding_window
    assert not hasattr(model.model, "_maybe_slice_kv_shared_inputs")
    assert not any(s.reads_every_token for s in layer_specs(build_preset("tiny-gemma4")[0].config))


def test_chunked_layers_are_rings_of_the_chunk_as_transformers_builds_them():
    """Llama 4's chunked-attention layers (``chunked_attention``): a ring of ``attention_chunk_size``
    slots masked to the chunk, beside its full NoPE layers; a cache no longer than a chunk needs
    no ring (every position is in the first chunk)."""
    from kvexport.models.presets import CHUNK, build_preset

    model, _ = build_preset("tiny-llama4")
    specs = layer_specs(model.config)
    assert [(s.layer_type, s.window, s.chunk) for s in specs] == [("chunked_attention", CHUNK, CHUNK), ("full_attention", None, None)]
    assert [s.cache_kind(64) for s in specs] == ["ring", "static"] and specs[0].cache_slots(64) == CHUNK
    assert specs[0].cache_kind(CHUNK) == "static"
    assert [bool(layer.self_attn.use_rope) for layer in model.model.layers] == [True, False]


def test_short_convolutions_come_from_layer_types_as_transformers_builds_them():
    """LFM2's convolution layers (``conv`` in ``layer_types``): a state of ``conv_L_cache - 1`` inputs
    of every channel, against the modules transformers builds."""
    from kvexport.models.presets import build_preset

    model, _ = build_preset("tiny-lfm2")
    specs = layer_specs(model.config)
    assert [s.cache_kind(64) for s in specs] == ["conv", "static"]
    conv = model.model.layers[0].conv
    assert specs[0].conv_state == (conv.conv.in_channels, conv.conv_kernel_size - 1)


def test_linear_attention_states_come_from_the_config_as_transformers_builds_them():
    """Qwen 3.5's gated-delta layers (``linear_attention``): a convolution over the queries, keys and
    values of every channel, and a ``key size x value size`` state per value head, against the
    modules transformers builds."""
    from kvexport.models.presets import build_preset

    model, _ = build_preset("tiny-qwen3.5")
    specs = layer_specs(model.config)
    assert [s.cache_kind(64) for s in specs] == ["recurrent", "static"]
    assert not specs[0].has_kv
    delta = model.model.layers[0].linear_attn
    assert specs[0].conv_state == (delta.conv1d.in_channels, delta.conv_kernel_size - 1)
    assert specs[0].recurrent_state == (delta.num_v_heads, delta.head_k_dim, delta.head_v_dim)


@pytest.mark.parametrize("preset", ["tiny-granite4", "tiny-bamba"])
def test_mamba2_states_come_from_the_config_as_transformers_builds_them(preset):
    """Granite 4 hybrid's and Bamba's Mamba-2 layers (``linear_attention`` too, with Mamba-2's
    sizes): a convolution over the inner channels and B, C of every group, and a ``head size x state
    size`` state per head, against the modules transformers builds. (Bamba's class does not declare
    that its attention routes through the interface; its attention module's code does.)"""
    from kvexport.models.architecture import MAMBA2
    from kvexport.models.presets import build_preset

    model, _ = build_preset(preset)
    specs = layer_specs(model.config)
    assert [(s.cache_kind(64), s.rule) for s in specs] == [("recurrent", MAMBA2), ("static", None)]
    mamba = model.model.layers[0].mamba
    assert specs[0].conv_state == (mamba.conv_dim, mamba.conv_kernel_size - 1)
    assert specs[0].recurrent_state == (mamba.num_heads, mamba.head_dim, mamba.ssm_state_size)


@pytest.mark.parametrize("target", ["executorch", "onnx"])
def test_a_falcon_h1_layer_holds_a_kv_cache_and_a_mamba2_state(tmp_path, target):
    """Falcon-H1 runs attention and a Mamba-2 mixer side by side in every layer (``hybrid``): each
    layer's plan has both, the KV shape and the mixer's states as transformers builds them (its inner
    channels from ``mamba_d_ssm``); kvexport.json lists the mixer beside the layer's KV cache, and
    the cache size and the states' size count each once."""
    from kvexport.artifact.manifest import buffer_layers, state_layers
    from kvexport.models.architecture import MAMBA2
    from kvexport.models.presets import build_preset

    model, _ = build_preset("tiny-falcon-h1")
    specs = layer_specs(model.config)
    layer = model.model.layers[0]
    mamba, attention = layer.mamba, layer.self_attn
    assert mamba.intermediate_size == model.config.mamba_d_ssm != model.config.mamba_expand * model.config.hidden_size
    for spec in specs:
        assert (spec.cache_kind(64), spec.state_kind, spec.rule, spec.has_kv) == ("static", "recurrent", MAMBA2, True)
        assert (spec.kv_heads, spec.head_dim) == (attention.k_proj.out_features // attention.head_dim, attention.head_dim)
        assert spec.conv_state == (mamba.conv_dim, mamba.conv_kernel_size - 1)
        assert spec.recurrent_state == (mamba.num_heads, mamba.head_dim, mamba.ssm_state_size)
    plan = plan_export(ExportOptions("tiny-falcon-h1", target, tmp_path / "out", 64))
    layers = plan.layers()
    assert buffer_layers(layers) == layers
    assert [(s.index, s.cache, s.channels, s.slots, list(s.state)) for s in state_layers(layers)] == [
        (i, "recurrent", mamba.conv_dim, 3, [mamba.num_heads, mamba.head_dim, mamba.ssm_state_size]) for i in range(2)]  # fmt: skip
    kv_heads, head_dim = specs[0].kv_heads, specs[0].head_dim
    assert plan.kv_cache_bytes == 2 * 2 * kv_heads * 64 * head_dim * 4
    assert plan.state_bytes == 2 * (mamba.conv_dim * 3 * 4 + mamba.num_heads * mamba.head_dim * mamba.ssm_state_size * 4)
    assert "2 with a Mamba-2 mixer beside attention" in plan.summary()


def test_a_model_with_no_attention_layer_is_refused_before_loading():
    """A stack of Mamba-2 layers alone (Granite 4 hybrid's config defaults): transformers' own cached
    generation fails on it (its cache has no attention layer to count positions), so no export could
    be checked against eager generation."""
    from kvexport.models.presets import preset_config

    config = preset_config("tiny-granite4")
    config.layer_types = ["linear_attention"] * 2
    with pytest.raises(UnsupportedModelError, match="none of its layers attends"):
        layer_specs(config)


def test_a_mamba2_step_limit_is_refused_before_loading():
    """transformers clamps the step of its chunked scan (prefill) to ``time_step_limit`` but not that
    of its 1-token update (decode), in Granite 4's mixer and in Falcon-H1's: one program cannot be
    both, so such a config is refused."""
    from kvexport.models.presets import preset_config

    for preset in ("tiny-granite4", "tiny-falcon-h1"):
        config = preset_config(preset)
        config.time_step_limit = (0.0, 0.1)
        with pytest.raises(UnsupportedModelError, match=r"time_step_limit \(0.0, 0.1\) clamps transformers' prefill steps"):
            layer_specs(config)


def test_nemotron_h_layers_are_planned_by_block_kind():
    """Nemotron-H's blocks (``layers_block_type``): a Mamba-2 mixer holds its convolution's and its
    recurrent state, sized as transformers builds the mixer (inner size heads x head size), the
    attention block a full KV cache of its own shape, and the MoE and MLP blocks nothing."""
    from kvexport.models.architecture import MAMBA2
    from kvexport.models.presets import build_preset

    model, _ = build_preset("tiny-nemotron-h")
    specs = layer_specs(model.config)
    assert [block.block_type for block in model.model.layers] == [s.layer_type for s in specs]
    assert [(s.cache_kind(64), s.rule, s.has_kv) for s in specs] == [
        ("recurrent", MAMBA2, False), ("static", None, True), ("none", None, False), ("none", None, False)
    ]
    mixer, attention = model.model.layers[0].mixer, model.model.layers[1].mixer
    assert specs[0].conv_state == (mixer.conv_dim, mixer.conv_kernel_size - 1)
    assert specs[0].recurrent_state == (mixer.num_heads, mixer.head_dim, mixer.ssm_state_size)
    assert (specs[1].kv_heads, specs[1].head_dim) == (attention.k_proj.out_features // attention.head_dim, attention.head_dim)
    # Its mixers clamp the step to time_step_min (models/adapters.py follows where transformers does).
    assert mixer.time_step_limit == (model.config.time_step_min, float("inf"))


def test_a_layer_that_shares_a_cache_holds_none(tmp_path):
    """kvexport.json's cache size counts the layers that hold a cache; the layers that read another's
    add nothing (against every layer holding a full-length cache of its own)."""
    plan = plan_export(ExportOptions("tiny-gemma4", "executorch", tmp_path / "out", 64))
    layers = [layer.to_json() for layer in plan.layers()]
    assert [layer["cache"] for layer in layers] == ["ring", "static", "shared", "shared"]
    assert [layer.get("reads") for layer in layers] == [None, None, 0, 1]
    assert [layer["slots"] for layer in layers] == [6, 64, 0, 0]
    row = 4  # float32 bytes a position of one KV head per unit of head size
    assert plan.kv_cache_bytes == 2 * row * (2 * 6 * 16 + 1 * 64 * 32)
    assert plan.kv_cache_bytes_if_all_full == 2 * row * 64 * 2 * (2 * 16 + 1 * 32)


@pytest.mark.parametrize("target", ["executorch", "onnx"])
def test_a_chunked_layer_holds_one_chunk(tmp_path, target):
    """kvexport.json's layers and cache size for Llama 4's chunked attention: a ring of the chunk's
    rows (``chunk`` beside ``window``) on both targets, the full NoPE layer the whole cache."""
    from kvexport.models.presets import CHUNK

    plan = plan_export(ExportOptions("tiny-llama4", target, tmp_path / "out", 64))
    layers = [layer.to_json() for layer in plan.layers()]
    assert [(layer["cache"], layer["window"], layer.get("chunk"), layer["slots"]) for layer in layers] == [
        ("ring", CHUNK, CHUNK, CHUNK), ("static", None, None, 64)]  # fmt: skip
    assert plan.kv_cache_bytes == 2 * 4 * 2 * 16 * (CHUNK + 64)
    assert "1 chunked-attention rings" in plan.summary()


def test_gemma3_270m_cache_at_8192_is_a_fraction_of_full_length_layers(tmp_path):
    """The figure kvexport.json reports (the same plan writes it), without exporting: windows of W
    rows on both targets, against 18 layers of 8192; the same bytes for the .pte and the ONNX folder."""
    plans = [plan_export(ExportOptions("gemma3-270m", target, tmp_path / target, 8192)) for target in ("executorch", "onnx")]
    for plan in plans:
        layers = [layer.to_json() for layer in plan.layers()]
        assert sum(layer["cache"] == "ring" for layer in layers) == 15
        assert all(layer["slots"] == 512 for layer in layers if layer["cache"] == "ring")
        assert plan.kv_cache_bytes <= 0.22 * plan.kv_cache_bytes_if_all_full
    assert plans[0].kv_cache_bytes == plans[1].kv_cache_bytes


@pytest.mark.parametrize("target", ["executorch", "onnx"])
def test_nemotron_h_takes_a_prompt_in_one_call(target, tmp_path):
    """Eager Nemotron-H clamps the steps of its one prefill call and not those of a one-token call:
    a prompt split into calls could end in one token, so a chunk shorter than the cache is refused and
    the default takes any prompt the cache holds in one call."""
    from kvexport.errors import InvalidOptionError

    assert plan_export(ExportOptions("tiny-nemotron-h", target, tmp_path / "out", 64)).prefill_chunk == 64
    with pytest.raises(InvalidOptionError, match="--prefill-chunk 16 would split a prompt into calls"):
        plan_export(ExportOptions("tiny-nemotron-h", target, tmp_path / "out", 64, prefill_chunk=16))
