"""``kvexport check``: passes on a faithful artifact, fails (and says how) on an unfaithful one."""

from __future__ import annotations

import json

import pytest
import torch

from kvexport.cli import main


def run_cli(capsys, *args) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_info:
        main([str(a) for a in args])
    out, err = capsys.readouterr()
    return exit_info.value.code, out, err


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
def test_check_with_eager_on_the_gpu(artifact, capsys):
    code, out, _ = run_cli(capsys, "check", artifact("tiny-gemma3"), "--device", "cuda", "--json")
    assert code == 0, out
