"""The example CI workflow (scripts/ci-matrix.yml) is valid YAML and its shards cover the matrix."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_workflow_shards_cover_the_matrix_and_the_merge_checks_the_readme():
    yaml = pytest.importorskip("yaml")
    workflow = yaml.safe_load((ROOT / "scripts" / "ci-matrix.yml").read_text())
    shard_job, merge_job = workflow["jobs"]["shard"], workflow["jobs"]["merge"]
    shard_commands = " ".join(step.get("run", "") for step in shard_job["steps"])
    (count,) = set(re.findall(r"--shard \$\{\{ matrix\.shard \}\}/(\d+)", shard_commands))
    assert shard_job["strategy"]["matrix"]["shard"] == list(range(1, int(count) + 1))
    assert "matrices/tiny.toml" in shard_commands and (ROOT / "matrices" / "tiny.toml").is_file()
    merge_commands = [step.get("run", "") for step in merge_job["steps"]]
    assert merge_job["needs"] == "shard"
    assert any(c.startswith("kvexport matrix merge shard-*.json") for c in merge_commands)
    assert any(c == "python scripts/support_table.py matrix.json --check" for c in merge_commands)
