"""``kvexport check``: passes on a faithful artifact, fails (and says how) on an unfaithful one."""

from __future__ import annotations

import json

import numpy as np
import onnxruntime as ort
import pytest
import torch

from kvexport.checker.check import LOGIT_TOLERANCE, Float32Logits, check_half_precision_prompt, check_prompt, logit_tolerance

from tests.helpers import assert_one_line_error, fake_manifest, run_cli


def test_check_passes_past_the_window(artifact, capsys):
    code, out, err = run_cli(capsys, "check", artifact("tiny-gemma3"), "--json")
    report = json.loads(out)
    assert code == 0 and report["ok"], report
    # Its default prompts run past the window (6): a short prompt with a long generation, and a
    # prompt longer than the window.
    lengths = [(p["prompt_tokens"], p["new_tokens"]) for p in report["prompts"]]
    assert any(n > 6 for _, n in lengths) and any(p > 6 for p, _ in lengths)
    assert all(p["compared_steps"] == p["new_tokens"] for p in report["prompts"])


def test_check_fails_against_another_model_and_reports_the_divergence(artifact, capsys):
    # Same vocabulary, different weights: the check must catch it at the first step.
    code, out, _ = run_cli(capsys, "check", artifact("tiny-mistral"), "--model", "tiny-llama", "--json", "--max-new-tokens", "8")
    report = json.loads(out)
    assert code == 1 and not report["ok"]
    first = report["prompts"][0]
    assert first["match"] is False and first["first_divergence"] is not None
    assert first["eager_margin"] > 0 and first["near_tie"] is False


def test_check_against_a_model_of_another_vocabulary_is_refused_before_it_loads(artifact, capsys, tmp_path):
    """Issue 58, class 8: the logits could not be compared (was a numpy broadcast traceback); the
    config says so before any weight loads (the folder has none)."""
    from kvexport.models.presets import tiny_config

    tiny_config("llama", {"vocab_size": 120}).save_pretrained(tmp_path / "vocab-120")
    code, _, err = run_cli(capsys, "check", artifact("tiny-gemma3"), "--model", str(tmp_path / "vocab-120"))
    assert_one_line_error(code, err, "has a vocabulary of 120 tokens and the artifact one of 100")


def test_check_human_output_names_the_tolerance(artifact, capsys):
    code, out, err = run_cli(capsys, "check", artifact("tiny-gemma3"), "--prompt", "Hello there", "--max-new-tokens", "12")
    assert code == 0
    assert "PASS" in out and "identical" in out
    assert "0.05" in err  # the fp32 tolerance is stated


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_check_on_cuda_without_a_gpu_says_so(artifact, capsys):
    code, _, err = run_cli(capsys, "check", artifact("tiny-gemma3"), "--device", "cuda")
    assert code == 2
    assert "no CUDA GPU" in err and "Traceback" not in err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("target, dtype", [("executorch", "float32"), ("onnx", "float16"), ("onnx", "bfloat16")])
def test_check_with_eager_on_the_gpu(artifact, capsys, target, dtype):
    """Eager on the GPU; the `.pte` on the CPU, the ONNX graph on ONNX Runtime's CUDA provider."""
    if target == "onnx" and "CUDAExecutionProvider" not in ort.get_available_providers():
        pytest.skip("needs onnxruntime-gpu")
    code, out, _ = run_cli(capsys, "check", artifact("tiny-gemma3", target, dtype=dtype), "--device", "cuda", "--json")
    assert code == 0, out


class Float32Standin:
    """An artifact that computes exactly: float32 eager's logits for the tokens it was given.
    ``offset`` is added to every step's logits (a broken export)."""

    def __init__(self, model, offset: np.ndarray | None = None):
        self.model, self.offset, self.ids = model, offset, []
        self.manifest = fake_manifest(max_cache_len=512)

    def forward(self, tokens: list[int], start: int) -> np.ndarray:
        self.ids = self.ids[:start] + list(tokens)
        with torch.no_grad():
            logits = self.model(torch.tensor([self.ids])).logits[0, -1].float().numpy()
        return logits if self.offset is None else logits + self.offset


@pytest.fixture(scope="module")
def llama_in_both_precisions():
    """A tiny Llama deep enough (4 layers) that eager float16 is off float32 eager by more than the tolerance."""
    from kvexport.models.presets import build_tiny, tiny_config

    config = tiny_config("llama", {"num_hidden_layers": 4})
    half, tokenizer = build_tiny(config, torch.float16)
    return half, build_tiny(config, torch.float32)[0], tokenizer("The capital of France is")["input_ids"]


def test_a_float16_check_judges_steps_beyond_its_tolerance_against_float32_eager(llama_in_both_precisions):
    half, full, prompt = llama_in_both_precisions
    float32_logits = Float32Logits(lambda: full)
    exact = check_prompt(Float32Standin(full), half, prompt, 64, LOGIT_TOLERANCE["float16"], float32_logits=float32_logits)
    # Eager float16 is itself more than the tolerance off float32 eager on this model, so an exact
    # artifact is too; measured against float32 eager it is within the tolerance (of zero) beyond that.
    assert exact.max_logit_diff > LOGIT_TOLERANCE["float16"] and exact.float32_steps > 0
    assert exact.match and exact.logits_ok and exact.max_diff_beyond_rounding <= 0

    offset = np.zeros(half.config.vocab_size, dtype=np.float32)
    offset[7] = 5.0  # one logit off by 5 at every step: beyond any rounding of this model
    broken = check_prompt(Float32Standin(full, offset), half, prompt, 8, LOGIT_TOLERANCE["float16"],
                          float32_logits=float32_logits)
    assert not broken.logits_ok and broken.max_diff_beyond_rounding > LOGIT_TOLERANCE["float16"]


def test_a_float16_token_difference_is_a_rounding_tie_only_within_eager_float16s_own_error(llama_in_both_precisions):
    half, full, prompt = llama_in_both_precisions
    offset = np.zeros(half.config.vocab_size, dtype=np.float32)
    offset[7] = 100.0  # token 7 at every step, whatever the model says
    report = check_prompt(Float32Standin(full, offset), half, prompt, 8, LOGIT_TOLERANCE["float16"],
                          float32_logits=Float32Logits(lambda: full))
    assert not report.match and report.first_divergence == 0 and report.rounding_ties == []
    assert report.artifact_token == 7 and report.near_tie is False


@pytest.mark.parametrize("target, dtype, features, expected", [
    ("executorch", "float16", ["avx2", "avx512_fp16"], LOGIT_TOLERANCE["bfloat16"]),  # XNNPACK sums in float16 there
    ("executorch", "float16", ["asimddp", "asimdhp"], LOGIT_TOLERANCE["bfloat16"]),
    ("executorch", "float16", ["avx2", "avx512f"], LOGIT_TOLERANCE["float16"]),  # in float32 there, as eager does
    ("onnx", "float16", ["avx512_fp16"], LOGIT_TOLERANCE["float16"]),
    ("executorch", "float32", ["avx512_fp16"], LOGIT_TOLERANCE["float32"]),
])
def test_a_float16_pte_is_held_to_the_tolerance_of_the_arithmetic_this_cpu_gives_it(monkeypatch, target, dtype, features, expected):
    import platform

    monkeypatch.setattr(platform, "system", lambda: "Linux")
    monkeypatch.setattr("kvexport.runtime.cpu.cpu_info", lambda: ("a CPU", features))
    assert logit_tolerance(fake_manifest(target=target, dtype=dtype)) == expected


def test_where_eager_float16_overflows_a_float16_artifact_is_held_to_float32_eager():
    from kvexport.models.presets import build_preset

    # Gemma 3's residual stream passes float16's 65,504 and eager float16 gives NaN logits; here
    # logits ~1e4 times larger than the preset's do the same to its lm_head.
    half, tokenizer = build_preset("tiny-llama", torch.float16)
    full = build_preset("tiny-llama", torch.float32)[0]
    for model in (half, full):
        model.lm_head.weight.data *= 1e4
    prompt = tokenizer("The capital of France is")["input_ids"]
    float32_logits = Float32Logits(lambda: full)
    report = check_half_precision_prompt(Float32Standin(full), half, float32_logits, prompt, 8, LOGIT_TOLERANCE["float16"])
    assert report.float16_eager_overflow_at == 0 and report.eager_not_finite_at is None
    assert report.match and report.logits_ok and report.compared_steps == 8

    alone = check_prompt(Float32Standin(full), half, prompt, 8, LOGIT_TOLERANCE["float16"], float32_logits=float32_logits)
    assert alone.eager_not_finite_at == 0 and not alone.match and alone.compared_steps == 0


class DivergingStandin(Float32Standin):
    """Exact until ``diverge_at``, where it takes eager's second choice by the smallest step that
    flips it; before that, eager's top logit raised by ``off_before`` (which changes no choice)."""

    def __init__(self, model, diverge_at: int, off_before: float):
        super().__init__(model)
        self.diverge_at, self.off_before, self.calls = diverge_at, off_before, 0

    def forward(self, tokens: list[int], start: int) -> np.ndarray:
        logits, step = super().forward(tokens, start).copy(), self.calls
        self.calls += 1
        top, second = np.argsort(logits)[::-1][:2]
        if step < self.diverge_at:
            logits[top] += self.off_before
        elif step == self.diverge_at:
            logits[second] = logits[top] + 1e-4
        return logits


@pytest.mark.parametrize("off_before, kind", [(0.0, "near-tie"), (2 * LOGIT_TOLERANCE["float32"], "mismatch")])
def test_a_divergence_is_a_near_tie_only_where_the_logits_were_right_until_then(off_before, kind):
    from kvexport.cli.check import summary_line
    from kvexport.models.presets import build_preset

    model, tokenizer = build_preset("tiny-llama")
    model.lm_head.weight.data *= 1e-3  # logits of ~0.02: every margin is within twice the tolerance
    prompt = tokenizer("The capital of France is")["input_ids"]
    tolerance = LOGIT_TOLERANCE["float32"]
    report = check_prompt(DivergingStandin(model, 3, off_before), model, prompt, 6, tolerance)
    assert not report.match and report.first_divergence == 3 and report.eager_margin <= 2 * tolerance
    assert report.max_logit_diff == pytest.approx(off_before, abs=1e-4)
    assert report.near_tie is (kind == "near-tie") and report.logits_ok is (kind == "near-tie")
    report.prompt = "The capital of France is"
    assert f"({kind})" in summary_line(report, tolerance)


# --baseline: an int8 KV cache beside the same export with a float one.


def test_a_baseline_tells_the_kv_cache_s_error_from_the_weights(artifact, capsys):
    """tiny-gemma3 on ONNX, int8 KV beside float KV. The float one is exact (its agreement with eager
    100%), so the int8 one's agreement with it is its agreement with eager, and their logits differ
    by its difference from eager to within the float artifact's own tolerance."""
    int8, float_kv = artifact("tiny-gemma3", "onnx", kv_cache="int8"), artifact("tiny-gemma3", "onnx")
    code, out, err = run_cli(capsys, "check", int8, "--baseline", float_kv, "--json")
    report = json.loads(out)
    assert code == (0 if report["ok"] else 1)  # the int8 cache's agreement, not the baseline, decides
    for prompt in report["prompts"]:
        assert prompt["baseline_top1_agreement"] == 1.0
        assert prompt["top1_agreement_with_baseline"] == prompt["top1_agreement"]
        assert abs(prompt["max_logit_diff_vs_baseline"] - prompt["max_logit_diff"]) <= LOGIT_TOLERANCE["float32"]
        assert prompt["max_logit_diff_vs_baseline"] > LOGIT_TOLERANCE["float32"]  # the cache's rounding shows
    code, out, _ = run_cli(capsys, "check", int8, "--baseline", float_kv, "--max-new-tokens", "8", "--prompt", "Hi")
    assert "float-KV baseline: its own agreement with eager 100.0%" in out


@pytest.mark.parametrize(
    "which, phrase",
    [("float-artifact", "this artifact's KV cache is float"),
     ("int8-baseline", "its KV cache is int8 too"),
     ("other-model", "its source differs")],
    ids=["float-artifact", "int8-baseline", "other-model"],
)  # fmt: skip
def test_a_baseline_that_is_not_the_same_export_with_a_float_cache_is_refused(artifact, capsys, which, phrase):
    int8 = artifact("tiny-gemma3", "onnx", kv_cache="int8")
    folder, baseline = {
        "float-artifact": (artifact("tiny-gemma3", "onnx"), int8),
        "int8-baseline": (int8, int8),
        "other-model": (int8, artifact("tiny-qwen3", "onnx")),
    }[which]
    code, _, err = run_cli(capsys, "check", folder, "--baseline", baseline)
    assert code == 2 and phrase in err and "Traceback" not in err


@pytest.mark.parametrize("case", ["exact", "diverging", "agreement"])
def test_a_machine_that_holds_one_at_a_time_gets_the_same_report(artifact, monkeypatch, case):
    """Where the eager model and the artifact do not both fit, eager runs first and is let go before
    the artifact loads: the report is the one the two side by side give (identical tokens; another
    model's artifact, diverging at once; an int8 KV cache held to agreement)."""
    from kvexport.checker import check

    folder, model = {
        "exact": (artifact("tiny-gemma3"), None),
        "diverging": (artifact("tiny-mistral"), "tiny-llama"),
        "agreement": (artifact("tiny-gemma3", "onnx", kv_cache="int8"), None),
    }[case]
    side_by_side = check.run_check(folder, model_name=model)
    monkeypatch.setattr(check, "holds_both", lambda *args: False)
    one_at_a_time = check.run_check(folder, model_name=model)
    assert one_at_a_time.one_at_a_time and not side_by_side.one_at_a_time
    assert {**one_at_a_time.to_dict(), "one_at_a_time": False} == side_by_side.to_dict()
    assert side_by_side.ok == (case != "diverging")


def test_whether_the_machine_holds_the_model_and_the_artifact_at_once(artifact, monkeypatch):
    from kvexport.artifact.manifest import read_manifest
    from kvexport.checker import check
    from kvexport.exporter import memory_plan

    folder = artifact("tiny-gemma3")
    manifest = read_manifest(folder)
    monkeypatch.setattr(memory_plan, "total_memory_bytes", lambda: 2**40)
    assert check.holds_both(folder, manifest, None)
    monkeypatch.setattr(memory_plan, "total_memory_bytes", lambda: memory_plan.BASE_BYTES["executorch"])
    assert not check.holds_both(folder, manifest, None)
