"""``--sdpa-query``: what ``auto`` times and how it decides, and what the export records."""

from __future__ import annotations

import json

import pytest

from kvexport.choices import SdpaQuery
from kvexport.exporter.executorch import sdpa_query
from kvexport.models.architecture import RING, layer_specs
from kvexport.models.presets import preset_config

from tests.conftest import TEST_CACHE_LEN
from tests.helpers import assert_one_line_error, run_cli


def shape(preset: str, max_cache_len: int = TEST_CACHE_LEN):
    config = preset_config(preset)
    return sdpa_query.timed_shape(config, layer_specs(config), max_cache_len)


def test_auto_times_the_first_layer_that_calls_the_kernel_with_query_groups():
    llama = preset_config("tiny-llama")
    assert shape("tiny-llama") == (llama.num_attention_heads, llama.num_key_value_heads, llama.head_dim, TEST_CACHE_LEN)
    assert shape("tiny-llama", 4096)[-1] == sdpa_query.TIMED_POSITIONS  # at most that many positions
    # Gemma 3's rings of one KV head attend inside XNNPACK: its full layer is timed.
    gemma3 = preset_config("tiny-gemma3")
    assert gemma3.layer_types[0] == "sliding_attention"
    assert shape("tiny-gemma3") == (gemma3.num_attention_heads, 1, gemma3.head_dim, TEST_CACHE_LEN)
    # A ring of several KV heads calls it too (tiny Gemma 4's first layer), over its window's slots.
    ring = layer_specs(preset_config("tiny-gemma4"))[0]
    assert ring.cache_kind(TEST_CACHE_LEN) == RING and ring.kv_heads > 1
    assert shape("tiny-gemma4")[1:] == (ring.kv_heads, ring.head_dim, ring.cache_slots(TEST_CACHE_LEN))


def test_auto_times_nothing_where_no_layer_has_query_groups(monkeypatch):
    config = preset_config("tiny-gemma3")
    config.num_attention_heads = 1  # one query head per KV head: nothing to stack
    monkeypatch.setattr(sdpa_query, "step_microseconds", lambda *a: pytest.fail("timed"))
    assert sdpa_query.choose(SdpaQuery.AUTO, config, layer_specs(config), TEST_CACHE_LEN) == (None, None)


@pytest.mark.parametrize("grouped_us, per_head_us, chosen", [(1000, 500, "per-head"), (1000, 950, "grouped"), (500, 1000, "grouped")])
def test_auto_keeps_per_head_only_where_it_is_clearly_faster(monkeypatch, grouped_us, per_head_us, chosen):
    times = {SdpaQuery.GROUPED: grouped_us, SdpaQuery.PER_HEAD: per_head_us}
    monkeypatch.setattr(sdpa_query, "step_microseconds", lambda *a: times)
    config = preset_config("tiny-llama")
    assert sdpa_query.choose(SdpaQuery.AUTO, config, layer_specs(config), TEST_CACHE_LEN) == (chosen, times)
    # An explicit form is what the user asked for, untimed.
    assert sdpa_query.choose(SdpaQuery.GROUPED, config, layer_specs(config), TEST_CACHE_LEN) == ("grouped", None)


def test_the_timing_runs_both_forms_at_the_shape():
    times = sdpa_query.step_microseconds(4, 2, 16, 64)
    assert set(times) == {SdpaQuery.GROUPED, SdpaQuery.PER_HEAD} and all(t > 0 for t in times.values())


def test_the_export_records_the_form_it_chose(artifact):
    """What ``auto`` chose goes into ``export_options`` (the command that reproduces the artifact
    then names it); a form asked for is recorded as asked."""
    def recorded(folder):
        return json.loads((folder / "kvexport.json").read_text())["export_options"].get("sdpa_query")

    assert recorded(artifact("tiny-llama")) in ("grouped", "per-head")
    assert recorded(artifact("tiny-llama", sdpa_query="per-head")) == "per-head"
    assert recorded(artifact("tiny-llama", "onnx")) is None


@pytest.mark.parametrize(
    "args, phrase",
    [
        (["--target", "onnx", "--sdpa-query", "grouped"], "--sdpa-query is for --target executorch; for --target onnx leave it out"),
        (["--kv-cache", "int8", "--sdpa-query", "per-head"], "--sdpa-query goes with --kv-cache float"),
        (["--sdpa-query", "rows"], "unknown --sdpa-query 'rows'; choose one of: auto, grouped, per-head"),
    ],
    ids=["onnx", "int8-kv", "unknown"],
)
def test_sdpa_query_mistakes_get_one_line_before_loading(tmp_path, capsys, monkeypatch, args, phrase):
    from kvexport.exporter import pipeline

    monkeypatch.setattr(pipeline.sources, "load_model", lambda *a, **k: pytest.fail("loaded the model"))
    code, _, err = run_cli(capsys, "export", "tiny-llama", *args, "-o", tmp_path / "x")
    assert_one_line_error(code, err, phrase)
    assert not (tmp_path / "x").exists()
