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


@pytest.mark.usefixtures("sigint_raises_keyboard_interrupt")
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
        with staging.staged_folder(out, force=True) as tmp:
            (tmp / "model.pte").write_bytes(b"new")
            artifact.write_manifest(tmp, minimal_manifest())
    # The interrupt came once the swap was done: the new artifact is whole, nothing is left aside.
    assert artifact.read_manifest(out).files["model.pte"].bytes == 3
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_a_successful_rebuild_replaces_it(tmp_path):
    out = tmp_path / "out"
    make_artifact(out)
    with staging.staged_folder(out, force=True) as tmp:
        (tmp / "model.pte").write_bytes(b"new")
        artifact.write_manifest(tmp, minimal_manifest())
    assert artifact.read_manifest(out).files["model.pte"].bytes == 3
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
    assert artifact.read_manifest(out).program == "model.pte"



def test_an_output_that_appeared_meanwhile_is_left_and_the_export_refused(tmp_path):
    """Two exports to one -o at once: the second to finish does not silently replace the first."""
    from kvexport.errors import InvalidOptionError

    out = tmp_path / "out"
    with pytest.raises(InvalidOptionError, match="already exists: it appeared while this export ran .*--force"):
        with staging.staged_folder(out) as tmp:
            (tmp / "model.pte").write_bytes(b"mine")
            make_artifact(out)  # the other export, finishing first
    assert (out / "model.pte").read_bytes() == b"program"
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # this export's staged folder is gone


def test_with_force_an_output_that_appeared_meanwhile_is_replaced(tmp_path):
    out = tmp_path / "out"
    with staging.staged_folder(out, force=True) as tmp:
        (tmp / "model.pte").write_bytes(b"new")
        artifact.write_manifest(tmp, minimal_manifest())
        make_artifact(out)
    assert artifact.read_manifest(out).files["model.pte"].bytes == 3
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def _start_staging(out):
    """A process that stages a folder for ``out`` and waits (an export in its lowering step)."""
    import subprocess
    import sys
    from pathlib import Path

    script = (
        "import sys, time\n"
        "from pathlib import Path\n"
        "from kvexport.artifact import staging\n"
        "with staging.staged_folder(Path(sys.argv[1])) as tmp:\n"
        "    (tmp / 'model.pte').write_bytes(b'half')\n"
        "    print(tmp.name, flush=True)\n"
        "    time.sleep(120)\n"
    )
    repo = Path(staging.__file__).resolve().parents[2]
    proc = subprocess.Popen([sys.executable, "-c", script, str(out)], stdout=subprocess.PIPE, text=True, cwd=repo)
    return proc, proc.stdout.readline().strip()


def test_a_staged_folder_left_by_a_killed_export_is_removed_by_the_next(tmp_path):
    out = tmp_path / "out"
    killed, name = _start_staging(out)
    assert name.startswith(f".out.tmp-{killed.pid}-")
    running, running_name = _start_staging(out)
    try:
        killed.kill()  # SIGKILL: no cleanup runs
        killed.wait()
        assert (tmp_path / name / "model.pte").is_file()
        # Not this output's (another name), or not staged by kvexport: never touched.
        foreign = [tmp_path / f".outer.tmp-{killed.pid}-abcdefgh", tmp_path / f".out.tmp-{killed.pid}-keep"]
        for folder in foreign:
            folder.mkdir()
        make_artifact(out)
        assert not (tmp_path / name).exists()
        assert (tmp_path / running_name / "model.pte").is_file()  # its process still runs
        assert all(folder.is_dir() for folder in foreign)
    finally:
        running.kill()
        running.wait()


def test_a_staged_folder_whose_lock_is_held_is_kept_whatever_its_pid(tmp_path):
    """A process of another PID namespace (a container on a shared disk) has a PID this one cannot
    see: the lock it holds on its staged folder keeps it."""
    import fcntl

    out = tmp_path / "out"
    folder = tmp_path / ".out.tmp-4194304-abcdefgh"  # above any pid_max: no such process here
    folder.mkdir()
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        # flock locks belong to the open file: a second open, as another process's, is refused.
        assert staging.remove_abandoned(out) == [] and folder.is_dir()
    finally:
        os.close(fd)
    assert staging.remove_abandoned(out) == [folder] and not folder.exists()
