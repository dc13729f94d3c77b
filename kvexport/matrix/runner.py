"""Runs rows one after another, each in its own child process (see ``row.py``), and collects what
each one reports. A row that fails, crashes or hangs is recorded and the next one runs."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from ..artifact.staging import remove_abandoned
from ..exporter import EXPORT_HASH_SEED
from . import row as row_module
from .row import PARENT_ENV
from .spec import Row


def run_rows(
    rows: list[Row],
    work_dir: Path,
    keep_artifacts: bool = False,
    on_start: Callable[[Row], None] | None = None,
    on_done: Callable[[dict], None] | None = None,
) -> list[dict]:
    """Each row's result: the row itself, what its process measured, its wall time and its log."""
    results = []
    for row in rows:
        if on_start:
            on_start(row)
        result = run_row_process(row, work_dir, keep_artifacts)
        results.append(result)
        if on_done:
            on_done(result)
    return results


def run_row_process(row: Row, work_dir: Path, keep_artifacts: bool = False) -> dict:
    """One row in its child process, in its folder ``work_dir / row.id`` (emptied first): the row,
    what its process measured, its wall time and its log."""
    row_dir = work_dir / row.id
    shutil.rmtree(row_dir, ignore_errors=True)
    row_dir.mkdir(parents=True)
    start = time.perf_counter()
    measured = _run_child(row, row_dir)
    # A row killed mid-export (its timeout_s, an out-of-memory kill) leaves the export's hidden
    # staging folder; its process is gone, so the staging's own sweep removes it.
    remove_abandoned(row_dir / row_module.ARTIFACT_DIR)
    if not keep_artifacts:
        for name in (row_module.ARTIFACT_DIR, "model"):
            shutil.rmtree(row_dir / name, ignore_errors=True)
    result = {**row.to_dict(), **measured, "row_seconds": round(time.perf_counter() - start, 1)}
    result["log"] = str(row_dir / "log.txt")
    return result


def _run_child(row: Row, row_dir: Path) -> dict:
    (row_dir / row_module.ROW_FILE).write_text(json.dumps(row.to_dict(), indent=2) + "\n")
    log_path = row_dir / "log.txt"
    with open(log_path, "wb") as log:
        child = subprocess.Popen(
            [sys.executable, "-m", row_module.__name__, str(row_dir)],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=child_env(),
        )
        try:
            returncode = child.wait(timeout=row.timeout_s)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
            return no_result(f"timed out after {row.timeout_s} s, {_last_line(log_path)}")
        finally:
            if child.poll() is None:  # interrupted: do not leave the child running
                child.kill()
                child.wait()
    result_path = row_dir / row_module.RESULT_FILE
    if result_path.is_file():
        return json.loads(result_path.read_text())
    if returncode < 0:
        name = signal.Signals(-returncode).name
        hint = " (out of memory?)" if -returncode == signal.SIGKILL else ""
        return no_result(f"the row's process was killed by {name}{hint}, {_last_line(log_path)}")
    return no_result(f"the row's process exited with status {returncode}, {_last_line(log_path)}")


def child_env() -> dict:
    """This environment, with the kvexport being run first on the path: the child runs the same code
    even where an installed kvexport is elsewhere (a development checkout, a worktree); and with
    kvexport's hash seed, so that a row's artifact has the bytes ``kvexport export`` gives; and
    this process's id, so that the row dies with it (``row.die_with_parent``)."""
    env = dict(os.environ)
    env["PYTHONHASHSEED"] = EXPORT_HASH_SEED
    env[PARENT_ENV] = str(os.getpid())
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join([root, *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])])
    return env


def no_result(reason: str, stage: str = "process") -> dict:
    """A row that gave no result of its own: ``stage`` says where it failed (its process, the cluster)."""
    return {"status": "error", "failure": {"stage": stage, "reason": reason}, "family": None}


def _last_line(log_path: Path) -> str:
    lines = [line.strip() for line in log_path.read_text(errors="replace").splitlines() if line.strip()]
    return f"last output: {lines[-1][:200]!r}" if lines else "no output"
