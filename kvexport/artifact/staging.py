"""The artifact folder published atomically: built under a hidden temporary sibling and renamed
into place only once complete, so an export that fails or is interrupted leaves nothing at the
output path, and a previous artifact there stays intact until the new one is whole."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import tempfile
import threading
from pathlib import Path

from ..errors import InvalidOptionError
from .manifest import MANIFEST


def check_output_path(out: Path, force: bool) -> None:
    """Refuse up front, before any weights load, an output that exists (without ``--force``), that
    ``--force`` should not replace, or that cannot be written."""
    if out.exists() or out.is_symlink():
        if not force:
            raise InvalidOptionError(f"output {out} already exists; pass --force to replace it")
        if not out.is_dir():
            raise InvalidOptionError(f"output {out} exists and is not a folder; remove it or choose another -o")
        # --force deletes the old folder: only ever one that kvexport wrote (or an empty one), so a
        # mistyped -o cannot wipe a folder of other files.
        if not (out / MANIFEST).is_file() and any(out.iterdir()):
            raise InvalidOptionError(
                f"output {out} is a folder that is not a kvexport artifact; --force replaces only artifacts, "
                "choose another -o"
            )
    ancestor = _existing_ancestor(out)
    if not ancestor.is_dir():
        raise InvalidOptionError(f"cannot write {out}: {ancestor} is a file, not a folder; choose another -o")
    # os.access says yes to root everywhere; creating a folder is the only honest test (read-only
    # mounts, /sys, /proc, full quotas).
    try:
        os.rmdir(tempfile.mkdtemp(dir=ancestor, prefix=f".{out.name}.tmp-"))
    except OSError as e:
        raise InvalidOptionError(f"cannot write {out}: {ancestor} refuses new folders ({e.strerror}); choose another -o")


def _existing_ancestor(out: Path) -> Path:
    """The output's parent, or its nearest ancestor that exists (missing parents are created)."""
    parent = out.absolute().parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    return parent


@contextlib.contextmanager
def staged_folder(out: Path):
    """Yield an empty temporary folder beside ``out``; on success move it to ``out``.

    On any exception (KeyboardInterrupt and SystemExit included) the temporary folder, and any
    parent folders made for it, are removed and ``out`` is left as it was.
    """
    out = out.absolute()
    missing = [p for p in out.parents if not p.exists()]
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = None
    try:
        tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp-"))
        tmp.chmod(0o777 & ~_umask())  # mkdtemp's is owner-only; the artifact gets what mkdir gives
        yield tmp
        # An interrupt between the two renames of a swap would leave the old artifact aside under
        # its hidden name: SIGINT/SIGTERM wait until the swap is done.
        with _signals_deferred():
            _publish(tmp, out)
    except BaseException:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        for parent in missing:  # innermost first
            with contextlib.suppress(OSError):
                parent.rmdir()
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def _signals_deferred():
    """Record SIGINT/SIGTERM instead of handling them, then raise the first one again at the end.

    Blocking them with a signal mask would not do: one of torch's worker threads would take the
    signal and Python would still run its handler in the main thread, mid-swap.
    """
    signals = (signal.SIGINT, signal.SIGTERM)
    previous = {s: signal.getsignal(s) for s in signals}
    # Only the main thread may set handlers, and one set outside Python (None) cannot be restored.
    if threading.current_thread() is not threading.main_thread() or None in previous.values():
        yield
        return
    received = []
    for s in signals:
        signal.signal(s, lambda signum, frame: received.append(signum))
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        if received:
            signal.raise_signal(received[0])  # now, to the handler that was in place


def _publish(tmp: Path, out: Path) -> None:
    if not out.exists():
        os.rename(tmp, out)
        return
    # Swap with two renames so the old artifact is whole until the new one is in place.
    old = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.old-"))
    os.rmdir(old)
    os.rename(out, old)
    try:
        os.rename(tmp, out)
    except BaseException:
        os.rename(old, out)
        raise
    shutil.rmtree(old, ignore_errors=True)
