"""The command line: the export shorthand, run's output, and one clear line for each user mistake."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch


from tests.helpers import assert_one_line_error, edit_manifest, run_cli, write_tiny_gguf


def snapshot(root) -> dict:
    """Every path under ``root`` (hidden ones included) with its file's sha256: equal snapshots
    mean nothing was created, removed or changed."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
        for p in sorted(root.rglob("*"))
    }


def test_help_lists_commands(capsys):
    code, out, _ = run_cli(capsys, "--help")
    assert code == 0
    for command in ("export", "run", "check"):
        assert command in out


def test_help_shows_the_defaults_options_describe(capsys):
    code, out, _ = run_cli(capsys, "export", "--help")
    text = " ".join(out.split())  # help lines wrap
    assert code == 0
    assert "[default: min(max_cache_len, 512); 64 with gated-delta linear attention]" in text and "[default: MODEL-TARGET]" in text



def test_every_option_and_argument_of_every_command_has_help_text():
    import typer.main

    from kvexport.cli import app

    group = typer.main.get_command(app)
    for name, command in group.commands.items():
        if command.context_settings.get("ignore_unknown_options"):
            continue  # run: its options are argparse's, declared with their help in runtime/options.py
        for param in command.params:
            assert getattr(param, "help", None), f"kvexport {name}: {param.name} has no help text"


def test_model_shorthand_is_export(tmp_path, capsys):
    out_dir = tmp_path / "llama"
    code, out, err = run_cli(capsys, "tiny-llama", "--target", "onnx", "-o", out_dir, "--max-cache-len", "32", "--json")
    assert code == 0, err
    manifest = json.loads((out_dir / "kvexport.json").read_text())
    assert manifest["max_cache_len"] == 32 and manifest["target"] == "onnx"
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
        (["no-such-model"], ["not found", "give a model folder", "tiny-llama"]),
        (["tiny-llama", "--target", "tflite"], ["unknown target 'tflite'", "executorch"]),
        (["tiny-llama", "--dtype", "int3"], ["unknown dtype 'int3'"]),
        (["tiny-llama", "--max-cache-len", "0"], ["positive"]),
        (["tiny-llama", "--max-cache-len", "-4"], ["positive"]),
        (["tiny-llama", "--max-cache-len", "513"], ["exceeds the model's maximum positions (512)"]),
        (["tiny-llama", "--prefill-chunk", "0"], ["--prefill-chunk", "positive"]),
        (["tiny-llama", "--max-cache-len", "64", "--prefill-chunk", "65"], ["--prefill-chunk 65 exceeds --max-cache-len 64"]),
        (["tiny-llama", "--prefill-chunk", "2"], ["--prefill-chunk 2 cannot be exported for --target executorch",
                                                   "use --prefill-chunk 1 (one token per call) or 3 or more"]),
        (["tiny-llama", "--target", "onnx", "--max-cache-len", "1"], ["--max-cache-len 1 is too short for --target onnx",
                                                                      "give --max-cache-len 3 or more"]),
        (["tiny-llama", "--target", "onnx", "--max-cache-len", "2"], ["--max-cache-len 2 is too short for --target onnx"]),
        (["some-org/not-cached-model", "--offline"], ["not (completely) in the local Hugging Face cache", "--offline forbids"]),
        (["./no/such/model"], ["'./no/such/model' not found"]),
        (["tiny-llama", "--target", "onnx", "--dtype", "bfloat16", "--kv-cache", "int8"],
         ["--dtype bfloat16 for --target onnx (an artifact for the GPU) goes with --kv-cache float", "--dtype float32 or float16"]),
    ],
    ids=[
        "unknown-name",
        "unknown-target",
        "unknown-dtype",
        "cache-len-zero",
        "cache-len-negative",
        "cache-len-above-max-positions",
        "prefill-chunk-zero",
        "prefill-chunk-above-cache",
        "prefill-chunk-2-on-executorch",
        "cache-len-1-on-onnx",
        "cache-len-2-on-onnx",
        "hub-id-offline-not-cached",
        "missing-path",
        "gpu-dtype-with-int8-kv",
    ],
)
def test_export_mistakes_get_one_line(tmp_path, capsys, args, phrases):
    code, _, err = run_cli(capsys, *args, "-o", tmp_path / "out")
    assert_one_line_error(code, err, *phrases)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "args, phrases",
    [
        (["tiny-llama", "--max-cache-len", "lots"], ["Invalid value for '--max-cache-len'", "valid integer"]),
        (["tiny-llama", "--bogus"], ["No such option: --bogus", "see `kvexport export --help`"]),
        (["run"], ["required", "DIR|ARCHIVE", "see `kvexport run --help`"]),
        (["check", "--device"], ["'--device' requires an argument"]),
        (["run", "x", "-p", "hi", "--seed", "-3"], ["seed must be >= 0, got -3"]),
        (["run", "x", "-p", "hi", "--temperature", "nan"], ["temperature must be a finite number >= 0"]),
        (["run", "x", "-p", "hi", "--temperature", "inf"], ["temperature must be a finite number >= 0"]),
        (["run", "x", "-p", "hi", "--top-p", "nan"], ["top-p must be in (0, 1]"]),
        (["run", "x", "-p", "hi", "--bogus"], ["unrecognized arguments: --bogus", "see `kvexport run --help`"]),
    ],
    ids=["not-an-integer", "unknown-option", "missing-argument", "option-without-value", "negative-seed",
         "nan-temperature", "infinite-temperature", "nan-top-p", "unknown-run-option"],
)
def test_usage_errors_get_one_line(tmp_path, capsys, monkeypatch, args, phrases):
    monkeypatch.chdir(tmp_path)
    code, _, err = run_cli(capsys, *args)
    assert_one_line_error(code, err, *phrases)
    assert list(tmp_path.iterdir()) == []


def test_a_target_named_but_not_built_is_refused(tmp_path, capsys, monkeypatch):
    import importlib

    import_module = importlib.import_module

    def without_onnx(name, *args):  # an installation without the onnx target's subpackage
        if name == "kvexport.exporter.onnx":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return import_module(name, *args)

    monkeypatch.setattr(importlib, "import_module", without_onnx)
    code, _, err = run_cli(capsys, "tiny-llama", "--target", "onnx", "-o", tmp_path / "out")
    assert_one_line_error(code, err, "target 'onnx' is not built", "--target executorch")
    assert list(tmp_path.iterdir()) == []


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
    """tiny-llama saved as a plain Hugging Face folder (config.json, model.safetensors, tokenizer)."""
    from kvexport.models.presets import build_preset

    folder = tmp_path_factory.mktemp("hf") / "tiny-llama"
    model, tokenizer = build_preset("tiny-llama")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def _truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _bad_json(path):
    path.write_text('{"model_type": "llama",')


def _without_num_hidden_layers(folder):
    """A config.json that does not say its layer count: transformers' default (32) is not the
    checkpoint's 2."""
    config = json.loads((folder / "config.json").read_text())
    del config["num_hidden_layers"]
    (folder / "config.json").write_text(json.dumps(config))


def _edit_weights(change):
    def damage(folder):
        from safetensors.torch import load_file, save_file

        weights = load_file(folder / "model.safetensors")
        change(weights)
        save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})

    return damage


@pytest.mark.parametrize(
    "damage, phrases",
    [
        (lambda f: _truncate(f / "model.safetensors"), ["cannot load the weights", "truncated or corrupt", "fetch the model again"]),
        (lambda f: (f / "model.safetensors").write_bytes(b"\0" * 64), ["cannot load the weights", "corrupt"]),
        (lambda f: (f / "model.safetensors").unlink(), ["cannot load the weights", "missing"]),
        (lambda f: _bad_json(f / "config.json"), ["config.json is not a readable JSON file", "repair it"]),
        (
            lambda f: (f / "config.json").write_text(json.dumps({"model_type": "frobnicator"})),
            ["'frobnicator' model, an architecture transformers", "does not know"],
        ),
        (lambda f: (f / "tokenizer.json").unlink(), ["no usable tokenizer", "tokenizer.json"]),
        # Weights the checkpoint does not hold are refused, not made up (nor dropped, nor reshaped).
        (_without_num_hidden_layers, ["its weights lack model.layers.2.input_layernorm.weight and 269 more weights",
                                      "num_hidden_layers"]),
        (_edit_weights(lambda w: w.pop("model.layers.1.mlp.up_proj.weight")),
         ["its weights lack model.layers.1.mlp.up_proj.weight, which its config asks for", "fix the config"]),
        (_edit_weights(lambda w: w.update({"model.layers.2.mlp.up_proj.weight": torch.zeros(128, 64)})),
         ["its weights hold model.layers.2.mlp.up_proj.weight, for which its config has no place"]),
        (_edit_weights(lambda w: w.update({"model.layers.0.self_attn.q_proj.weight": torch.zeros(64, 32)})),
         ["its weights hold model.layers.0.self_attn.q_proj.weight as [64, 32], where its config asks for [64, 64]"]),
    ],
    ids=["truncated-safetensors", "garbage-safetensors", "no-weights", "config-not-json", "unknown-model-type", "no-tokenizer",
         "config-without-num-hidden-layers", "missing-weight", "unexpected-weight", "mis-shaped-weight"],
)
def test_a_broken_model_folder_gets_one_line(saved_model, tmp_path, capsys, damage, phrases):
    folder = tmp_path / "model"
    shutil.copytree(saved_model, folder)
    damage(folder)
    before = snapshot(tmp_path)
    code, _, err = run_cli(capsys, folder, "-o", tmp_path / "out", "--max-cache-len", "16")
    assert_one_line_error(code, err, *phrases)
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize(
    "content, phrases",
    [
        (os.urandom(4096), ["as a GGUF model", "GGUF magic", "fetch it again"]),
        (b"", ["as a GGUF model", "empty file"]),
        (b"GGUF\x03\x00\x00\x00" + b"\x05" * 20, ["as a GGUF model", "truncated"]),  # a header cut short
    ],
    ids=["garbage", "empty", "truncated-header"],
)
def test_a_corrupt_gguf_gets_one_line(tmp_path, capsys, content, phrases):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(content)
    code, _, err = run_cli(capsys, gguf, "-o", tmp_path / "out")
    assert_one_line_error(code, err, *phrases)
    assert [p.name for p in tmp_path.iterdir()] == ["model.gguf"]


@pytest.mark.parametrize(
    "gguf, phrases",
    [
        (dict(block_count=3), ["its weights lack model.layers.2.input_layernorm.weight and 8 more weights"]),
        (dict(extra={"blk.2.ffn_up.weight": (128, 64)}), ["its weights hold blk.2.ffn_up.weight, for which its config has no place"]),
        (dict(shapes={"blk.0.ffn_up.weight": (128, 32)}), ["its weights hold model.layers.0.mlp.up_proj.weight as [128, 32]"]),
    ],
    ids=["block-count-above-its-tensors", "a-tensor-too-many", "a-tensor-of-another-shape"],
)
def test_a_gguf_whose_weights_disagree_with_its_metadata_gets_one_line(tmp_path, capsys, monkeypatch, gguf, phrases):
    """A GGUF's weights are checked as a folder's are, before its conversion is kept in the cache."""
    monkeypatch.setenv("KVEXPORT_CACHE", str(tmp_path / "cache"))
    (tmp_path / "in").mkdir()
    write_tiny_gguf(tmp_path / "in" / "model.gguf", **gguf)
    code, _, err = run_cli(capsys, tmp_path / "in" / "model.gguf", "-o", tmp_path / "out", "--max-cache-len", "16")
    assert_one_line_error(code, err, *phrases, "fix the config or fetch the model again")
    assert [p.name for p in tmp_path.iterdir()] == ["in"]


def test_a_whole_tiny_gguf_loads_with_no_weight_made_up(tmp_path):
    """The same check passes a GGUF whose tensors are all its metadata describes."""
    from kvexport.models import sources

    source = sources.resolve(str(write_tiny_gguf(tmp_path / "model.gguf")))
    model, _ = sources.load_model(source, cache_dir=tmp_path / "cache")
    assert model.config.num_hidden_layers == 2


def test_a_file_that_is_not_gguf_gets_one_line(tmp_path, capsys):
    (tmp_path / "model.bin").write_bytes(b"weights")
    code, _, err = run_cli(capsys, tmp_path / "model.bin", "-o", tmp_path / "out")
    assert_one_line_error(code, err, "not a .gguf", "give a .gguf file or a model folder")
    assert [p.name for p in tmp_path.iterdir()] == ["model.bin"]


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

    def the_folder_and_its_temporaries() -> tuple:
        # Not the whole parent: other test workers export their own artifacts into it meanwhile.
        return snapshot(folder), sorted(p.name for p in folder.parent.glob(f".{folder.name}.*"))

    before = the_folder_and_its_temporaries()
    code, _, err = run_cli(capsys, "tiny-gemma3", "-o", folder)
    assert_one_line_error(code, err, "already exists", "--force")
    assert the_folder_and_its_temporaries() == before


def _file(tmp_path):
    (tmp_path / "a-file").write_text("not a folder")
    return tmp_path / "a-file"


def _other_folder(tmp_path):
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("keep me")
    return tmp_path / "notes"


@pytest.mark.parametrize(
    "make_out, force, phrases",
    [
        (_file, False, ["already exists", "--force"]),
        (_file, True, ["exists and is not a folder", "choose another -o"]),
        (lambda t: _file(t) / "out", False, ["a-file is a file, not a folder", "choose another -o"]),
        (lambda t: _file(t) / "deeper" / "out", False, ["a-file is a file, not a folder"]),
        # --force deletes the old folder: never one kvexport did not write.
        (_other_folder, True, ["not a kvexport artifact", "choose another -o"]),
    ],
    ids=["file", "file-force", "parent-is-a-file", "ancestor-is-a-file", "force-on-a-foreign-folder"],
)
def test_an_output_that_cannot_or_must_not_be_written_is_refused(tmp_path, capsys, make_out, force, phrases):
    out = make_out(tmp_path)
    before = snapshot(tmp_path)
    code, _, err = run_cli(capsys, "tiny-llama", "-o", out, *(["--force"] if force else []))
    assert_one_line_error(code, err, *phrases)
    assert snapshot(tmp_path) == before


def test_an_unwritable_output_is_refused_before_loading(capsys, monkeypatch):
    # Tests run as root, for whom permission bits and os.access say yes everywhere. The kernel still
    # refuses new folders in sysfs (EPERM as root on a read-write /sys, EROFS where /sys is mounted
    # read-only as in containers, EACCES for other users): a real unwritable place for anyone.
    from kvexport.exporter import pipeline

    monkeypatch.setattr(pipeline.sources, "load_model", lambda *a, **k: pytest.fail("loaded the model"))
    code, _, err = run_cli(capsys, "tiny-llama", "-o", "/sys/kvexport-out")
    assert_one_line_error(code, err, "cannot write /sys/kvexport-out", "refuses new folders", "choose another -o")
    assert not os.path.exists("/sys/kvexport-out")


ONE_ROW_MATRIX = '[[row]]\nmodel = "tiny-llama"\n'


# An output each command cannot write, and the line that says so before any work: (arguments, given
# tmp_path with a-file, a file, and empty/, an empty folder; phrases). Before, each failed with a
# traceback after the work (a matrix's rows, a benchmark, an export, a GGUF's conversion), and
# `-o . --force` in an empty folder replaced the working folder with the artifact, then failed.
UNWRITABLE_OUTPUTS = {
    "matrix-report": (lambda t: ["matrix", t / "m.toml", "--report", "/sys/kvexport-report.md"],
                      ["cannot write /sys/kvexport-report.md: /sys refuses new files", "choose another --report"]),
    "matrix-json-a-folder": (lambda t: ["matrix", t / "m.toml", "--json", t / "empty"],
                             ["--json", "empty is a folder; --json names a file to write"]),
    "matrix-work-dir": (lambda t: ["matrix", t / "m.toml", "--work-dir", t / "a-file" / "work"],
                        ["a-file is a file, not a folder", "choose another --work-dir"]),
    "matrix-work-dir-a-file": (lambda t: ["matrix", t / "m.toml", "--work-dir", t / "a-file"],
                               ["cannot write in", "a-file: it is a file, not a folder", "choose another --work-dir"]),
    "bench-json": (lambda t: ["bench", "tiny-llama", t / "empty", "--json", "/sys/kvexport-bench.json"],
                   ["cannot write /sys/kvexport-bench.json: /sys refuses new files", "choose another --json"]),
    "bench-markdown": (lambda t: ["bench", "tiny-llama", t / "empty", "--markdown", t / "a-file" / "b.md"],
                       ["a-file is a file, not a folder", "choose another --markdown"]),
    "export-profile": (lambda t: ["tiny-llama", "-o", t / "out", "--profile", "/sys/kvexport-profile.txt"],
                       ["cannot write /sys/kvexport-profile.txt: /sys refuses new files", "choose another --profile"]),
    "export-profile-beside": (lambda t: ["tiny-llama", "-o", t / "out", "--profile", t / "empty" / "p.txt"],
                              ["p.txt.prof", "is a folder"]),
    "kvexport-cache": (lambda t: [write_tiny_gguf(t / "empty" / "model.gguf"), "-o", t / "out"],
                       ["cannot write", "a-file/gguf: ", "a-file is a file, not a folder", "set KVEXPORT_CACHE to a folder"]),
    "export-to-the-working-folder": (lambda t: ["tiny-llama", "-o", ".", "--force"],
                                     ["output . is the working folder, which the artifact folder would replace",
                                      "choose -o NAME, a new folder"]),
    "export-to-empty-output": (lambda t: ["tiny-llama", "-o", "", "--force"], ["output . is the working folder"]),
    "export-to-a-folder-above": (lambda t: ["tiny-llama", "-o", t, "--force"],
                                 ["is a folder that holds the working folder", "choose -o NAME"]),
}


@pytest.mark.parametrize("case", list(UNWRITABLE_OUTPUTS))
def test_an_output_that_cannot_be_written_is_refused_before_any_work(tmp_path, capsys, monkeypatch, case):
    from kvexport.bench import bench
    from kvexport.exporter import pipeline
    from kvexport.cli import matrix as command

    make_args, phrases = UNWRITABLE_OUTPUTS[case]
    (tmp_path / "m.toml").write_text(ONE_ROW_MATRIX)
    _file(tmp_path)
    (tmp_path / "empty").mkdir()
    if case == "export-profile-beside":
        (tmp_path / "empty" / "p.txt.prof").mkdir()
    args = make_args(tmp_path)  # a GGUF written first: its conversion is what must not start
    monkeypatch.setenv("KVEXPORT_CACHE", str(tmp_path / "a-file"))
    monkeypatch.chdir(tmp_path / "empty")
    monkeypatch.setattr(command, "run_rows", lambda *a, **k: pytest.fail("ran the matrix's rows"))
    monkeypatch.setattr(bench, "exact_prompt", lambda *a, **k: pytest.fail("started the benchmark"))
    monkeypatch.setattr(pipeline.sources, "load_model", lambda *a, **k: pytest.fail("loaded the model"))
    before = snapshot(tmp_path)
    code, _, err = run_cli(capsys, *args)
    assert_one_line_error(code, err, *phrases)
    assert snapshot(tmp_path) == before


def test_run_json_fields(artifact, capsys):
    code, out, _ = run_cli(capsys, "run", artifact("tiny-gemma3"), "--prompt", "Hello", "--max-new-tokens", "5", "--ignore-eos", "--json")
    assert code == 0
    result = json.loads(out)
    assert {"prompt_ids", "new_ids", "text", "prefill_tokens_per_s", "decode_tokens_per_s"} <= set(result)
    assert len(result["new_ids"]) == 5 and result["prompt_ids"][0] == 96  # <bos>


@pytest.mark.parametrize("command", ["run", "check"])
@pytest.mark.parametrize(
    "prompt, extra, phrases",
    [
        ("x" * 80, [], ["longer than the artifact's max_cache_len 64", "re-export with a larger --max-cache-len"]),
        ("Hello", ["--max-new-tokens", "100"], ["exceeds the artifact's max_cache_len 64", "at most 59"]),
        ("", [], ["prompt is empty", "give some text"]),
        ("Hello", ["--max-new-tokens", "0"], ["--max-new-tokens must be at least 1"]),
        # A command line's bytes that are not UTF-8, as Python decodes them (surrogateescape).
        ("ab\udcffcd", [], ["the text is not valid UTF-8 (the byte 0xff at character 2)"]),
    ],
    ids=["prompt-longer-than-cache", "prompt-plus-new-tokens-beyond-cache", "empty-prompt", "zero-new-tokens",
         "prompt-not-utf8"],
)
def test_run_and_check_refuse_what_cannot_fit(artifact, capsys, command, prompt, extra, phrases, monkeypatch):
    from kvexport.checker import check
    from kvexport.runtime import run

    # Refused before anything runs: loading the program would already be too late.
    monkeypatch.setattr(run, "load_program", lambda *a, **k: pytest.fail("loaded the program"))
    monkeypatch.setattr(check, "load_program", lambda *a, **k: pytest.fail("loaded the program"))
    code, out, err = run_cli(capsys, command, artifact("tiny-gemma3"), "--prompt", prompt, *extra)
    assert_one_line_error(code, err, *phrases)
    assert out == "" and len(err.strip().splitlines()) == 1, err


def test_check_s_own_prompts_in_a_cache_that_holds_none_are_refused_in_one_line(artifact, tmp_path, capsys, monkeypatch):
    """A cache of one position holds no text prompt of a tokenizer that adds BOS: check says so, as
    run would of any prompt (tests/exporter/test_sizes.py: shorter caches get shorter prompts)."""
    from kvexport.checker import check

    monkeypatch.setattr(check, "load_program", lambda *a, **k: pytest.fail("loaded the program"))
    folder = tmp_path / "one-position"
    shutil.copytree(artifact("tiny-llama"), folder)
    edit_manifest(lambda m: (m.update(max_cache_len=1), m["interface"].update(max_tokens_per_call=1)))(folder)
    code, _, err = run_cli(capsys, "check", folder)
    assert_one_line_error(code, err, "max_cache_len 1 holds none of check's prompts: even 'T' is 2 tokens",
                          "re-export with a larger --max-cache-len")


def test_run_on_a_folder_that_is_not_an_artifact(tmp_path, capsys):
    code, _, err = run_cli(capsys, "run", tmp_path, "--prompt", "hi")
    assert_one_line_error(code, err, "no kvexport.json")


def _flip_a_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


DAMAGED_ARTIFACTS = {
    "no-manifest": (lambda f: (f / "kvexport.json").unlink(), ["has no kvexport.json", "re-run kvexport export"]),
    "manifest-not-json": (lambda f: (f / "kvexport.json").write_text("{"), ["is not valid JSON"]),
    "foreign-manifest": (edit_manifest(lambda m: m.update(format="other-tool")), ["is not a kvexport manifest"]),
    "foreign-version": (
        edit_manifest(lambda m: m.update(format_version=7)),
        ["has format version 7, this kvexport reads 1 or 2 or 3 or 4 or 5 or 6 for executorch artifacts", "re-export"],
    ),
    "manifest-changed": (
        edit_manifest(lambda m: m.update(max_cache_len=m["max_cache_len"] + 1), update_its_sum=False),
        ["kvexport.json does not match kvexport.json.sha256", "copy the artifact again or re-run kvexport export"],
    ),
    "field-of-wrong-type": (
        edit_manifest(lambda m: m.update(max_cache_len="64")),
        ["'max_cache_len' should be a positive integer, not \"64\"", "re-run kvexport export"],
    ),
    "files-of-wrong-type": (edit_manifest(lambda m: m.update(files=["model.pte"])), ["'files' should be"]),
    "program-not-listed": (
        edit_manifest(lambda m: m["files"].pop("model.pte")),
        ["does not list its program file model.pte"],
    ),
    "weights-not-listed": (
        edit_manifest(lambda m: m["files"].pop("model.ptd")),
        ["does not list its weights file model.ptd"],
    ),
    "listed-file-missing": (lambda f: (f / "tokenizer.json").unlink(), ["is missing tokenizer.json, listed in kvexport.json"]),
    "program-sha256-mismatch": (lambda f: _flip_a_byte(f / "model.pte"), ["model.pte does not match the sha256"]),
    "weights-sha256-mismatch": (lambda f: _flip_a_byte(f / "model.ptd"), ["model.ptd does not match the sha256"]),
}


@pytest.mark.parametrize("command", ["run", "check"])
@pytest.mark.parametrize("case", list(DAMAGED_ARTIFACTS))
def test_run_and_check_refuse_a_damaged_artifact(artifact, tmp_path, capsys, command, case):
    damage, phrases = DAMAGED_ARTIFACTS[case]
    folder = tmp_path / "copy"
    shutil.copytree(artifact("tiny-gemma3"), folder)
    damage(folder)
    before = snapshot(tmp_path)
    code, out, err = run_cli(capsys, command, folder, "--prompt", "hi")
    assert_one_line_error(code, err, *phrases)
    assert out == "" and snapshot(tmp_path) == before


def test_run_without_a_limit_stops_when_the_cache_is_full(artifact, capsys):
    """No --max-new-tokens and no EOS: it fills the cache, stops and says so; every token is still
    eager transformers' greedy token (nothing wraps around)."""
    from kvexport.models.presets import build_preset

    from tests.conftest import TEST_CACHE_LEN
    from tests.helpers import eager_ids

    folder = artifact("tiny-gemma3")
    # "Hi": no near-tie on its 62-token greedy path ("Hello" has one, margin 2e-4, at new token 2).
    code, out, err = run_cli(capsys, "run", folder, "--prompt", "Hi", "--ignore-eos", "--json")
    assert code == 0, err
    result = json.loads(out)
    prompt_len = len(result["prompt_ids"])
    assert result["stopped_by"] == "max_cache_len"
    # Positions 0..63 hold the prompt and all new tokens but the last (never fed back).
    assert len(result["new_ids"]) == TEST_CACHE_LEN - prompt_len + 1
    model, _ = build_preset("tiny-gemma3")
    assert result["new_ids"] == eager_ids(model, result["prompt_ids"], len(result["new_ids"]))

    code, _, err = run_cli(capsys, "run", folder, "--prompt", "Hi", "--ignore-eos")
    assert code == 0 and f"stopped: the cache is full ({TEST_CACHE_LEN} positions)" in err


def test_a_model_that_overflows_in_float16_is_refused_before_export(tmp_path, capsys):
    from kvexport.models.presets import build_preset

    # Logits ~1e4 times the preset's pass float16's 65,504, as Gemma 3's residual stream does.
    model, tokenizer = build_preset("tiny-llama")
    model.lm_head.weight.data *= 1e4
    folder = tmp_path / "loud-llama"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    out = tmp_path / "out"
    code, _, err = run_cli(capsys, folder, "--target", "onnx", "--dtype", "float16", "-o", out)
    assert_one_line_error(code, err, "--dtype float16: the model overflows in float16", "export it in float32")
    assert not out.exists()
    code, _, err = run_cli(capsys, folder, "--target", "onnx", "-o", out, "--max-cache-len", "16", "--quiet")
    assert code == 0, err  # float32 takes it


def test_a_mistyped_model_is_refused_before_torch_is_imported():
    script = (
        "import sys\nfrom kvexport.cli import main\n"
        "try:\n    main(['export', './no/such/model', '--target', 'onnx'])\n"
        "except SystemExit as e:\n    print(e.code, 'torch' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.stdout.split() == ["2", "False"], done.stderr
    assert_one_line_error(2, done.stderr, "model './no/such/model' not found")


@pytest.mark.parametrize("verbose", [False, True], ids=["quiet", "verbose"])
def test_executorch_s_native_log_lines_show_only_with_verbose(artifact, verbose):
    command = [sys.executable, "-m", "kvexport.cli", "run", str(artifact("tiny-llama")), "-p", "Hi", "--max-new-tokens", "2"]
    done = subprocess.run(command + (["--verbose"] if verbose else []), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert ("cpuinfo_utils.cpp" in done.stderr) == verbose, done.stderr
    if not verbose:
        assert done.stderr.strip().splitlines()[-1].startswith("[3 prompt tokens, 2 new;"), done.stderr


def test_profile_writes_where_the_export_spent_its_time(tmp_path, capsys):
    report = tmp_path / "profile.txt"
    code, _, err = run_cli(capsys, "tiny-llama", "--target", "onnx", "-o", tmp_path / "out", "--max-cache-len", "16",
                           "--quiet", "--profile", report)
    assert code == 0, err
    text = report.read_text()
    assert "by cumulative time" in text and "by own time" in text
    assert "export_model" in text and "lower" in text  # the pipeline's steps, by name
    assert (tmp_path / "profile.txt.prof").stat().st_size > 0


def _replace_listed_file(name, data: bytes):
    """Replace a listed file and rewrite its entry and the sums, as a tool that knows the format would:
    what is tested is the file itself."""
    from kvexport.artifact.manifest import sha256_file

    def damage(folder):
        (folder / name).write_bytes(data)
        entry = {"sha256": sha256_file(folder / name), "bytes": len(data)}
        edit_manifest(lambda m: m["files"][name].update(entry))(folder)

    return damage


def _link_outside(name):
    """The listed file as a symlink to a copy of itself outside the folder (same bytes: only the link is wrong)."""

    def damage(folder):
        outside = folder.parent / f"outside-{name}"
        shutil.move(folder / name, outside)
        (folder / name).symlink_to(outside)

    return damage


def _drop_input(name):
    return edit_manifest(lambda m: m["interface"].update(inputs=[i for i in m["interface"]["inputs"] if i["name"] != name]))


# A manifest edited (its sums rewritten) so that it no longer describes its program, or its files:
# (artifact's target, damage, phrases). Before, each ended in a traceback or, for a negative
# max_tokens_per_call, in all-zero token ids and exit 0.
MISLEADING_ARTIFACTS = {
    "onnx-tokens-per-call-negative": ("onnx", edit_manifest(lambda m: m["interface"].update(max_tokens_per_call=-1)),
                                      ["'interface.max_tokens_per_call' should be a positive integer at most max_cache_len (64), not -1"]),
    "onnx-cache-len-above-the-program-s": ("onnx", edit_manifest(lambda m: m.update(max_cache_len=128)),
                                           ["kvexport.json says max_cache_len 128 but the program has 64 (genai_config.json's context_length)", "re-export"]),
    # Larger than the program's: a smaller one is refused first by the tokenizer, whose ids pass it.
    "onnx-vocab-size": ("onnx", edit_manifest(lambda m: m.update(vocab_size=150)),
                        ["kvexport.json says (by its vocab_size) logits is [1, 1, 150] but the program has [1, 1, 100]"]),
    "onnx-kv-heads": ("onnx", edit_manifest(lambda m: m["layers"][0].update(kv_heads=2)),
                      ["past_key_values.0.key is [1, 2, 6, 16] but the program has [1, 1, 'window_rows', 16]"]),
    "onnx-window": ("onnx", edit_manifest(lambda m: m["layers"][0].update(window=8)),
                    ["kvexport.json says windows [8] but the program has [6] (genai_config.json's sliding_window.window_size)"]),
    "onnx-sliding-layers": ("onnx", edit_manifest(lambda m: m["layers"][0].update(cache="static", window=None)),
                            ["kvexport.json says the sliding layers [] but the program has [0] (genai_config.json's sliding_window.layers)"]),
    "onnx-a-layer-less": ("onnx", edit_manifest(lambda m: m["layers"].pop()),
                          ["kvexport.json says the model has 1 layers but the program has 2"]),
    "onnx-dtype": ("onnx", edit_manifest(lambda m: m.update(dtype="float16")),
                   ["kvexport.json says its dtype is float16 but the program has logits of tensor(float)"]),
    "onnx-inputs": ("onnx", _drop_input("attention_mask"), ["kvexport.json says the graph's inputs are"]),
    "onnx-no-external-data": ("onnx", edit_manifest(lambda m: m.pop("external_data")),
                              ["kvexport.json lacks external_data, which an ONNX artifact has"]),
    "executorch-cache-len": ("executorch", edit_manifest(lambda m: m.update(max_cache_len=128)),
                             ["kvexport.json says max_cache_len 128 but the program has 64 (get_max_context_len)", "re-export"]),
    "executorch-vocab-size": ("executorch", edit_manifest(lambda m: m.update(vocab_size=150)),
                              ["kvexport.json says vocab_size 150 but the program has 100 (get_vocab_size)"]),
    "executorch-a-layer-less": ("executorch", edit_manifest(lambda m: m["layers"].pop()),
                                ["kvexport.json says the number of layers is 1 but the program has 2 (get_n_layers)"]),
    "executorch-tokens-per-call": ("executorch", edit_manifest(lambda m: m["interface"].update(max_tokens_per_call=32)),
                                   ["says interface.max_tokens_per_call 32 but the program has 64 (get_max_seq_len)"]),
    "executorch-dtype": ("executorch", edit_manifest(lambda m: m.update(dtype="float16")),
                         ["kvexport.json says dtype float16 but the program has float32 logits"]),
    "executorch-eos": ("executorch", edit_manifest(lambda m: m.update(eos_token_ids=[3])),
                       ["kvexport.json says eos_token_ids 3 but the program has 97 (get_eos_ids)"]),
    "unknown-source-kind": ("executorch", edit_manifest(lambda m: m["source"].update(kind="website")),
                            ["'source.kind' should be 'preset' or 'alias' or 'folder' or 'gguf' or 'hub', not \"website\""]),
    "tokenizer-not-listed": ("executorch", edit_manifest(lambda m: m["files"].pop("tokenizer.json")),
                             ["kvexport.json does not list tokenizer.json among its files"]),
    "tokenizer-corrupt": ("executorch", _replace_listed_file("tokenizer.json", b'{"model": 1}'),
                          ["tokenizer.json is not a tokenizer the tokenizers library reads ("]),
    "tokenizer-not-utf8": ("executorch", _replace_listed_file("tokenizer.json", b"\xff\xfe"),
                           ["tokenizer.json is not UTF-8 text"]),
    "tokenizer-config-corrupt": ("executorch", _replace_listed_file("tokenizer_config.json", b"{"),
                                 ["tokenizer_config.json is not valid JSON ("]),
    "tokenizer-a-link-outside": ("executorch", _link_outside("tokenizer.json"),
                                 ["tokenizer.json is a symbolic link; an artifact's files must be regular files inside its folder"]),
}


@pytest.mark.parametrize("command", ["run", "check"])
@pytest.mark.parametrize("case", list(MISLEADING_ARTIFACTS))
def test_run_and_check_refuse_a_manifest_that_does_not_describe_the_artifact(artifact, tmp_path, capsys, monkeypatch,
                                                                             command, case):
    from kvexport.checker import check

    target, damage, phrases = MISLEADING_ARTIFACTS[case]
    monkeypatch.setattr(check, "load_reference", lambda *a, **k: pytest.fail("loaded the eager model"))
    folder = tmp_path / "copy"
    shutil.copytree(artifact("tiny-gemma3", target), folder)
    damage(folder)
    before = snapshot(tmp_path)
    code, out, err = run_cli(capsys, command, folder, "--prompt", "hi", "--max-new-tokens", "4")
    assert_one_line_error(code, err, *phrases)
    assert out == "" and snapshot(tmp_path) == before


def _edit_listed_json(name, change):
    """Edit a listed JSON file with ``change(data)`` and rewrite its entry and the sums."""

    def damage(folder):
        data = json.loads((folder / name).read_text())
        change(data)
        _replace_listed_file(name, json.dumps(data).encode())(folder)

    return damage


def _a_token_past_the_vocabulary(tokenizer):
    tokenizer["added_tokens"].append({"id": 100, "content": "zq", "single_word": False, "lstrip": False, "rstrip": False,
                                      "normalized": False, "special": False})


# A file a runtime reads, edited to disagree with the manifest that vouches for it, its sums rewritten:
# (target, damage, phrases). Before, the tokenizer's id past the program's 100 rows ended in ONNX
# Runtime's traceback (Gather: indices element out of data bounds), and genai_config.json's vocab_size
# in genai's ("eos_token_id (97) must be in range [0, 50)"), its input names in a missing-input
# traceback, its EOS ran silently with another stop token.
VOUCHED_FILES_EDITED = {
    "tokenizer-id-past-the-vocabulary": ("onnx", _edit_listed_json("tokenizer.json", _a_token_past_the_vocabulary),
                                         ["tokenizer.json gives token id 100, outside the vocabulary of 100 tokens kvexport.json says the program has"]),
    "tokenizer-bos-past-the-vocabulary": (
        "executorch", _edit_listed_json("tokenizer.json", lambda t: t["post_processor"]["special_tokens"]["<bos>"].update(ids=[120])),
        ["tokenizer.json gives token id 120, outside the vocabulary of 100 tokens", "re-run kvexport export"]),
    "genai-vocab-size": ("onnx", _edit_listed_json("genai_config.json", lambda c: c["model"].update(vocab_size=50)),
                         ["kvexport.json says vocab_size 100 but the program has 50 (genai_config.json's vocab_size)"]),
    "genai-layer-count": ("onnx", _edit_listed_json("genai_config.json", lambda c: c["model"]["decoder"].update(num_hidden_layers=1)),
                          ["says layers with a cache 2 but the program has 1 (genai_config.json's num_hidden_layers)"]),
    "genai-input-names": (
        "onnx", _edit_listed_json("genai_config.json", lambda c: c["model"]["decoder"]["inputs"].update(past_key_names="past.%d.k")),
        ["says the graph's inputs include past_key_values.0.key, past_key_values.1.key but the program has past.0.k, past.1.k "
         "(genai_config.json's decoder.inputs)"]),
    "genai-eos": ("onnx", _edit_listed_json("genai_config.json", lambda c: c["model"].update(eos_token_id=5)),
                  ["says eos_token_ids [97] but the program has [5] (genai_config.json's eos_token_id)"]),
    "genai-max-length": ("onnx", _edit_listed_json("genai_config.json", lambda c: c["search"].update(max_length=32)),
                         ["says max_cache_len 64 but the program has 32 (genai_config.json's search.max_length)"]),
}


@pytest.mark.parametrize(
    "case, runner",
    [(case, runner) for case, (target, _, _) in VOUCHED_FILES_EDITED.items()
     for runner in ("kvexport", "genai") if runner == "kvexport" or target == "onnx"],
    ids=lambda value: value,
)
def test_a_file_that_disagrees_with_the_manifest_is_refused_in_one_line(artifact, tmp_path, capsys, case, runner):
    target, damage, phrases = VOUCHED_FILES_EDITED[case]
    folder = tmp_path / "copy"
    shutil.copytree(artifact("tiny-gemma3", target), folder)
    damage(folder)
    before = snapshot(tmp_path)
    code, out, err = run_cli(capsys, "run", folder, "--prompt", "zq hi", "--max-new-tokens", "4", "--runner", runner)
    assert_one_line_error(code, err, *phrases)
    assert out == "" and snapshot(tmp_path) == before


def test_an_unlisted_chat_template_is_not_read(artifact, tmp_path, capsys):
    """Only the files kvexport.json lists (and verifies) are read: a chat_template.jinja dropped in
    beside them, or left there unlisted, is not the model's template."""
    folder = tmp_path / "copy"
    shutil.copytree(artifact("tiny-gemma3", "onnx"), folder)
    edit_manifest(lambda m: m["files"].pop("chat_template.jinja"))(folder)
    (folder / "chat_template.jinja").write_text("{{ raise_exception('an unlisted template ran') }}")
    code, _, err = run_cli(capsys, "run", folder, "--prompt", "hi", "--chat", "--max-new-tokens", "2")
    assert_one_line_error(code, err, "this model's tokenizer has no chat template")
    assert "unlisted" not in err
