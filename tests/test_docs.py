"""The docs hold together: docs/errors.md names the tests that prove each row (they must exist, and
the suite runs them), every relative link in the README, the CHANGELOG and docs/ reaches a file and
heading that exist, and the README stays a README."""

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


README = REPO / "README.md"
README_MAX_LINES = 250
# [text](target) outside code; an image's ![alt](target) too. The target ends at the first space
# (a link title) or the closing parenthesis.
MD_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s[^)]*)?\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
CODE_SPAN = re.compile(r"(`+).+?\1", re.S)
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)


def markdown_files() -> list[Path]:
    return [README, REPO / "CHANGELOG.md", *sorted((REPO / "docs").glob("*.md"))]


def without_code(text: str) -> str:
    """The text with fenced blocks and code spans blanked: a link there is an example, not a link."""
    return CODE_SPAN.sub("", FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup and punctuation dropped (letters, digits, _ and - kept),
    lowercase, each space a -."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading: its text
    text = re.sub(r"[^\w\- ]", "", text.lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading's anchor, a repeated one numbered as GitHub numbers it (-1, -2, ...)."""
    seen: dict[str, int] = {}
    out = set()
    for heading in HEADING.findall(FENCE.sub("", path.read_text())):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def relative_links(path: Path) -> list[str]:
    return [t for t in MD_LINK.findall(without_code(path.read_text())) if not re.match(r"[a-z][a-z0-9+.-]*:", t)]


def test_the_slug_rule():
    assert slug("ONNX: the runtime owns the cache") == "onnx-the-runtime-owns-the-cache"
    assert slug("`--quantize-lm-head int4` (opt-in)") == "--quantize-lm-head-int4-opt-in"
    assert slug("The real matrix (2026-11-21)") == "the-real-matrix-2026-11-21"
    assert slug("kvexport_json fields") == "kvexport_json-fields"


def test_every_relative_link_reaches_a_file_and_heading():
    broken = []
    for path in markdown_files():
        for target in relative_links(path):
            name, _, anchor = target.partition("#")
            dest = (path.parent / name).resolve() if name else path
            where = f"{path.relative_to(REPO)}: ({target})"
            if not dest.exists():
                broken.append(f"{where}: no such file")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{where}: no heading #{anchor} in {dest.relative_to(REPO)}")
    assert broken == []


def test_the_docs_are_linked_from_the_readme():
    linked = {(REPO / t.partition("#")[0]).resolve() for t in relative_links(README)}
    unlinked = [p.name for p in markdown_files()[1:] if p.resolve() not in linked]
    assert unlinked == []


def test_the_readme_stays_short():
    lines = len(README.read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move detail to docs/"


def test_the_readme_keeps_its_test_command_and_support_table():
    text = README.read_text()
    assert "make test" in text
    assert text.count("<!-- support-table:start -->") == 1 and text.count("<!-- support-table:end -->") == 1
