"""``kvexport matrix`` end to end: each row exported and checked in its own process, failures
recorded without stopping the run, shards merged. One real export (a tiny Cohere 2, a family
kvexport has no code or preset for, to ONNX: the faster target; the CI's tiny matrix exports such a
family to both), the other rows fail fast."""

from __future__ import annotations

import json

import pytest

from tests.helpers import on_one_worker
from tests.test_cli import run_cli

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
    from kvexport.matrix.spec import load_matrix

    (tmp_path / "m.toml").write_text('[[row]]\nmodel = "tiny-llama"\ntimeout_s = 3\n')
    hanging = SimpleNamespace(__name__="tests.matrix.hanging_row", ROW_FILE=row.ROW_FILE, RESULT_FILE=row.RESULT_FILE,
                              ARTIFACT_DIR=row.ARTIFACT_DIR)
    monkeypatch.setattr(runner, "row_module", hanging)
    (result,) = runner.run_rows(load_matrix(tmp_path / "m.toml").rows, tmp_path / "work", keep_artifacts)
    assert result["failure"]["reason"].startswith("timed out after 3 s")
    (row_dir,) = (tmp_path / "work").iterdir()
    assert sorted(p.name for p in row_dir.iterdir()) == ["log.txt", "row.json"], (row_dir / "log.txt").read_text()
