"""The staged artifact folder: built aside, published whole, nothing left behind on failure."""

from __future__ import annotations

import os
import signal

import pytest

from kvexport.artifact import manifest as artifact
from kvexport.artifact import staging

from tests.artifact.test_manifest import make_artifact, minimal_manifest


def test_a_failed_build_leaves_nothing_behind(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(RuntimeError):
        with staging.staged_folder(out) as tmp:
            (tmp / "model.pte").write_bytes(b"half")
            raise RuntimeError("lowering failed")
    assert list(tmp_path.iterdir()) == []


def test_a_failed_rebuild_keeps_the_previous_artifact(tmp_path):
    out = tmp_path / "out"
    make_artifact(out)
    with pytest.raises(KeyboardInterrupt):
        with staging.staged_folder(out) as tmp:
            (tmp / "model.pte").write_bytes(b"new")
            raise KeyboardInterrupt
    assert (out / "model.pte").read_bytes() == b"program"
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_an_interrupt_during_the_swap_waits_until_it_is_done(tmp_path, monkeypatch):
    out = tmp_path / "out"
    make_artifact(out)
    rename = os.rename

    def rename_then_interrupt(src, dst):
        rename(src, dst)
        if ".out.old-" in str(dst):  # the old artifact is aside, the new one not yet in place
            signal.raise_signal(signal.SIGINT)

    monkeypatch.setattr(staging.os, "rename", rename_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        with staging.staged_folder(out) as tmp:
            (tmp / "model.pte").write_bytes(b"new")
            artifact.write_manifest(tmp, minimal_manifest())
    # The interrupt came once the swap was done: the new artifact is whole, nothing is left aside.
    assert artifact.read_manifest(out)["files"]["model.pte"]["bytes"] == 3
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_a_successful_rebuild_replaces_it(tmp_path):
    out = tmp_path / "out"
    make_artifact(out)
    with staging.staged_folder(out) as tmp:
        (tmp / "model.pte").write_bytes(b"new")
        artifact.write_manifest(tmp, minimal_manifest())
    assert artifact.read_manifest(out)["files"]["model.pte"]["bytes"] == 3
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_the_artifact_folder_gets_the_permissions_mkdir_would_give(tmp_path):
    """It is built in a temporary folder (owner-only), but is published for whoever deploys it."""
    (tmp_path / "plain").mkdir()
    make_artifact(tmp_path / "out")
    assert (tmp_path / "out").stat().st_mode == (tmp_path / "plain").stat().st_mode


def test_missing_parent_folders_are_made_and_removed_again_on_failure(tmp_path):
    out = tmp_path / "a" / "b" / "out"
    with pytest.raises(RuntimeError):
        with staging.staged_folder(out) as tmp:
            assert tmp.parent == out.parent
            raise RuntimeError("lowering failed")
    assert list(tmp_path.iterdir()) == []
    make_artifact(out)
    assert artifact.read_manifest(out)["program"] == "model.pte"

