"""Interrupts and faults during an export leave no partial folder and keep the previous artifact.

The signal tests run a real ``kvexport`` process on a tiny preset and signal it once its stderr
says the lowering step started (the longest step, so the signal lands inside it).
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

import kvexport
from kvexport.cli import main
from kvexport.artifact import manifest as artifact
from kvexport.artifact import staging

REPO = Path(kvexport.__file__).resolve().parent.parent


def tree(root: Path) -> dict:
    """Every path under ``root``, hidden ones included, with its file's sha256."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
        for p in sorted(root.rglob("*"))
    }


def previous_artifact(out: Path) -> None:
    """A small valid artifact at ``out``, standing for the result of an earlier export."""
    with staging.staged_folder(out) as tmp:
        (tmp / "model.pte").write_bytes(b"the previous program")
        artifact.write_manifest(
            tmp,
            {
                "target": "executorch",
                "program": "model.pte",
                "max_cache_len": 16,
                "vocab_size": 100,
                "eos_token_ids": [97],
                "bos_token_id": None,
                "dtype": "float32",
                "layers": [{"cache": "static", "window": None}],
                "source": {"name": "tiny-llama", "kind": "preset", "path": None},
            },
        )


@pytest.mark.parametrize(
    "signum, code, message",
    [(signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 143, "terminated (SIGTERM)")],
    ids=["SIGINT", "SIGTERM"],
)
def test_a_signal_during_lowering_leaves_the_previous_artifact(tmp_path, signum, code, message):
    out = tmp_path / "out"
    previous_artifact(out)
    before = tree(tmp_path)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvexport.cli", "tiny-llama", "-o", str(out), "--max-cache-len", "16", "--force"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=tmp_path,
        # A shell starts background jobs with SIGINT ignored, and Python then installs no Ctrl-C
        # handler: give the child the default disposition, as an interactive Ctrl-C would find.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    watchdog = threading.Timer(300, proc.kill)  # a hang fails the test instead of hanging the CI job
    watchdog.start()
    try:
        seen = []
        for line in proc.stderr:
            seen.append(line)
            if line.startswith("lower:"):
                proc.send_signal(signum)
                break
        else:
            pytest.fail(f"the export ended before lowering (exit {proc.wait()}):\n{''.join(seen)}")
        rest = proc.stderr.read()  # through the same buffered reader: nothing after "lower:" is lost
        proc.wait(timeout=60)
    finally:
        watchdog.cancel()
        proc.kill()
    err = "".join(seen) + rest
    assert proc.returncode == code, err
    assert f"kvexport: {message}; no partial output was left behind" in err and "Traceback" not in err, err
    assert "✓ lower" not in err, "the signal arrived after lowering; the test proved nothing"
    # The previous artifact is byte for byte what it was, and nothing else is there (no .out.tmp-*).
    assert tree(tmp_path) == before


def test_a_failure_in_lowering_leaves_the_previous_artifact(tmp_path, monkeypatch, capsys):
    from kvexport.exporter.executorch import target as executorch

    def failing_lower(program, info, folder, deferred=None):
        (folder / "model.pte").write_bytes(b"half a program")
        raise RuntimeError("lowering failed")

    # Skip the trace (seconds of CPU): the lowering is what fails here.
    monkeypatch.setattr(executorch, "export", lambda model, max_cache_len, max_tokens_per_call, kv_cache, calibration_ids, max_draft_tokens, **choices: object())
    monkeypatch.setattr(executorch, "lower", failing_lower)
    out = tmp_path / "out"
    previous_artifact(out)
    before = tree(tmp_path)
    # A failure inside kvexport is a bug: it keeps its traceback (it is not a KvexportError).
    with pytest.raises(RuntimeError, match="lowering failed"):
        main(["tiny-llama", "-o", str(out), "--max-cache-len", "16", "--force"])
    assert tree(tmp_path) == before
    assert artifact.read_manifest(out).files["model.pte"].bytes == len(b"the previous program")


def test_a_full_disk_while_lowering_gets_one_line(tmp_path, monkeypatch, capsys):
    """Simulated: the lowering step fails the way a full disk fails a write (ENOSPC)."""
    import errno

    from kvexport.exporter.executorch import target as executorch

    def lower_on_a_full_disk(program, info, folder, deferred=None):
        (folder / "model.pte").write_bytes(b"half a program")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(folder / "model.pte"))

    monkeypatch.setattr(executorch, "export", lambda model, max_cache_len, max_tokens_per_call, kv_cache, calibration_ids, max_draft_tokens, **choices: object())
    monkeypatch.setattr(executorch, "lower", lower_on_a_full_disk)
    out = tmp_path / "out"
    previous_artifact(out)
    before = tree(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main(["tiny-llama", "-o", str(out), "--max-cache-len", "16", "--force"])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("kvexport: error:")]
    assert exit_info.value.code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert "No space left on device while writing" in lines[0] and "free some space" in lines[0]
    assert tree(tmp_path) == before


def _onnx_lower_on_a_full_disk(program, spec, folder, deferred=None):
    """What onnx_program.save does on a full disk: numpy's tofile, which writes the external data
    (onnx_ir), raises an OSError without an errno."""
    (folder / "model.onnx.data").write_bytes(b"half the weights")
    raise OSError("problem writing element 1024 to file")


def test_a_full_disk_while_writing_onnx_gets_one_line(tmp_path, monkeypatch, capsys):
    """Simulated: the ONNX lowering fails as numpy fails on a full disk, and the disk is full (the
    staged folder's probe write gets ENOSPC)."""
    import builtins
    import errno

    from kvexport.exporter.onnx import target as onnx

    def full_disk_open(path, *args, **kwargs):
        if str(path).endswith(".kvexport-space-probe"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return builtins.open(path, *args, **kwargs)

    monkeypatch.setattr(onnx, "export", lambda model, max_cache_len, max_tokens_per_call, kv_cache, calibration_ids, max_draft_tokens, **choices: object())
    monkeypatch.setattr(onnx, "lower", _onnx_lower_on_a_full_disk)
    out = tmp_path / "out"
    args = ["tiny-llama", "--target", "onnx", "-o", str(out), "--max-cache-len", "16", "--force"]
    previous_artifact(out)
    before = tree(tmp_path)
    # The same error where the disk has room is not a full disk: a bug, with its traceback.
    with pytest.raises(OSError, match="problem writing element"):
        main(args)
    assert tree(tmp_path) == before
    monkeypatch.setattr(staging, "open", full_disk_open, raising=False)
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("kvexport: error:")]
    assert exit_info.value.code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert f"No space left on device while writing {out}; free some space" in lines[0]
    assert tree(tmp_path) == before


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="mounting a small tmpfs needs root")
def test_a_really_full_disk_while_writing_onnx_gets_one_line(tmp_path, capsys, monkeypatch):
    """A real full disk: a 256 KiB tmpfs, where tiny-llama's ONNX weights (640 KiB) do not fit. The
    memory plan, which would refuse it before the weights load, is told the disk is free, as when
    the disk fills while the export runs: the write itself meets the full disk."""
    from types import SimpleNamespace

    from kvexport.exporter import memory_plan

    monkeypatch.setattr(memory_plan.shutil, "disk_usage", lambda path: SimpleNamespace(free=2**40))
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(disk)], capture_output=True, check=False).returncode:
        pytest.skip("no tmpfs can be mounted here (a container without CAP_SYS_ADMIN)")
    try:
        with pytest.raises(SystemExit) as exit_info:
            main(["tiny-llama", "--target", "onnx", "-o", str(disk / "out"), "--max-cache-len", "16", "--quiet"])
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and "Traceback" not in err, err
        assert f"kvexport: error: No space left on device while writing {disk / 'out'}; free some space" in err, err
        assert list(disk.iterdir()) == []
    finally:
        subprocess.run(["umount", str(disk)], check=True)


def test_an_export_that_finished_first_at_the_same_output_is_not_replaced(tmp_path, monkeypatch, capsys):
    """Two exports to one -o at once: the one that finishes second is refused, not published over
    the first (without --force)."""
    from kvexport.exporter.executorch import target as executorch

    out = tmp_path / "out"

    def lower_while_another_export_finishes(program, spec, folder, deferred=None):
        (folder / "model.pte").write_bytes(b"this export's program")
        previous_artifact(out)  # the other export, started at the same time, publishes first
        return {"program": "model.pte"}

    monkeypatch.setattr(executorch, "export", lambda model, max_cache_len, max_tokens_per_call, kv_cache, calibration_ids, max_draft_tokens, **choices: object())
    monkeypatch.setattr(executorch, "lower", lower_while_another_export_finishes)
    with pytest.raises(SystemExit) as exit_info:
        main(["tiny-llama", "-o", str(out), "--max-cache-len", "16"])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("kvexport: error:")]
    assert exit_info.value.code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert f"output {out} already exists: it appeared while this export ran" in lines[0]
    assert (out / "model.pte").read_bytes() == b"the previous program"
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
