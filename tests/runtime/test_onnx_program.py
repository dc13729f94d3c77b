"""The ONNX runner: cache buffers bound in place, run/check on an ONNX folder, no torch needed, CUDA."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import numpy as np
import onnxruntime as ort
import pytest
import torch

from kvexport.errors import InvalidOptionError, PromptTooLongError
from kvexport.models.presets import build_preset
from kvexport.checker.check import LOGIT_TOLERANCE
from kvexport.runtime.programs import load_program

from tests.conftest import NEW_TOKENS, PROMPT, TEST_CACHE_LEN
from tests.helpers import (
    assert_generation_matches, assert_one_line_error, eager_reference, edit_manifest, greedy_with, run_cli,
)

HAS_CUDA_EP = "CUDAExecutionProvider" in ort.get_available_providers()
# float16 logits, CUDA provider vs CPU provider on one graph: their kernels round differently
# (an H100, 2026-11-26: up to 0.46 over 40 tokens of a tiny model); check's float16 tolerance.
FP16_PROVIDERS_ATOL = LOGIT_TOLERANCE["float16"]


def test_decode_writes_new_rows_in_place_and_binds_the_cache_once(artifact, monkeypatch):
    """No copy of the cache per step: every buffer is bound once as its layer's past and present
    (GroupQueryAttention writes the new rows in place); per step only input_ids and the attention
    mask are bound. A sliding layer's buffer is the window: the kernel keeps the newest positions
    at its first rows and the runner never moves one."""
    bound = []
    for method in ("bind_input", "bind_output"):
        original = getattr(ort.IOBinding, method)

        def record(self, name, device_type="cpu", device_id=0, element_type=None, shape=None, buffer_ptr=None, _o=original):
            bound.append((name, list(shape) if shape is not None else None, buffer_ptr))
            return _o(self, name, device_type, device_id, element_type, shape, buffer_ptr)

        monkeypatch.setattr(ort.IOBinding, method, record)

    program = load_program(artifact("tiny-gemma3", "onnx"))  # layer 0: a window of 6; layer 1: full
    static, window = program._layers[1].buffers["key"], program._layers[0].buffers["key"]
    # tiny Gemma 3 has one KV head, like Gemma 3 270M
    assert static.array.shape == (1, 1, TEST_CACHE_LEN, 16) and window.array.shape == (1, 1, 6, 16)
    at_load = {name: (shape, ptr) for name, shape, ptr in bound}
    assert at_load["past_key_values.0.key"] == at_load["present.0.key"] == ([1, 1, 6, 16], window.ptr)
    assert at_load["past_key_values.1.key"] == at_load["present.1.key"] == ([1, 1, TEST_CACHE_LEN, 16], static.ptr)

    prompt = list(range(10, 20))
    bound.clear()
    program.forward(prompt, 0)  # 10 tokens, longer than the window, in one call
    assert {name: shape for name, shape, _ in bound} == {"input_ids": [1, 10], "attention_mask": [1, 10]}
    for pos in range(len(prompt), len(prompt) + 8):
        bound.clear()
        before = window.array.copy()
        program.forward([42], pos)
        assert {name: shape for name, shape, _ in bound} == {"input_ids": [1, 1], "attention_mask": [1, pos + 1]}
        # the window slid by one row: the newest position went to the last row, the oldest left
        assert np.array_equal(window.array[:, :, :5], before[:, :, 1:]) and not np.array_equal(window.array, before)
    written = np.abs(static.array[0]).sum(axis=(0, 2)) > 0
    assert written[: len(prompt) + 8].all() and not written[len(prompt) + 8:].any()


def test_calls_must_be_contiguous_and_fit(artifact):
    program = load_program(artifact("tiny-gemma3", "onnx"))
    program.forward([10, 11, 12], 0)
    with pytest.raises(InvalidOptionError, match="contiguous"):
        program.forward([13], 5)
    with pytest.raises(PromptTooLongError, match="max_cache_len"):
        program.forward([1] * (TEST_CACHE_LEN + 1), 0)
    program.forward([13], 3)  # the sequence is still usable


def test_run_and_check_on_an_onnx_folder(artifact, capsys):
    folder = artifact("tiny-mistral", "onnx")
    model, tokenizer = build_preset("tiny-mistral")
    code, out, err = run_cli(capsys, "run", folder, "--prompt", PROMPT, "--max-new-tokens", NEW_TOKENS, "--ignore-eos", "--json")
    assert code == 0, err
    result = json.loads(out)
    assert result["new_ids"] == eager_reference(model, result["prompt_ids"], NEW_TOKENS)[0]
    assert result["decode_tokens_per_s"] > 0
    code, out, err = run_cli(capsys, "check", folder, "--json")
    report = json.loads(out)
    assert code == 0 and report["ok"] and report["target"] == "onnx", report
    assert any(p["prompt_tokens"] + p["new_tokens"] > 6 for p in report["prompts"])


_WITHOUT_TORCH = """
import sys
class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "transformers"):
            raise ImportError(f"{name} is blocked in this test")
sys.meta_path.insert(0, NoTorch())
from kvexport.cli import main
main(sys.argv[1:])
"""


def test_run_needs_neither_torch_nor_transformers(artifact, tmp_path):
    folder = artifact("tiny-qwen3", "onnx")
    args = ["run", str(folder), "--prompt", PROMPT, "--max-new-tokens", str(NEW_TOKENS), "--ignore-eos", "--json"]
    done = subprocess.run([sys.executable, "-c", _WITHOUT_TORCH, *args], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    expected, _ = greedy_with(load_program(folder).forward, result["prompt_ids"], NEW_TOKENS)
    assert result["new_ids"] == expected


@pytest.mark.skipif(HAS_CUDA_EP, reason="this onnxruntime has CUDA")
def test_cuda_without_onnxruntime_gpu_says_so(artifact, capsys):
    folder = artifact("tiny-gemma3", "onnx", dtype="float16")
    code, _, err = run_cli(capsys, "run", folder, "--prompt", "Hi", "--device", "cuda")
    assert_one_line_error(code, err, "--device cuda", "onnxruntime-gpu")


def test_cuda_takes_float16_and_bfloat16_graphs_only(artifact, capsys):
    """What onnxruntime-gpu 1.31 got wrong on an H100 is refused before anything loads, with or
    without a GPU here: a float32 graph (its CUDA GroupQueryAttention is float16 and bfloat16 only;
    the CPU fallback read a wrong cache after the first step)."""
    code, _, err = run_cli(capsys, "run", artifact("tiny-gemma3", "onnx"), "--prompt", "Hi", "--device", "cuda")
    assert_one_line_error(code, err, "--device cuda runs float16 and bfloat16 ONNX artifacts; this one is float32",
                          "--dtype float16")


@pytest.mark.parametrize("command", [["run", "--prompt", "Hi"], ["run", "--prompt", "Hi", "--runner", "genai"], ["check"]],
                         ids=["run", "run-genai", "check"])
def test_a_bfloat16_graph_runs_on_the_gpu_only(artifact, capsys, command):
    """ONNX Runtime's CPU provider has no bfloat16 MatMul: both runners (and check, which runs one)
    say so in one line before a session is made."""
    folder = artifact("tiny-gemma3", "onnx", dtype="bfloat16")
    code, _, err = run_cli(capsys, command[0], folder, *command[1:])
    assert_one_line_error(code, err, "a bfloat16 ONNX artifact runs on the GPU only", "--device cuda")


def test_bfloat16_logits_widen_to_float32_exactly():
    """The runner holds a bfloat16 graph's logits as their bits (numpy has no bfloat16) and widens
    them as torch does."""
    from kvexport.runtime.onnx_program import _as_float32

    values = torch.cat([torch.randn(1000) * 30, torch.tensor([0.0, -0.0, float("inf"), -float("inf"), 1e-40])])
    bf16 = values.to(torch.bfloat16)
    widened = _as_float32(bf16.view(torch.int16).numpy().view(np.uint16), "bfloat16")
    assert np.array_equal(widened, bf16.float().numpy())


def test_an_onnx_artifact_of_an_earlier_format_is_refused_in_one_line(artifact, capsys, tmp_path):
    older = tmp_path / "older"
    shutil.copytree(artifact("tiny-gemma3", "onnx"), older)
    edit_manifest(lambda m: m.update(format_version=5))(older)
    code, _, err = run_cli(capsys, "run", older, "--prompt", "Hi")
    assert_one_line_error(code, err, "format version 5", "re-export")


def test_an_unknown_device_is_refused(artifact, capsys):
    code, _, err = run_cli(capsys, "run", artifact("tiny-gemma3", "onnx"), "--prompt", "Hi", "--device", "tpu")
    assert_one_line_error(code, err, "unknown device 'tpu'")


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA_EP, reason="needs onnxruntime-gpu and a CUDA GPU")
@pytest.mark.parametrize("name", ["tiny-gemma3", "tiny-llama"])
def test_cuda_generation_matches_the_cpu_providers(artifact, name):
    """The float16 graph on ONNX Runtime's CUDA provider (buffers in GPU memory) against the same
    graph on the CPU provider, which the other tests hold to eager transformers: past the window,
    prompts in one call and in several."""
    _, tokenizer = build_preset(name)
    ids = tokenizer(PROMPT).input_ids
    folder = artifact(name, "onnx", dtype="float16")
    program = load_program(folder, device="cuda")
    assert program._layers[0].buffers["key"].value.device_name() == "cuda"
    for chunks in ([len(ids)], [3, 7, 11, 23]):
        expected = greedy_with(load_program(folder).forward, ids, NEW_TOKENS, chunks=chunks)
        got = greedy_with(program.forward, ids, NEW_TOKENS, chunks=chunks)
        assert_generation_matches(got, expected, FP16_PROVIDERS_ATOL, f"cuda, chunks {chunks}")


@pytest.mark.parametrize(
    "change, phrase",
    [
        (lambda layer: layer.update(state=[5, 16, 16]), "past_state.0.recurrent is [1, 5, 16, 16] but the program has [1, 4, 16, 16]"),
        (lambda layer: layer.update(channels=64), "past_state.0.conv is [1, 64, 3] but the program has [1, 128, 3]"),
        (lambda layer: layer.update(cache="conv"),
         "the layers' states are past_state.0.conv but the program has past_state.0.conv, past_state.0.recurrent"),
        (lambda layer: layer.pop("state"), "kvexport.json lacks layers[0].state, which an ONNX artifact has"),
    ],
    ids=["recurrent-shape", "conv-channels", "conv-for-recurrent", "no-state"],
)
def test_a_manifest_whose_states_do_not_fit_the_graph_is_refused_in_one_line(artifact, tmp_path, capsys, change, phrase):
    """The runner sizes a linear-attention layer's state buffers from kvexport.json: one that
    disagrees with the graph's inputs is refused before any buffer is made."""
    folder = tmp_path / "copy"
    shutil.copytree(artifact("tiny-qwen3.5", "onnx"), folder)
    edit_manifest(lambda m: change(m["layers"][0]))(folder)
    code, _, err = run_cli(capsys, "run", folder, "--prompt", "hi", "--max-new-tokens", "2")
    assert_one_line_error(code, err, phrase)
