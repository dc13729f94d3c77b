"""One matrix row run in this process: a quantized row is exported with its scheme (and the row's
prefill chunk) and checked for agreement (its tokens may differ from eager's), not for identical
tokens."""

from __future__ import annotations

from kvexport.artifact.manifest import read_manifest
from kvexport.matrix.row import ARTIFACT_DIR, check_summary, run_row
from kvexport.matrix.spec import Row


def test_a_quantized_row_is_checked_for_agreement(tmp_path):
    row = Row(0, "tiny-gemma3", "onnx", "float32", 64, timeout_s=600, check_new_tokens=None, run_new_tokens=4,
              quantize="int4", prefill_chunk=16)
    result = run_row(row, tmp_path)
    options = read_manifest(tmp_path / ARTIFACT_DIR).export_options
    assert (options["quantize"], options["prefill_chunk"]) == ("int4", 16)
    assert "quantize" in result["export_steps"]
    assert 0.0 <= result["top1_agreement"] <= 1.0 and result["first_divergence"] is None
    # A random 4-bit tiny model may or may not reach 95%; the verdict and its reason follow the figure.
    if result["top1_agreement"] >= 0.95:
        assert result["status"] == "pass" and result["failure"] is None
    else:
        assert result["status"] == "fail"
        assert result["failure"]["stage"] == "check" and "top-1 agreement" in result["failure"]["reason"]
    assert result["decode_tokens_per_s"] > 0


def test_a_check_whose_eager_logits_are_not_finite_says_so():
    from kvexport.checker.check import CheckReport, PromptReport

    prompts = [PromptReport("a", 5, 8, compared_steps=8), PromptReport("b", 9, 8, match=False, eager_not_finite_at=3)]
    summary = check_summary(CheckReport("f", "onnx", "float32", "cpu", 0.05, prompts))
    assert summary["check_ok"] is False and summary["first_divergence"] is None
    assert summary["check_reason"] == "eager's logits are not finite at new token 3 of prompt 1: nothing to compare with"
    quantized = CheckReport("f", "onnx", "float32", "cpu", 0.05, prompts, mode="agreement", min_agreement=0.95)
    assert check_summary(quantized)["check_ok"] is False  # prompt 1's agreement over its 0 steps does not count


def test_a_row_exports_with_kvexport_s_hash_seed(monkeypatch):
    """A row's process has the hash seed `kvexport export` runs under, so its artifact has the CLI's bytes."""
    from kvexport.exporter import EXPORT_HASH_SEED
    from kvexport.matrix.runner import child_env

    monkeypatch.setenv("PYTHONHASHSEED", "7")
    assert child_env()["PYTHONHASHSEED"] == EXPORT_HASH_SEED


def test_a_real_shape_row_builds_its_model_and_may_skip_the_check(tmp_path):
    """A ``[models.NAME] shape = ...`` row builds its checkpoint (random weights, streamed, in a
    process of its own), exports it from there, and without ``check`` only runs it."""
    from kvexport.models.presets import VOCAB_SIZE

    small = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "head_dim": 16,
             "num_key_value_heads": 2, "vocab_size": VOCAB_SIZE}
    row = Row(0, "llama-small", "onnx", "float32", 64, timeout_s=600, check_new_tokens=None, run_new_tokens=4,
              shape_config={"shape": "llama3.2-1b", "overrides": small}, check=False)
    result = run_row(row, tmp_path)
    assert result["status"] == "pass" and result["failure"] is None, result["failure"]
    assert result["family"] == "llama" and (tmp_path / "model" / "model.safetensors.index.json").is_file()
    assert result["export_peak_rss_mb"] > 0 and result["artifact_mb"] > 0 and result["decode_tokens_per_s"] > 0
    assert "max_logit_diff" not in result and "genai" not in result  # no check here, nor in genai
    assert read_manifest(tmp_path / ARTIFACT_DIR).model_type == "llama"
