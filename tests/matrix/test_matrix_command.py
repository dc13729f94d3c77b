"""``kvexport matrix`` end to end: each row exported and checked in its own process, failures
recorded without stopping the run, shards merged. One real export (a tiny Cohere 2, a family
kvexport has no code or preset for, to ONNX: the faster target; the CI's tiny matrix exports such a
family to both), the other rows fail fast."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvexport.matrix.spec import load_matrix

from tests.helpers import assert_one_line_error, on_one_worker, run_cli

# The module fixture (the matrix run) is made once: all of it on one pytest-xdist worker.
pytestmark = on_one_worker("matrix-command")

MATRIX = """
[defaults]
max_cache_len = 64
[[row]]
model = ["tiny-cohere2", "tiny-stablelm"]
target = "onnx"
[[row]]
model = "tiny-stablelm"
target = "executorch"

[models.tiny-cohere2]
model_type = "cohere2"
head_dim = 16
sliding_window = 6
layer_types = ["sliding_attention", "full_attention"]

[models.tiny-stablelm]
model_type = "stablelm"
"""


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """The JSON report of each of two shards, and of their merge: (reports, exit codes, folder)."""
    folder = tmp_path_factory.mktemp("matrix")
    (folder / "m.toml").write_text(MATRIX)
    capsys = _Capture()
    codes = {}
    for shard in ("1/2", "2/2"):
        name = shard.replace("/", "of")
        codes[shard] = run_cli(capsys, "matrix", folder / "m.toml", "--shard", shard, "--json", folder / f"{name}.json",
                               "--report", folder / f"{name}.md", "--work-dir", folder / "work")[0]
    codes["merge"] = run_cli(capsys, "matrix", "merge", folder / "2of2.json", folder / "1of2.json",
                             "--json", folder / "all.json", "--report", folder / "all.md")[0]
    reports = {name: json.loads((folder / f"{name}.json").read_text()) for name in ("1of2", "2of2", "all")}
    return reports, codes, folder


class _Capture:
    """run_cli wants capsys; a module fixture cannot have it, and the output is not under test here."""

    def readouterr(self):
        return "", ""


def test_every_row_is_recorded_and_a_failure_fails_the_run(shards):
    reports, codes, _ = shards
    assert codes == {"1/2": 1, "2/2": 1, "merge": 1}
    merged = reports["all"]
    assert [r["index"] for r in merged["rows"]] == [0, 1, 2]
    assert [r["index"] for r in reports["1of2"]["rows"]] == [0, 2]  # round robin
    assert merged["shards"] == ["1/2", "2/2"]
    statuses = {(r["model"], r["target"]): r["status"] for r in merged["rows"]}
    assert statuses == {
        ("tiny-cohere2", "onnx"): "pass",
        ("tiny-stablelm", "onnx"): "error",
        ("tiny-stablelm", "executorch"): "error",
    }


def test_a_family_with_no_kvexport_code_exports_and_matches_eager(shards):
    reports, _, _ = shards
    row = reports["all"]["rows"][0]
    assert (row["model"], row["family"], row["target"], row["status"]) == ("tiny-cohere2", "cohere2", "onnx", "pass")
    assert row["first_divergence"] is None and row["max_logit_diff"] <= row["logit_tolerance"]
    # Both default check prompts ran to the end, past the 6-token window.
    assert all(p["match"] and p["compared_steps"] == p["new_tokens"] for p in row["check_prompts"])
    assert sum(p["prompt_tokens"] + p["new_tokens"] for p in row["check_prompts"][:1]) > 6
    assert row["export_seconds"] > 0 and set(row["export_steps"]) == {"load", "export", "lower", "save"}
    assert row["export_peak_rss_mb"] > 100 and row["artifact_mb"] > 0.1 and row["decode_tokens_per_s"] > 0


def test_failed_rows_say_where_and_why(shards):
    reports, _, folder = shards
    rows = {(r["model"], r["target"]): r for r in reports["all"]["rows"]}
    for target in ("executorch", "onnx"):
        refused = rows["tiny-stablelm", target]["failure"]
        assert refused["stage"] == "export" and "does not route its attention" in refused["reason"]
    markdown = (folder / "all.md").read_text()
    assert "3 rows: 1 pass, 0 fail, 2 error" in markdown
    assert "- **#2 tiny-stablelm × executorch** (export): " in markdown


def test_a_hanging_row_is_killed_at_its_timeout(tmp_path, capsys):
    (tmp_path / "m.toml").write_text('[[row]]\nmodel = "tiny-llama"\ntimeout_s = 1\n')
    code, _, err = run_cli(capsys, "matrix", tmp_path / "m.toml", "--json", tmp_path / "r.json")
    (row,) = json.loads((tmp_path / "r.json").read_text())["rows"]
    assert code == 1
    assert row["status"] == "error" and row["failure"]["stage"] == "process"
    assert row["failure"]["reason"].startswith("timed out after 1 s")


@pytest.mark.parametrize("keep_artifacts", [False, True], ids=["artifacts-removed", "artifacts-kept"])
def test_a_row_killed_mid_export_leaves_no_staging_folder(tmp_path, monkeypatch, keep_artifacts):
    """A row killed by its timeout_s while its export stages the artifact left the hidden
    ``.artifact.tmp-PID-*`` folder in the row's folder, whatever --keep-artifacts said."""
    from types import SimpleNamespace

    from kvexport.matrix import row, runner

    (tmp_path / "m.toml").write_text('[[row]]\nmodel = "tiny-llama"\ntimeout_s = 3\n')
    hanging = SimpleNamespace(__name__="tests.matrix.hanging_row", ROW_FILE=row.ROW_FILE, RESULT_FILE=row.RESULT_FILE,
                              ARTIFACT_DIR=row.ARTIFACT_DIR)
    monkeypatch.setattr(runner, "row_module", hanging)
    (result,) = runner.run_rows(load_matrix(tmp_path / "m.toml").rows, tmp_path / "work", keep_artifacts)
    assert result["failure"]["reason"].startswith("timed out after 3 s")
    (row_dir,) = (tmp_path / "work").iterdir()
    assert sorted(p.name for p in row_dir.iterdir()) == ["log.txt", "row.json"], (row_dir / "log.txt").read_text()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_a_row_s_process_dies_with_the_process_that_started_it(tmp_path):
    """A matrix run killed (or, on a Ray cluster, a worker whose node died) leaves no row exporting
    on its own: the row's process asks the kernel to kill it with its parent."""
    (tmp_path / "m.toml").write_text('[[row]]\nmodel = "tiny-llama"\n')
    (row,) = load_matrix(tmp_path / "m.toml").rows
    (tmp_path / "row").mkdir()
    (tmp_path / "parent.py").write_text(
        "import sys\nfrom pathlib import Path\nfrom kvexport.matrix.runner import _run_child\n"
        f"from kvexport.matrix.spec import Row\n_run_child(Row.from_dict({row.to_dict()!r}), Path(sys.argv[1]))\n"
    )
    parent = subprocess.Popen([sys.executable, str(tmp_path / "parent.py"), str(tmp_path / "row")])
    deadline = time.monotonic() + 60
    while not (children := _children(parent.pid)):
        assert time.monotonic() < deadline and parent.poll() is None
        time.sleep(0.1)
    time.sleep(2)  # the row is importing and building its model
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 10
    while any(_state(pid) not in ("gone", "Z") for pid in children):
        assert time.monotonic() < deadline, f"row process {children} outlived its parent"
        time.sleep(0.1)


def _children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(p) for p in path.read_text().split()] if path.exists() else []


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def test_the_json_report_holds_each_row_as_it_ends(tmp_path, monkeypatch):
    """A run that dies after its first row (here, interrupted) has that row in its --json report."""
    from kvexport.cli import matrix as command

    (tmp_path / "m.toml").write_text('[[row]]\nmodel = ["tiny-llama", "tiny-qwen3"]\n')

    def first_row_then_interrupted(rows, work_dir, keep_artifacts, on_start, on_done):
        on_start(rows[0])
        on_done({**rows[0].to_dict(), "status": "pass", "failure": None, "family": "llama", "export_seconds": 1.0,
                 "export_peak_rss_mb": 1.0, "artifact_mb": 1.0, "max_logit_diff": 0.0, "decode_tokens_per_s": 1.0})
        raise KeyboardInterrupt

    monkeypatch.setattr(command, "run_rows", first_row_then_interrupted)
    with pytest.raises(KeyboardInterrupt):
        command.run_or_merge([str(tmp_path / "m.toml")], None, None, tmp_path / "r.json", None, False)
    report = json.loads((tmp_path / "r.json").read_text())
    assert [r["model"] for r in report["rows"]] == ["tiny-llama"] and report["matrix_rows"] == 2


def test_model_runs_only_that_model_s_rows_and_an_unknown_one_is_refused(tmp_path, monkeypatch, capsys):
    from kvexport.cli import matrix as command

    (tmp_path / "m.toml").write_text('[[row]]\nmodel = ["tiny-llama", "tiny-qwen3"]\ntarget = ["executorch", "onnx"]\n')
    ran = []

    def record(rows, work_dir, keep_artifacts, on_start, on_done):
        ran.extend((row.model, row.target) for row in rows)
        return [{**row.to_dict(), "status": "pass", "failure": None, "family": "qwen3", "check": False, "export_seconds": 1.0,
                 "export_peak_rss_mb": 1.0, "artifact_mb": 1.0, "decode_tokens_per_s": 1.0} for row in rows]

    monkeypatch.setattr(command, "run_rows", record)
    code, _, err = run_cli(capsys, "matrix", tmp_path / "m.toml", "--model", "tiny-qwen3")
    assert code == 0 and ran == [("tiny-qwen3", "executorch"), ("tiny-qwen3", "onnx")]
    assert "2 of 4 rows (shard 1/1, models tiny-qwen3)" in err
    code, _, err = run_cli(capsys, "matrix", tmp_path / "m.toml", "--model", "tiny-gemma3")
    assert_one_line_error(code, err, "--model tiny-gemma3:", "has no row of that model; its models: tiny-llama, tiny-qwen3")
