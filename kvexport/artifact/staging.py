"""The artifact folder published atomically: built under a hidden temporary sibling and renamed
into place only once complete, so an export that fails or is interrupted leaves nothing at the
output path, and a previous artifact there stays intact until the new one is whole.

The sibling is ``.NAME.tmp-PID-XXXXXXXX``, PID the exporting process's, which holds a lock on it
while it lives. One that ``kill -9`` (or a power cut) left behind is removed by the next export to
the same output, once its process is gone.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import signal
import tempfile
import threading
from pathlib import Path

from ..errors import InvalidOptionError
from ..outputs import check_writable
from .manifest import MANIFEST


def check_output_path(out: Path, force: bool) -> None:
    """Refuse up front, before any weights load, an output that exists (without ``--force``), that
    ``--force`` should not replace, or that cannot be written."""
    # The artifact replaces the folder whole: never the one this process (and a shell) works in.
    here = Path.cwd()
    if out.resolve() == here or out.resolve() in here.parents:
        what = "the working folder" if out.resolve() == here else f"a folder that holds the working folder {here}"
        raise InvalidOptionError(
            f"output {out} is {what}, which the artifact folder would replace; choose -o NAME, a new folder"
        )
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
    check_writable(out, "-o", kind="folder")


@contextlib.contextmanager
def staged_folder(out: Path, force: bool = False):
    """Yield an empty temporary folder beside ``out``; on success move it to ``out``.

    ``out`` is replaced only with ``force``: an output that appeared while the folder was built
    (another export to the same ``-o``) is otherwise left as it is, and the export refused.
    On any exception (KeyboardInterrupt and SystemExit included) the temporary folder, and any
    parent folders made for it, are removed and ``out`` is left as it was.
    """
    out = out.absolute()
    missing = [p for p in out.parents if not p.exists()]
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_abandoned(out)
    tmp = lock = full = None
    try:
        tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=_staging_prefix(out)))
        lock = _hold_lock(tmp)
        tmp.chmod(0o777 & ~_umask())  # mkdtemp's is owner-only; the artifact gets what mkdir gives
        yield tmp
        # An interrupt between the two renames of a swap would leave the old artifact aside under
        # its hidden name: SIGINT/SIGTERM wait until the swap is done.
        with _signals_deferred():
            _publish(tmp, out, force)
    except BaseException as e:
        if tmp is not None:
            full = _disk_full(e, tmp, out)
            shutil.rmtree(tmp, ignore_errors=True)
        for parent in missing:  # innermost first
            with contextlib.suppress(OSError):
                parent.rmdir()
        if full is not None:
            raise full from e
        raise
    finally:
        if lock is not None:
            os.close(lock)


def _staging_prefix(out: Path) -> str:
    return f".{out.name}.tmp-{os.getpid()}-"


def remove_abandoned(out: Path) -> list[Path]:
    """Remove the staged folders of exports to ``out`` whose process is gone (``kill -9``, a crash of
    the machine); return them. A folder is left alone while its process runs, or while any process
    holds its lock (a process of another PID namespace on a shared disk)."""
    pattern = re.compile(re.escape(f".{out.name}.tmp-") + r"(\d+)-[a-z0-9_]{8}")
    removed = []
    try:
        siblings = list(out.parent.iterdir())
    except OSError:
        return removed
    for sibling in siblings:
        match = pattern.fullmatch(sibling.name)
        if not match or sibling.is_symlink() or not sibling.is_dir():
            continue
        if process_running(int(match.group(1))) or _locked(sibling):
            continue
        shutil.rmtree(sibling, ignore_errors=True)
        removed.append(sibling)
    return removed


def process_running(pid: int) -> bool:
    """Whether process ``pid`` of this host is alive (this one, or another user's, included)."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    except (OverflowError, ValueError):  # no PID at all
        return False
    return True


def _try_lock(folder: Path) -> tuple[int | None, bool]:
    """Open ``folder`` and try its exclusive lock without waiting: (the descriptor, None where it
    cannot be opened or there are no locks; whether another process holds the lock)."""
    try:
        import fcntl

        fd = os.open(folder, os.O_RDONLY)
    except (ImportError, OSError):
        return None, False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return fd, True
    except OSError:  # a file system without locks: the PID alone decides
        pass
    return fd, False


def _hold_lock(folder: Path) -> int | None:
    """An exclusive lock on the staged folder, held while this process lives (the kernel drops it
    when the process dies, however it dies)."""
    return _try_lock(folder)[0]


def _locked(folder: Path) -> bool:
    fd, held_elsewhere = _try_lock(folder)
    if fd is not None:
        os.close(fd)
    return held_elsewhere


_PROBE_BYTES = 1 << 20


def _disk_full(error: BaseException, tmp: Path, out: Path) -> OSError | None:
    """The OSError(ENOSPC) to report where ``error`` is a full disk that the library that wrote
    hid: numpy's ``tofile`` (ONNX external data, through onnx_ir) raises ``OSError("problem writing
    element ...")`` without an errno, and other libraries wrap the OSError in their own exception.
    An errno-less write error is a full disk if a write of 1 MiB beside it fails so too."""
    if not isinstance(error, Exception):  # an interrupt is an interrupt
        return None
    chain, seen = error, set()
    while chain is not None and id(chain) not in seen:
        seen.add(id(chain))
        if isinstance(chain, OSError) and chain.errno in (errno.ENOSPC, errno.EDQUOT):
            return None if chain is error else OSError(chain.errno, chain.strerror, chain.filename or str(out))
        chain = chain.__cause__ or chain.__context__
    if not isinstance(error, OSError) or error.errno is not None:
        return None
    probe = tmp / ".kvexport-space-probe"
    try:
        with open(probe, "wb") as f:
            f.write(b"\0" * _PROBE_BYTES)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            return OSError(e.errno, e.strerror, str(out))
    return None


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


def _publish(tmp: Path, out: Path, force: bool) -> None:
    try:
        # Atomic, and refused by the kernel where out is a folder with files (or a file): two
        # exports to one output never silently replace one another.
        os.rename(tmp, out)
        return
    except OSError as e:
        if e.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
            raise
    if not force:
        raise InvalidOptionError(
            f"output {out} already exists: it appeared while this export ran (another export to the same -o?); "
            "it is left as it is and this export's files are discarded: pass --force to replace it, or choose another -o"
        )
    if not out.is_dir() or out.is_symlink() or (not (out / MANIFEST).is_file() and any(out.iterdir())):
        raise InvalidOptionError(
            f"output {out} appeared while this export ran and is not a kvexport artifact; --force replaces only "
            "artifacts, choose another -o"
        )
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
