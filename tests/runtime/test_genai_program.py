"""ONNX artifacts in onnxruntime-genai, the stock runtime: ``og.Model`` on the folder as it is,
against eager transformers for every preset; ``--runner genai`` in run, check and the device runner."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvexport.models.presets import build_preset
from kvexport.runtime.programs import load_program

from tests.conftest import GENAI_REFUSES, NEW_TOKENS, PROMPT, TEST_CACHE_LEN
from tests.helpers import (
    FP32_LOGIT_ATOL, assert_generation_matches, assert_one_line_error, eager_reference, genai_greedy, greedy_with,
    run_cli,
)
from tests.runtime.test_onnx_program import _WITHOUT_TORCH


# Presets whose ONNX folder genai cannot run (test_a_folder_genai_cannot_run_is_refused_in_one_line).
GENAI_CANNOT_RUN = {"tiny-gemma4", "tiny-gemma3n", "tiny-llama4"} | GENAI_REFUSES


def test_genai_matches_eager_past_the_window(tiny, artifact):
    """Every preset (windows of 6, a 44-token prompt and 16 new tokens), Gemma 2's soft-capping
    and gpt-oss's sinks included, through genai's own cache and calls."""
    name, model, tokenizer = tiny
    if name in GENAI_CANNOT_RUN:
        pytest.skip(f"genai cannot run {name}: its export says so")
    ids = tokenizer(PROMPT).input_ids
    program = load_program(artifact(name, "onnx"), runner="genai")
    got = greedy_with(program.forward, ids, NEW_TOKENS)
    assert_generation_matches(got, eager_reference(model, ids, NEW_TOKENS), FP32_LOGIT_ATOL, f"{name} in genai")


def test_genai_s_own_greedy_search_gives_eager_s_tokens(artifact):
    """What an app does: genai's generator picks the tokens itself (no kvexport code in the loop),
    to the cache's last position."""
    model, tokenizer = build_preset("tiny-gemma3")
    ids = tokenizer(PROMPT).input_ids
    new = TEST_CACHE_LEN - len(ids)
    expected, _ = eager_reference(model, ids, new)
    assert genai_greedy(artifact("tiny-gemma3", "onnx"), ids, new) == expected


def test_a_new_sequence_and_chunks_in_genai(artifact):
    model, tokenizer = build_preset("tiny-mistral")
    program = load_program(artifact("tiny-mistral", "onnx"), runner="genai")
    greedy_with(program.forward, tokenizer("something else entirely, and long").input_ids, 10)
    ids = tokenizer(PROMPT).input_ids
    got = greedy_with(program.forward, ids, NEW_TOKENS, chunks=[3, 7, 11, 23])
    assert_generation_matches(got, eager_reference(model, ids, NEW_TOKENS), FP32_LOGIT_ATOL, "chunks after another sequence")


def test_run_and_check_with_runner_genai(artifact, capsys):
    folder = artifact("tiny-gemma3", "onnx")
    args = ("run", folder, "--prompt", PROMPT, "--max-new-tokens", NEW_TOKENS, "--ignore-eos", "--json")
    code, out, err = run_cli(capsys, *args, "--runner", "genai")
    assert code == 0, err
    in_genai = json.loads(out)
    code, out, err = run_cli(capsys, *args)
    assert code == 0, err
    assert in_genai["new_ids"] == json.loads(out)["new_ids"]
    code, out, err = run_cli(capsys, "check", folder, "--runner", "genai", "--json")
    report = json.loads(out)
    assert code == 0 and report["ok"] and report["runner"] == "genai", report


def test_runner_genai_is_for_onnx_artifacts(artifact, capsys):
    code, _, err = run_cli(capsys, "run", artifact("tiny-llama", "executorch"), "--prompt", "Hi", "--runner", "genai")
    assert_one_line_error(code, err, "--runner genai runs ONNX artifacts; this one is executorch")
    code, _, err = run_cli(capsys, "check", artifact("tiny-llama", "onnx"), "--runner", "tensorrt")
    assert_one_line_error(code, err, "unknown --runner 'tensorrt'; choose kvexport or genai")


@pytest.mark.parametrize("name", sorted(GENAI_CANNOT_RUN))
def test_a_folder_genai_cannot_run_is_refused_in_one_line(artifact, capsys, name):
    """Gemma 4's and Gemma 3n's sliding layers that share an earlier layer's cache, and Llama 4's
    chunked layers, read a window buffer of the window's (the chunk's) rows, which genai does not
    allocate; the states of convolutions and linear attention are inputs genai does not know: the
    export writes no genai_config.json and says why in kvexport.json, and --runner genai repeats
    it; kvexport's own runner runs the folder."""
    folder = artifact(name, "onnx")
    assert not (folder / "genai_config.json").exists()
    code, _, err = run_cli(capsys, "check", folder, "--runner", "genai")
    assert_one_line_error(code, err, "onnxruntime-genai cannot run")
    assert "kvexport's runner" in err


@pytest.mark.parametrize("dtype", ["float16"])
def test_float16_in_genai(artifact, capsys, dtype):
    code, out, err = run_cli(capsys, "check", artifact("tiny-gemma3", "onnx", dtype=dtype), "--runner", "genai",
                             "--max-new-tokens", "12", "--json")
    assert code == 0, err
    assert json.loads(out)["ok"]


def test_runner_genai_needs_neither_torch_nor_transformers(artifact):
    folder = artifact("tiny-qwen3", "onnx")
    args = ["run", str(folder), "--prompt", PROMPT, "--max-new-tokens", str(NEW_TOKENS), "--ignore-eos", "--json"]
    done = subprocess.run([sys.executable, "-c", _WITHOUT_TORCH, *args, "--runner", "genai"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    expected, _ = greedy_with(load_program(folder).forward, json.loads(done.stdout)["prompt_ids"], NEW_TOKENS)
    assert json.loads(done.stdout)["new_ids"] == expected


def test_runner_genai_without_onnxruntime_genai_says_so(artifact, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "onnxruntime_genai", None)  # import raises ModuleNotFoundError
    code, _, err = run_cli(capsys, "run", artifact("tiny-llama", "onnx"), "--prompt", "Hi", "--runner", "genai")
    assert_one_line_error(code, err, "--runner genai needs onnxruntime-genai", "pip install onnxruntime-genai==0.18.0")


def test_chat_with_runner_genai_replies_as_kvexport_s_runner(artifact, capsys, monkeypatch):
    """Each turn feeds genai only its new tokens, /reset starts a new generator: the same turns."""
    from tests.runtime.test_chat import chat_cli

    folder = artifact("tiny-gemma3", "onnx")
    turns = {}
    for runner in ("kvexport", "genai"):
        code, out, err = chat_cli(capsys, monkeypatch, "Hi\nYo\n/reset\n\nHi\n", folder, "--json", "--max-new-tokens", "4",
                                  "--runner", runner)
        assert code == 0, err
        turns[runner] = [{k: t[k] for k in ("reply_ids", "prefilled_tokens", "conversation_tokens", "reset")}
                         for t in map(json.loads, out.splitlines())]
    assert len(turns["genai"]) == 3 and turns["genai"] == turns["kvexport"]


def _genai_has_cuda() -> bool:
    try:
        import onnxruntime_genai as og
    except ModuleNotFoundError:
        return False
    return og.is_cuda_available()


@pytest.mark.skipif(_genai_has_cuda(), reason="this onnxruntime-genai has CUDA")
def test_runner_genai_on_cuda_without_its_cuda_build_says_so(artifact, capsys):
    code, _, err = run_cli(capsys, "run", artifact("tiny-gemma3", "onnx", dtype="float16"), "--prompt", "Hi",
                           "--runner", "genai", "--device", "cuda")
    assert_one_line_error(code, err, "--runner genai --device cuda", "onnxruntime-genai-cuda==0.18.0")


@pytest.mark.gpu
@pytest.mark.skipif(not _genai_has_cuda(), reason="needs onnxruntime-genai-cuda and a CUDA GPU")
@pytest.mark.parametrize("name", ["tiny-gemma3", "tiny-llama"])
def test_genai_on_cuda_matches_kvexport_s_runner_on_the_cpu(artifact, name):
    """The float16 graph in genai on the GPU (its cache in GPU memory, its own ring handling) against
    kvexport's runner on the CPU provider, which the other tests hold to eager transformers."""
    from tests.runtime.test_onnx_program import FP16_PROVIDERS_ATOL

    _, tokenizer = build_preset(name)
    ids = tokenizer(PROMPT).input_ids
    folder = artifact(name, "onnx", dtype="float16")
    expected = greedy_with(load_program(folder).forward, ids, NEW_TOKENS)
    got = greedy_with(load_program(folder, device="cuda", runner="genai").forward, ids, NEW_TOKENS)
    assert_generation_matches(got, expected, FP16_PROVIDERS_ATOL, f"{name} in genai on cuda")


# Every field of genai_config.json that the manifest (or the graph it describes) also says.
VOUCHED_GENAI_FIELDS = [
    ("model", "context_length"), ("model", "vocab_size"), ("model", "eos_token_id"), ("model", "bos_token_id"),
    ("model", "pad_token_id"), ("model", "decoder", "filename"), ("model", "decoder", "head_size"),
    ("model", "decoder", "num_hidden_layers"), ("model", "decoder", "num_key_value_heads"),
    *(("model", "decoder", "inputs", name) for name in ("input_ids", "attention_mask", "past_key_names", "past_value_names")),
    *(("model", "decoder", "outputs", name) for name in ("logits", "present_key_names", "present_value_names")),
    ("model", "decoder", "sliding_window", "window_size"), ("model", "decoder", "sliding_window", "layers"),
    ("search", "max_length"), ("search", "past_present_share_buffer"),
]  # fmt: skip
JSON_VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(-2, 300), st.floats(allow_nan=False), st.text(max_size=24),
    st.sampled_from(["past_key_values.%d.key", "present.%d.value", "input_ids", "logits", "%s", "%d", "model.onnx.data"]),
    st.lists(st.integers(-1, 300), max_size=3),
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(field=st.sampled_from(VOUCHED_GENAI_FIELDS), value=JSON_VALUES)
def test_every_field_of_genai_config_the_manifest_says_is_checked(artifact, tmp_path, field, value):
    """A genai_config.json edited in any field the manifest also says (its sums rewritten) is
    refused in one line before anything runs; an edit to the same JSON value passes."""
    from kvexport.artifact.manifest import FileEntry, read_manifest, sha256_file
    from kvexport.errors import ArtifactError
    from kvexport.runtime.onnx_artifact import check_against_genai_config

    source = artifact("tiny-gemma3", "onnx")
    manifest = read_manifest(source, verify=False)
    config = json.loads((source / "genai_config.json").read_text())
    *parents, key = field
    holder = config
    for name in parents:
        holder = holder[name]
    same = json.dumps(holder[key]) == json.dumps(value) or (key == "eos_token_id" and json.dumps([holder[key]]) == json.dumps(value))
    holder[key] = value
    folder = tmp_path / f"edited-{len(list(tmp_path.iterdir()))}"
    folder.mkdir()
    (folder / "genai_config.json").write_text(json.dumps(config))
    entry = FileEntry(sha256_file(folder / "genai_config.json"), (folder / "genai_config.json").stat().st_size)
    manifest = dataclasses.replace(manifest, files={**manifest.files, "genai_config.json": entry})
    if same:
        check_against_genai_config(folder, manifest)
        return
    with pytest.raises(ArtifactError) as refused:
        check_against_genai_config(folder, manifest)
    assert "\n" not in str(refused.value) and "genai_config.json" in str(refused.value)
