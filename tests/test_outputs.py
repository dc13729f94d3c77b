"""kvexport/outputs.py: every output option's path is checked before the work, and a path the check
passes is written whole, one it refuses cannot be (docs/errors.md)."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvexport.errors import InvalidOptionError
from kvexport.outputs import check_writable, write_text
from tests.test_cli import snapshot

# Steps of a path below a small tree: a file, a folder with a file in it, names that do not exist.
STEPS = st.sampled_from(["a-file", "folder", "inner-file", "new", "other-new"])


def _tree(root: Path) -> None:
    (root / "a-file").write_text("keep me")
    (root / "folder").mkdir()
    (root / "folder" / "inner-file").write_text("keep me too")


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=st.lists(STEPS, min_size=1, max_size=4), unwritable=st.booleans())
def test_a_path_the_check_passes_is_written_and_one_it_refuses_cannot_be(steps, unwritable):
    """The check and the write agree on every path (/sys refuses new entries to root too): where the
    check passes, the file is written whole; where it refuses in one line, so does the write, and
    nothing under the tree changed."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        _tree(root)
        path = (Path("/sys") if unwritable else root).joinpath(*steps)
        before = snapshot(root)
        try:
            check_writable(path, "--json")
        except InvalidOptionError as e:
            assert "\n" not in str(e) and ("choose another --json" in str(e) or "--json names a file" in str(e))
            with pytest.raises(InvalidOptionError):
                write_text(path, "{}", "--json")
            assert snapshot(root) == before
            return
        write_text(path, "{}", "--json")
        assert path.read_text() == "{}"
        left = set(snapshot(root)) - set(before)
        assert all(not Path(p).name.startswith(".") for p in left)  # no hidden temporary file left beside it
        shutil.rmtree(root, ignore_errors=True)
