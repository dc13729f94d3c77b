"""docs/errors.md names the tests that prove each row: they must exist (and the suite runs them)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import kvexport

REPO = Path(kvexport.__file__).resolve().parent.parent
ERRORS = REPO / "docs" / "errors.md"
# [`test_name[param-id]`](../tests/path.py)
LINK = re.compile(r"\[`(test_\w+(?:\[[^`]*\])?)`\]\(\.\./(tests/[\w/]+\.py)\)")


def bad_input_rows() -> list[str]:
    """The rows of the tables under the per-command headings (not the exit-code table above them)."""
    text = ERRORS.read_text()
    tables = text[text.index("\n## "):]
    return [line for line in tables.splitlines() if line.startswith("|") and not line.startswith(("| input", "|---"))]


def test_every_bad_input_row_links_a_test():
    rows = bad_input_rows()
    assert len(rows) >= 40
    for row in rows:
        assert LINK.search(row), f"no test linked in: {row}"


def test_the_linked_tests_exist():
    links = {f"{path}::{name}" for name, path in LINK.findall(ERRORS.read_text())}
    files = sorted({node.split("::")[0] for node in links})
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    collected = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *files],
        cwd=REPO, env=env, capture_output=True, text=True, check=True, timeout=300,
    ).stdout.splitlines()
    assert sorted(links - set(collected)) == []


def test_the_readme_links_the_table():
    assert "(docs/errors.md)" in (REPO / "README.md").read_text()
