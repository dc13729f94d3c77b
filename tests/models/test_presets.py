"""Tiny random models of any family: what the shared defaults give each one."""

from __future__ import annotations

from kvexport.models.presets import build_preset, build_tiny, tiny_config


def test_a_default_the_family_does_not_have_is_left_out():
    """GPT-2 names no KV heads: a num_key_value_heads set on its config would tell kvexport's cache
    a shape its attention never computes. The token ids stay (kvexport reads them)."""
    config = tiny_config("gpt2", {})
    assert not hasattr(config, "num_key_value_heads")
    assert (config.n_embd, config.n_head, config.eos_token_id) == (64, 4, 97)
    assert tiny_config("llama", {}).num_key_value_heads == 2


def test_a_matrix_the_initialization_leaves_at_zero_gets_random_weights():
    """AFMoE initializes its router to zeros: every expert would tie, and torch and ONNX Runtime
    break ties differently. Vectors and biases keep their initialization (gpt-oss's zero biases)."""
    model, _ = build_tiny(tiny_config("afmoe", {}))
    assert model.model.layers[1].mlp.router.gate.weight.any()
    model, _ = build_preset("tiny-gpt-oss")
    assert not model.model.layers[0].mlp.experts.gate_up_proj_bias.any()
