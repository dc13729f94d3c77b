"""The Python API: the CLI's export, run and check as functions, the CLI's one-line errors as
``KvexportError`` (that an API export has the CLI's bytes: tests/exporter/test_determinism.py)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

import kvexport
from kvexport.artifact.archive import pack
from tests.conftest import NEW_TOKENS, PROMPT
from tests.helpers import on_one_worker, run_cli

README = Path(kvexport.__file__).resolve().parent.parent / "README.md"


def test_export_in_this_process_where_the_hash_seed_is_already_kvexport_s(artifact, tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONHASHSEED", kvexport.api.EXPORT_HASH_SEED)
    calls = []
    monkeypatch.setattr(kvexport.api, "_export_in_child", lambda *a: calls.append(a))
    made = kvexport.export("tiny-qwen3", "onnx", tmp_path / "here", max_cache_len=64, quiet=True)
    assert calls == [] and made.manifest.target == "onnx"
    assert made.generate(PROMPT, NEW_TOKENS, ignore_eos=True).new_ids == (
        kvexport.load(artifact("tiny-qwen3", "onnx")).generate(PROMPT, NEW_TOKENS, ignore_eos=True).new_ids
    )


@pytest.mark.parametrize("in_child", [True, False], ids=["child-process", "this-process"])
def test_a_user_error_is_a_kvexport_error_with_the_cli_s_line(tmp_path, monkeypatch, capsys, in_child):
    monkeypatch.setenv("PYTHONHASHSEED", "7" if in_child else kvexport.api.EXPORT_HASH_SEED)
    with pytest.raises(kvexport.KvexportError) as raised:
        kvexport.export("./no/such/model", "onnx", tmp_path / "out")
    code, _, err = run_cli(capsys, "export", "./no/such/model", "--target", "onnx", "-o", tmp_path / "out")
    assert f"kvexport: error: {raised.value}" == err.strip() and raised.value.exit_code == code == 2
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("model", ["--help", "-o", "--target"])
def test_a_model_name_that_looks_like_an_option_is_a_model_name(tmp_path, monkeypatch, model):
    """The API runs the CLI in a child process: whatever the string, it is the model's name there
    (issue 58, class 7: ``export("--help")`` ended in a JSONDecodeError)."""
    monkeypatch.setenv("PYTHONHASHSEED", "7")  # the child process
    with pytest.raises(kvexport.KvexportError, match=f"model '{model}' not found"):
        kvexport.export(model, "onnx", tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("target", ["executorch", "onnx"])
def test_generate_is_kvexport_run(artifact, capsys, target):
    folder = artifact("tiny-gemma3", target)
    code, out, err = run_cli(capsys, "run", folder, "-p", PROMPT, "--max-new-tokens", NEW_TOKENS, "--ignore-eos", "--json")
    assert code == 0, err
    expected = json.loads(out)
    got = kvexport.load(folder).generate(PROMPT, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    assert (got.prompt_ids, got.new_ids, got.text) == (expected["prompt_ids"], expected["new_ids"], expected["text"])
    assert got.decode_tokens_per_s > 0 and got.stopped_by == "max_new_tokens"


def test_load_takes_a_packed_archive_and_removes_its_copy_when_done(artifact, tmp_path):
    archive, _ = pack(artifact("tiny-llama", "onnx"), tmp_path / "tiny.tar")
    loaded = kvexport.load(archive)
    unpacked = loaded.folder
    assert unpacked.is_dir() and loaded.generate(PROMPT, max_new_tokens=4).new_ids
    del loaded
    assert not unpacked.exists()


def test_generate_refuses_bad_sampling_and_what_cannot_fit(artifact):
    loaded = kvexport.load(artifact("tiny-llama", "onnx"))
    with pytest.raises(kvexport.KvexportError, match="temperature must be a finite number"):
        loaded.generate(PROMPT, temperature=float("nan"))
    with pytest.raises(kvexport.KvexportError, match="exceeds the artifact's max_cache_len 64"):
        loaded.generate(PROMPT, max_new_tokens=100)


def test_chat_keeps_the_conversation_and_feeds_only_the_new_turn(artifact):
    conversation = kvexport.load(artifact("tiny-qwen3", "onnx")).chat(system="Hi", max_new_tokens=3)
    first = conversation.say("Hi")
    second = conversation.say("Yo")
    assert first.prefilled_tokens == len(first.prompt_ids)
    assert second.prompt_ids[: first.conversation_tokens] == conversation.ids[: first.conversation_tokens]
    assert second.prefilled_tokens == len(second.prompt_ids) - first.conversation_tokens and not second.reset


def test_check_reports_pass_and_each_prompt(artifact):
    report = kvexport.check(artifact("tiny-mistral", "onnx"), prompts=[PROMPT], max_new_tokens=NEW_TOKENS)
    assert report.passed and len(report.prompts) == 1
    assert report.prompts[0].match and report.prompts[0].new_tokens == NEW_TOKENS


def readme_python_example() -> str:
    text = README.read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert len(blocks) == 1, "the README has one Python example"
    return blocks[0]


@pytest.mark.slow
@on_one_worker("real-smollm2-135m-onnx")
def test_the_readme_s_python_example_runs_as_written(tmp_path, tmp_path_factory, monkeypatch):
    """The example as written. Its export, SmolLM2 to ONNX at 1024, is the one the real-model tests
    make once per run (the CLI's; the API gives the CLI's bytes: tests/exporter/test_determinism.py):
    copied where the example asks instead of made again. Any other export it asks for is made."""
    from tests.test_real_models import export_real

    made = export_real(tmp_path_factory, "smollm2-135m", "onnx")
    export = kvexport.export

    def export_or_copy(model, target="executorch", output=None, **options):
        if (model, target, options) != ("smollm2-135m", "onnx", {"max_cache_len": 1024, "max_draft_tokens": 8, "force": True}):
            return export(model, target, output, **options)
        shutil.copytree(made, output)
        return kvexport.load(output)

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(kvexport, "export", export_or_copy)
    exec(compile(readme_python_example(), "README.md", "exec"), {})
    assert (tmp_path / "smollm2-onnx" / "kvexport.json").read_bytes() == (made / "kvexport.json").read_bytes()


def test_kvexport_check_stays_the_function_once_the_checker_is_imported():
    """The subpackage is `checker`: a subpackage named `check` would replace the function on import."""
    import kvexport.checker.check  # noqa: F401

    assert kvexport.check is kvexport.api.check


def test_the_export_options_are_the_same_in_the_cli_the_api_the_pipeline_and_the_matrix():
    """An export option is declared once (ExportOptions' field: type, default, help text); the CLI's
    options and the API's keywords are written out, and adding one to either and not the other fails here."""
    import dataclasses
    import inspect

    import typer.main

    from kvexport.api import _export_argv
    from kvexport.cli import app
    from kvexport.exporter.pipeline import ExportOptions
    from kvexport.matrix.spec import ROW_KEYS

    command = typer.main.get_command(app).commands["export"]
    cli = {p.name: p for p in command.params}
    pipeline = {f.name for f in dataclasses.fields(ExportOptions)}
    api = set(inspect.signature(kvexport.export).parameters) - {"output"} | {"out"}
    assert set(cli) - {"as_json", "profile"} == pipeline | {"quiet"} == api, "CLI, API and ExportOptions differ"
    # The API runs the CLI in a child process: each keyword becomes a flag the CLI knows.
    flags = {flag for p in command.params for flag in p.opts}
    options = {name: "x" for name in api - {"model", "target", "out"}}
    argv = _export_argv("m", "onnx", None, options)
    assert {a for a in argv if a.startswith("--") and a != "--"} <= flags
    # A matrix row sets what shapes the artifact; where it comes from and how it is written are the row's.
    not_in_rows = {"out", "force", "revision", "offline", "gguf_file", "max_draft_tokens"}
    assert pipeline - not_in_rows <= set(ROW_KEYS)
    # Each option's help text and default are declared once, on its ExportOptions field.
    keywords = inspect.signature(kvexport.export).parameters
    for declared in dataclasses.fields(ExportOptions):
        assert cli[declared.name].help == declared.metadata["help"], declared.name
        if declared.name != "model":
            assert cli[declared.name].default == declared.default, declared.name
            assert keywords["output" if declared.name == "out" else declared.name].default == declared.default, declared.name
