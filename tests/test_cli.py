"""The command line: the export shorthand, run's output, and one clear line for each user mistake."""

from __future__ import annotations

import json

import pytest

from kvexport.cli import main


def run_cli(capsys, *args) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_info:
        main([str(a) for a in args])
    out, err = capsys.readouterr()
    return exit_info.value.code, out, err


def assert_one_line_error(code, err, *phrases):
    assert code == 2, err
    lines = [line for line in err.strip().splitlines() if line.startswith("kvexport: error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    for phrase in phrases:
        assert phrase in lines[0], lines[0]


def test_help_lists_commands(capsys):
    code, out, _ = run_cli(capsys, "--help")
    assert code == 0
    for command in ("export", "run", "check"):
        assert command in out


def test_model_shorthand_is_export(tmp_path, capsys):
    out_dir = tmp_path / "llama"
    code, out, err = run_cli(capsys, "tiny-llama", "--target", "executorch", "-o", out_dir, "--max-cache-len", "32", "--json")
    assert code == 0, err
    manifest = json.loads((out_dir / "kvexport.json").read_text())
    assert manifest["max_cache_len"] == 32 and manifest["target"] == "executorch"
    assert set(json.loads(out)["seconds"]) == {"load", "export", "lower", "save"}
    for step in ("load", "export", "lower", "save"):  # visible progress with timings
        assert f"✓ {step} " in err


def test_default_max_cache_len_is_said(tmp_path, capsys, monkeypatch):
    # Stop right after the plan is printed: the default and its reason are in the first line.
    from kvexport.exporter import pipeline

    monkeypatch.setattr(pipeline.sources, "load_model", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt()))
    code, _, err = run_cli(capsys, "export", "tiny-llama", "-o", tmp_path / "x")
    assert code == 130
    assert "max_cache_len 512 (default: the smaller of 512 positions and 2048)" in err
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize(
    "args, phrases",
    [
        (["no-such-model"], ["not found", "tiny-llama"]),
        (["tiny-llama", "--target", "tflite"], ["unknown target 'tflite'", "executorch"]),
        (["tiny-llama", "--dtype", "int3"], ["unknown dtype 'int3'"]),
        (["tiny-llama", "--max-cache-len", "0"], ["positive"]),
        (["tiny-llama", "--max-cache-len", "-4"], ["positive"]),
        (["tiny-llama", "--max-cache-len", "513"], ["exceeds the model's maximum positions (512)"]),
        (["some-org/not-cached-model"], ["not in the local Hugging Face cache"]),
    ],
)
def test_export_mistakes_get_one_line(tmp_path, capsys, args, phrases):
    code, _, err = run_cli(capsys, *args, "-o", tmp_path / "out")
    assert_one_line_error(code, err, *phrases)
    assert not (tmp_path / "out").exists()


def test_unsupported_architecture_is_refused_before_loading(tmp_path, capsys):
    folder = tmp_path / "ssm"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "mamba", "architectures": ["MambaForCausalLM"]}))
    code, _, err = run_cli(capsys, folder, "-o", tmp_path / "out")
    assert_one_line_error(code, err, "'mamba' is not supported", "state-space")


def test_folder_without_config_is_refused(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    code, _, err = run_cli(capsys, tmp_path / "empty", "-o", tmp_path / "out")
    assert_one_line_error(code, err, "without config.json")


def test_existing_output_needs_force(artifact, capsys):
    folder = artifact("tiny-gemma3")
    before = (folder / "kvexport.json").read_text()
    code, _, err = run_cli(capsys, "tiny-gemma3", "-o", folder)
    assert_one_line_error(code, err, "already exists", "--force")
    assert (folder / "kvexport.json").read_text() == before


def test_run_json_fields(artifact, capsys):
    code, out, _ = run_cli(capsys, "run", artifact("tiny-gemma3"), "--prompt", "Hello", "--max-new-tokens", "5", "--ignore-eos", "--json")
    assert code == 0
    result = json.loads(out)
    assert {"prompt_ids", "new_ids", "text", "prefill_tokens_per_s", "decode_tokens_per_s"} <= set(result)
    assert len(result["new_ids"]) == 5 and result["prompt_ids"][0] == 96  # <bos>


@pytest.mark.parametrize(
    "prompt, extra, phrases",
    [
        ("x" * 80, [], ["longer than the artifact's max_cache_len 64"]),
        ("Hello", ["--max-new-tokens", "100"], ["exceeds the artifact's max_cache_len 64", "at most 59"]),
        ("", [], ["prompt is empty"]),
    ],
)
def test_run_refuses_what_cannot_fit(artifact, capsys, prompt, extra, phrases):
    code, _, err = run_cli(capsys, "run", artifact("tiny-gemma3"), "--prompt", prompt, *extra)
    assert_one_line_error(code, err, *phrases)


def test_run_on_a_folder_that_is_not_an_artifact(tmp_path, capsys):
    code, _, err = run_cli(capsys, "run", tmp_path, "--prompt", "hi")
    assert_one_line_error(code, err, "no kvexport.json")


def test_run_refuses_a_corrupted_program(artifact, tmp_path, capsys):
    import shutil

    folder = tmp_path / "copy"
    shutil.copytree(artifact("tiny-gemma3"), folder)
    data = bytearray((folder / "model.pte").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (folder / "model.pte").write_bytes(bytes(data))
    code, _, err = run_cli(capsys, "run", folder, "--prompt", "hi")
    assert_one_line_error(code, err, "model.pte does not match the sha256")
