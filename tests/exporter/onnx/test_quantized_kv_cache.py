"""``--kv-cache int8`` on the ONNX target: the fixed scales, what the export records and refuses,
and the artifact against the module it was exported from, in kvexport's runner and in
onnxruntime-genai.

The kernel's int8 arithmetic against kvexport's op: ``tests/exporter/onnx/test_attention.py``; the
int8 artifacts against eager transformers by agreement in ``matrices/tiny.toml`` and on the real
models (docs/quantization.md#int8-kv-cache).
"""

from __future__ import annotations

import pytest
import torch

from kvexport.errors import ArtifactError, UnsupportedModelError
from kvexport.exporter.kv_calibration import calibration_ids
from kvexport.exporter.onnx import target as onnx_target
from kvexport.exporter.onnx.decoder import ExternalCacheDecoder
from kvexport.exporter.onnx.quantized_kv_cache import (
    INT8_MAX,
    KEY_MARGIN,
    VALUE_MARGIN,
    _rotary_positions_moved,
    calibrate,
    use_int8_buffers,
)
from kvexport.exporter.pipeline import ExportOptions, plan_export
from kvexport.models.architecture import layer_specs
from kvexport.models.presets import build_preset, preset_config
from kvexport.runtime.programs import load_program
from tests.conftest import NEW_TOKENS, PROMPT, TEST_CACHE_LEN
from tests.helpers import assert_generation_matches, edit_manifest, genai_greedy, greedy_with


def _keys_and_logits(decoder: ExternalCacheDecoder, ids: torch.Tensor):
    """One eager call of ``decoder`` on ``ids``: each layer's keys as its attention saw them, and the logits."""
    keys = []
    for layer in decoder.caches:
        layer.observe = lambda k, v: keys.append(k)
    past = []
    for layer, spec in zip(decoder.caches, decoder.specs):
        past += [torch.zeros(1, spec.kv_heads, layer.window or ids.shape[1], spec.head_dim) for _ in range(2)]
    try:
        with torch.no_grad():
            logits, *_ = decoder(ids, torch.ones_like(ids), *past)
    finally:
        for layer in decoder.caches:
            layer.observe = None
    return keys, logits


def test_moved_rotary_positions_turn_the_keys_and_change_nothing_else():
    """What the calibration's later runs rest on: with every rotary angle computed 37 positions on,
    the logits are the same (attention sees relative positions only), each key is turned (each
    rotary pair of channels keeps its norm), and afterwards the model is as it was."""
    model, tokenizer = build_preset("tiny-qwen3")
    decoder = ExternalCacheDecoder(model, TEST_CACHE_LEN)
    ids = torch.tensor([tokenizer(PROMPT).input_ids])
    keys, logits = _keys_and_logits(decoder, ids)
    with _rotary_positions_moved(decoder.model, 37) as moved:
        moved_keys, moved_logits = _keys_and_logits(decoder, ids)
    assert moved >= 1
    torch.testing.assert_close(moved_logits, logits, rtol=0, atol=1e-4)
    half = keys[0].shape[-1] // 2
    for k, m in zip(keys, moved_keys):
        assert not torch.allclose(k, m, atol=1e-3)
        torch.testing.assert_close(torch.hypot(m[..., :half], m[..., half:]), torch.hypot(k[..., :half], k[..., half:]),
                                   rtol=0, atol=1e-4)  # fmt: skip
    again, _ = _keys_and_logits(decoder, ids)
    assert all(torch.equal(k, a) for k, a in zip(keys, again))


def test_a_longer_cache_widens_the_key_scales_and_not_the_value_scales():
    """The same text calibrated for a cache of its own length and for one 8 times longer: the
    longer one's keys are turned further, so some key scale grows and none shrinks; values have no
    rotation."""
    model, tokenizer = build_preset("tiny-qwen3")
    ids = calibration_ids(tokenizer)[:, :48]
    short = calibrate(ExternalCacheDecoder(model, 48), ids)
    long = calibrate(ExternalCacheDecoder(model, 8 * 48), ids)
    for (k_short, v_short), (k_long, v_long) in zip(short, long):
        assert bool((k_long >= k_short * (1 - 1e-5)).all()) and bool((k_long > k_short * 1.01).any())
        torch.testing.assert_close(v_long, v_short, rtol=1e-5, atol=0)


def test_calibrated_scales_fit_the_calibration_text_with_a_margin():
    """tiny-qwen3 (full layers, several KV heads): one scale per layer, KV head and channel; the
    calibration's own keys and values land within int8 at those scales, and each value channel's
    peak is its scale's ``1 / VALUE_MARGIN`` (keys: the moved runs reach further than this one)."""
    model, tokenizer = build_preset("tiny-qwen3")
    decoder = ExternalCacheDecoder(model, TEST_CACHE_LEN)
    ids = calibration_ids(tokenizer)
    scales = calibrate(decoder, ids)
    spec = decoder.specs[0]
    assert len(scales) == len(decoder.specs)
    assert {tuple(s.shape) for pair in scales for s in pair} == {(1, spec.kv_heads, 1, spec.head_dim)}
    assert all(bool((s > 0).all()) and s.dtype == torch.float32 for pair in scales for s in pair)
    seen = []
    for layer in decoder.caches:
        layer.observe = lambda k, v: seen.append((k, v))
    past = [torch.zeros(1, spec.kv_heads, TEST_CACHE_LEN, spec.head_dim) for _ in range(2 * len(decoder.specs))]
    with torch.no_grad():
        decoder(ids[:, :TEST_CACHE_LEN], torch.ones_like(ids[:, :TEST_CACHE_LEN]), *past)
    for (k, v), (k_scale, v_scale) in zip(seen, scales):
        assert float((k.abs() / (k_scale * INT8_MAX)).max()) <= 1 / KEY_MARGIN * (1 + 1e-6)
        assert float((v.abs() / (v_scale * INT8_MAX)).max()) == pytest.approx(1 / VALUE_MARGIN, rel=1e-6)


def test_an_int8_buffer_takes_one_byte_a_channel(tmp_path):
    """tiny-gemma3 on ONNX: a window of 6 rows, a full layer of 64, one KV head of 16; the
    scales are fixed (initializers), not per row."""
    plans = {kv: plan_export(ExportOptions("tiny-gemma3", target="onnx", max_cache_len=64, kv_cache=kv, out=tmp_path / kv))
             for kv in ("float", "int8")}  # fmt: skip
    rows = sum(2 * layer.kv_heads * layer.slots for layer in plans["int8"].layers())
    assert rows == 2 * (6 + 64)
    assert plans["int8"].kv_cache_bytes == rows * 16
    assert plans["float"].kv_cache_bytes == rows * 16 * 4


def test_a_window_head_size_the_kernel_does_not_take_is_refused_before_loading():
    config = preset_config("tiny-gemma3")
    config.head_dim = 8
    specs = layer_specs(config)
    with pytest.raises(UnsupportedModelError, match="head size 8: ONNX Runtime's kernel takes an int8 window"):
        onnx_target.check_kv_cache("int8", config, specs, 64)
    onnx_target.check_kv_cache("int8", config, specs, 4)  # every window covers the cache: no window buffers
    config.head_dim = 16
    onnx_target.check_kv_cache("int8", config, layer_specs(config), 64)


def _int8_module(name: str):
    """The preset wrapped as the ONNX target wraps it, with the scales the export calibrates."""
    model, tokenizer = build_preset(name)
    decoder = ExternalCacheDecoder(model, TEST_CACHE_LEN)
    use_int8_buffers(decoder, calibrate(decoder, calibration_ids(tokenizer)))
    return decoder, tokenizer


def _external_cache_forward(decoder: ExternalCacheDecoder):
    """``forward(tokens, start)`` over the decoder, its int8 buffers held here as a runner holds them."""
    past = []
    for layer, spec in zip(decoder.caches, decoder.specs):
        rows = layer.window or decoder.max_cache_len
        past += [torch.zeros(1, spec.kv_heads, rows, spec.head_dim, dtype=torch.int8) for _ in range(2)]

    def forward(tokens, start):
        nonlocal past
        mask = torch.ones(1, start + len(tokens), dtype=torch.long)
        with torch.no_grad():
            logits, *past = decoder(torch.tensor([tokens]), mask, *past)
        return logits[0, 0].float().numpy()

    return forward


def test_the_int8_onnx_artifact_computes_what_its_module_computes(artifact):
    """tiny-gemma3: windows and a full layer, past the window, in kvexport's runner and in
    onnxruntime-genai, against the same module in eager PyTorch (kvexport's op, int8 buffers)."""
    decoder, tokenizer = _int8_module("tiny-gemma3")
    ids = tokenizer(PROMPT).input_ids
    folder = artifact("tiny-gemma3", "onnx", kv_cache="int8")
    program = load_program(folder)
    assert program.manifest.kv_cache["dtype"] == "int8"
    assert {str(i.type) for i in program._session.get_inputs() if i.name.startswith("past_")} == {"tensor(int8)"}
    expected = greedy_with(_external_cache_forward(decoder), ids, NEW_TOKENS)
    ours = greedy_with(program.forward, ids, NEW_TOKENS)
    assert_generation_matches(ours, expected, 1e-3, "tiny-gemma3 int8 KV (ONNX)")
    assert genai_greedy(folder, ids, NEW_TOKENS) == ours[0]


def test_a_manifest_that_hides_the_int8_cache_is_refused(artifact, tmp_path):
    """Without ``kv_cache`` the runner would size float buffers for int8 inputs."""
    import shutil

    folder = tmp_path / "copy"
    shutil.copytree(artifact("tiny-gemma3", "onnx", kv_cache="int8"), folder)
    edit_manifest(lambda m: m.pop("kv_cache"))(folder)
    with pytest.raises(ArtifactError, match=r"KV cache's dtype is float32.*tensor\(int8\)"):
        load_program(folder)
