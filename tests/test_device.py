"""python -m kvexport.device: kvexport run's generation on a device with no transformers (an ONNX
artifact: no torch either), from a folder or a kvexport pack archive."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvexport import device
from kvexport.artifact.archive import pack

from tests.conftest import NEW_TOKENS, PROMPT
from tests.helpers import assert_one_line_error, run_cli

# What a device that runs ONNX artifacts has installed besides the standard library (jinja2, and
# markupsafe under it, for --chat).
ONNX_DEVICE_PACKAGES = {"kvexport", "numpy", "onnxruntime", "tokenizers", "jinja2", "markupsafe"}

_RUN_DEVICE = """
import runpy, sys
allowed, blocked = {allowed!r}, {blocked!r}
class Device:
    def find_spec(self, name, path=None, target=None):
        top = name.split(".")[0]
        if top in blocked or name in blocked or (allowed and top not in allowed and top not in sys.stdlib_module_names):
            raise ModuleNotFoundError(f"{{name}} is not installed on this device", name=name)
sys.meta_path.insert(0, Device())
sys.argv[0] = "kvexport.device"
runpy.run_module("kvexport.device", run_name="__main__", alter_sys=True)
"""


def run_device(args, allowed=(), blocked=()) -> subprocess.CompletedProcess:
    """``python -m kvexport.device ARGS`` where only the ``allowed`` top-level packages (and the
    standard library) can be imported, or where the ``blocked`` ones (top-level packages or modules
    by their whole name) cannot."""
    script = _RUN_DEVICE.format(allowed=set(allowed), blocked=set(blocked))
    return subprocess.run(
        [sys.executable, "-c", script, *map(str, args)], capture_output=True, text=True, timeout=300
    )


def kvexport_run_json(capsys, folder, *args) -> dict:
    code, out, err = run_cli(capsys, "run", folder, *args, "--json")
    assert code == 0, err
    return json.loads(out)


@pytest.mark.parametrize("prompt, chat", [(PROMPT, []), ("Hi", ["--chat"])], ids=["plain", "chat"])
def test_onnx_runs_with_only_onnxruntime_numpy_tokenizers(artifact, capsys, prompt, chat):
    folder = artifact("tiny-qwen3", "onnx")
    args = [folder, "--prompt", prompt, "--max-new-tokens", NEW_TOKENS, "--ignore-eos", *chat, "--json"]
    done = run_device(args, allowed=ONNX_DEVICE_PACKAGES)
    assert done.returncode == 0, done.stderr
    expected = kvexport_run_json(capsys, folder, *args[1:-1])
    got = json.loads(done.stdout)
    assert (got["prompt_ids"], got["new_ids"], got["text"]) == (expected["prompt_ids"], expected["new_ids"], expected["text"])
    assert len(got["new_ids"]) == NEW_TOKENS and got["decode_tokens_per_s"] > 0


def test_the_import_guard_catches_torch(artifact):
    """The guard above is not vacuous: the export side of kvexport does need torch."""
    script = _RUN_DEVICE.format(allowed=ONNX_DEVICE_PACKAGES, blocked=set()).replace(
        'runpy.run_module("kvexport.device", run_name="__main__", alter_sys=True)', "import kvexport.exporter.decoder"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and "torch is not installed on this device" in done.stderr


def test_a_pte_runs_without_transformers_from_a_packed_archive(artifact, capsys, tmp_path):
    folder = artifact("tiny-gemma3")
    archive, _ = pack(folder, tmp_path / "tiny.tar")
    args = ["--prompt", PROMPT, "--max-new-tokens", NEW_TOKENS, "--ignore-eos", "--json"]
    done = run_device([archive, *args], blocked={"transformers", "typer", "rich", "click"})
    assert done.returncode == 0, done.stderr
    expected = kvexport_run_json(capsys, folder, *args[:-1])
    assert json.loads(done.stdout)["new_ids"] == expected["new_ids"]


def test_a_pte_runs_without_executorch_s_exporter(artifact, capsys):
    """ExecuTorch's Python runtime imports one file of its exporter's package (``executorch.exir``),
    whose ``__init__`` imports the whole export stack; kvexport's runner loads that file alone."""
    folder = artifact("tiny-llama")
    args = ["--prompt", PROMPT, "--max-new-tokens", NEW_TOKENS, "--ignore-eos", "--json"]
    done = run_device([folder, *args], blocked={"transformers", "executorch.exir"})
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["new_ids"] == kvexport_run_json(capsys, folder, *args[:-1])["new_ids"]


def test_a_pte_on_a_device_without_executorch_says_what_to_install(artifact):
    done = run_device([artifact("tiny-gemma3"), "--prompt", "Hi"], allowed=ONNX_DEVICE_PACKAGES)
    assert_one_line_error(done.returncode, done.stderr, "needs executorch to run", "pip install executorch==")


def test_chat_streams_the_reply_and_stops_at_the_end_of_turn(artifact, capsys):
    folder = artifact("tiny-qwen3", "onnx")
    done = run_device([folder, "--prompt", "Hi", "--chat", "--max-new-tokens", 12], allowed=ONNX_DEVICE_PACKAGES)
    assert done.returncode == 0, done.stderr
    expected = kvexport_run_json(capsys, folder, "--prompt", "Hi", "--chat", "--max-new-tokens", 12)
    assert done.stdout == expected["text"] + "\n"
    assert f"{len(expected['prompt_ids'])} prompt tokens, {len(expected['new_ids'])} new" in done.stderr


def test_a_corrupted_artifact_is_refused_before_loading(artifact, tmp_path, capsys, monkeypatch):
    import shutil

    from kvexport.runtime import run

    monkeypatch.setattr(run, "load_program", lambda *a, **k: pytest.fail("a corrupt artifact was loaded"))
    folder = tmp_path / "copy"
    shutil.copytree(artifact("tiny-gemma3", "onnx"), folder)
    archive, _ = pack(folder, tmp_path / "good.tar")
    data = bytearray((folder / "model.onnx.data").read_bytes())
    data[len(data) // 2] ^= 0xFF  # one byte
    (folder / "model.onnx.data").write_bytes(bytes(data))
    assert device.main([str(folder), "--prompt", "hi"]) == 2
    assert_one_line_error(2, capsys.readouterr().err, "model.onnx.data does not match the sha256")
    # The same byte flipped inside the archive.
    packed = archive.read_bytes()
    at = packed.index(bytes(data[: len(data) // 2]))  # where the member's data starts
    corrupt = bytearray(packed)
    corrupt[at + len(data) // 2] ^= 0xFF
    (tmp_path / "bad.tar").write_bytes(bytes(corrupt))
    assert device.main([str(tmp_path / "bad.tar"), "--prompt", "hi"]) == 2
    assert_one_line_error(2, capsys.readouterr().err, "archive", "bad.tar", "model.onnx.data does not match the sha256")
    (tmp_path / "cut.tar").write_bytes(packed[: len(packed) // 2])
    assert device.main([str(tmp_path / "cut.tar"), "--prompt", "hi"]) == 2
    assert_one_line_error(2, capsys.readouterr().err, "cut.tar is truncated")


@pytest.mark.parametrize(
    "args, phrases",
    [
        (["--max-new-tokens", "100"], ["exceeds the artifact's max_cache_len 64"]),
        (["--runner", "executorch"], ["--runner executorch runs .pte artifacts; this one is onnx"]),
        (["--device", "tpu"], ["unknown device 'tpu'"]),
    ],
)
def test_mistakes_get_one_line(artifact, capsys, args, phrases):
    code = device.main([str(artifact("tiny-gemma3", "onnx")), "--prompt", "Hello", *args])
    assert_one_line_error(code, capsys.readouterr().err, *phrases)


@pytest.mark.parametrize(
    "args, phrases",
    [
        ([], ["required: DIR|ARCHIVE, --prompt/-p", "see `python -m kvexport.device --help`"]),
        (["x", "-p", "hi", "--temperature", "nan"], ["temperature must be a finite number >= 0"]),
    ],
    ids=["no-arguments", "nan-temperature"],
)
def test_a_malformed_command_line_gets_one_line_not_a_usage_block(capsys, args, phrases):
    code = device.main(args)
    err = capsys.readouterr().err
    assert_one_line_error(code, err, *phrases)
    assert "usage:" not in err


def test_the_stock_executorch_runner_option(artifact, capsys):
    """--runner executorch: ExecuTorch's own TextLLMRunner prints what kvexport's loop generates."""
    folder = artifact("tiny-phi3")  # its greedy output has no EOS, where the stock runner would stop
    args = ["--prompt", PROMPT, "--max-new-tokens", str(NEW_TOKENS)]
    done = run_device([folder, *args, "--runner", "executorch"], blocked={"transformers"})
    assert done.returncode == 0, done.stderr
    expected = kvexport_run_json(capsys, folder, *args, "--ignore-eos")
    assert done.stdout.startswith(expected["text"] + "\n")  # then the runner's stats line
    code = device.main([str(folder), *args, "--runner", "executorch", "--chat", "--seed", "1"])
    assert_one_line_error(code, capsys.readouterr().err, "ExecuTorch's runner has no --chat, --seed")


_STOP_WHEN_LOADING = """
import sys, time
import kvexport.runtime.run as run
def load_program(folder, *args, **kwargs):
    print("loading", folder, file=sys.stderr, flush=True)
    time.sleep(120)
run.load_program = load_program
"""


@pytest.mark.parametrize(
    "signum, code, message", [("SIGTERM", 143, "terminated (SIGTERM)"), ("SIGINT", 130, "interrupted")], ids=["SIGTERM", "SIGINT"]
)
def test_a_signal_removes_the_unpacked_archive_and_says_so(artifact, tmp_path, signum, code, message):
    """SIGTERM (a service manager, a timeout) or Ctrl-C while the device runs an archive: the copy it
    unpacked into the temporary folder is removed, one line says why it stopped, exit 128 + signal."""
    import os
    import signal

    archive, _ = pack(artifact("tiny-gemma3", "onnx"), tmp_path / "tiny.tar")
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    script = _STOP_WHEN_LOADING + _RUN_DEVICE.format(allowed=ONNX_DEVICE_PACKAGES, blocked=set())
    proc = subprocess.Popen(
        [sys.executable, "-c", script, str(archive), "--prompt", "Hello"],
        stderr=subprocess.PIPE, text=True, env={**os.environ, "TMPDIR": str(tmp)},
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # as a terminal's Ctrl-C finds it
    )
    try:
        line = proc.stderr.readline()
        assert line.startswith(f"loading {tmp}/kvexport-"), line + proc.stderr.read()
        assert any(tmp.iterdir())  # the unpacked copy
        proc.send_signal(getattr(signal, signum))
        err = proc.stderr.read()
        proc.wait(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == code, err
    assert err == f"kvexport: {message}\n"
    assert list(tmp.iterdir()) == []


def test_the_stock_runner_refuses_a_manifest_that_does_not_describe_the_pte(artifact, tmp_path, capsys):
    """--runner executorch trusts the .pte, and kvexport's checks before it the manifest: the two must agree."""
    import shutil

    from tests.helpers import edit_manifest

    folder = tmp_path / "copy"
    shutil.copytree(artifact("tiny-gemma3"), folder)
    edit_manifest(lambda m: m.update(max_cache_len=128))(folder)
    code = device.main([str(folder), "--prompt", "Hello", "--runner", "executorch"])
    assert_one_line_error(code, capsys.readouterr().err, "kvexport.json says max_cache_len 128 but the program has 64 (get_max_context_len)")
