"""scripts/profile_pte.py on tiny artifacts: the trace's rows add up and name the kernels the program runs."""

from __future__ import annotations

import json
import re

import pytest

from kvexport.models.presets import build_preset

from tests.helpers import load_script


def test_profile_rows_add_up_and_name_each_layers_attention(artifact, tmp_path, capsys):
    folder = artifact("tiny-llama", "executorch")
    report_path = tmp_path / "profile.json"
    args = [str(folder), "--prompt-tokens", "5", "--new-tokens", "6", "--json", str(report_path)]
    assert load_script("profile_pte").main(args) == 0
    report = json.loads(report_path.read_text())
    rows = {r["name"]: r for r in report["rows"]}

    total = rows["Method::execute"]
    assert total["calls_per_step"] == 1 and total["ms_per_step"] > 0
    # Time inside XNNPACK plus time in the kernels outside it is part of the call, not more.
    inside, outside = rows["DELEGATE_CALL"]["ms_per_step"], rows["OPERATOR_CALL"]["ms_per_step"]
    assert 0 < inside and 0 < outside and inside + outside <= total["ms_per_step"] * 1.001
    # One fused attention call per layer, outside the delegate; XNNPACK's own operators inside it.
    layers = build_preset("tiny-llama")[0].config.num_hidden_layers
    assert rows["llama::custom_sdpa.out"]["calls_per_step"] == layers
    assert not rows["llama::custom_sdpa.out"]["delegated"]
    assert any(r["delegated"] and r["name"].startswith("Fully Connected") for r in rows.values())
    assert not any(r["delegated"] and re.search(r" #\d+$", r["name"]) for r in rows.values())  # one row per kind
    # The slowest kernels: no container event, slowest first, each within its kind's row.
    slowest = report["slowest_events"]
    assert slowest and not {e["name"] for e in slowest} & {"Method::execute", "DELEGATE_CALL", "OPERATOR_CALL"}
    assert [e["ms_per_step"] for e in slowest] == sorted((e["ms_per_step"] for e in slowest), reverse=True)
    for event in slowest:
        kind = event["name"].rsplit(" #", 1)[0] if event["delegated"] else event["name"]
        assert event["ms_per_step"] <= rows[kind]["ms_per_step"] * 1.000001
    # Loading runs once, not once per call: it is not a per-step row.
    assert "Program::load_method" not in rows
    assert "| Method::execute |" in capsys.readouterr().out


def test_one_kv_head_rings_attend_inside_xnnpack(artifact, tmp_path):
    """tiny-gemma3 (one KV head, as Gemma 3 270M): custom_sdpa for its full layer only; its sliding
    layers' attention is XNNPACK's batched matmuls and softmax."""
    report_path = tmp_path / "profile.json"
    args = [str(artifact("tiny-gemma3")), "--prompt-tokens", "5", "--new-tokens", "6", "--json", str(report_path)]
    assert load_script("profile_pte").main(args) == 0
    rows = {r["name"]: r for r in json.loads(report_path.read_text())["rows"]}
    layer_types = build_preset("tiny-gemma3")[0].config.layer_types
    assert rows["llama::custom_sdpa.out"]["calls_per_step"] == layer_types.count("full_attention")
    sliding = layer_types.count("sliding_attention")
    products = rows["Batch Matrix Multiply (NC, F32) GEMM"]
    assert products["delegated"] and products["calls_per_step"] == 2 * sliding
    assert rows["Softmax (NC, F32)"]["calls_per_step"] == sliding


def test_profile_refuses_an_onnx_artifact_and_a_prompt_that_does_not_fit(artifact):
    from kvexport.errors import InvalidOptionError, PromptTooLongError

    profiler = load_script("profile_pte")
    with pytest.raises(InvalidOptionError, match="executorch"):
        profiler.main([str(artifact("tiny-llama", "onnx")), "--prompt-tokens", "4", "--new-tokens", "2"])
    with pytest.raises(PromptTooLongError):
        profiler.main([str(artifact("tiny-llama", "executorch")), "--prompt-tokens", "60", "--new-tokens", "10"])
