"""Where kvexport writes, checked before any work starts and written whole or not at all: every
output option (``export -o``, ``--profile``, ``matrix --report`` / ``--json`` / ``--work-dir``,
``bench --json`` / ``--markdown``, ``KVEXPORT_CACHE``) goes through ``check_writable``, and each
file is written by ``write_text`` (a hidden sibling renamed into place). A place that cannot be
written is one ``kvexport: error:`` line, before hours of work rather than after. Standard library
only.
"""

from __future__ import annotations

import contextlib
import errno
import os
import tempfile
from pathlib import Path

from .errors import InvalidOptionError


def check_writable(path: Path, option: str, kind: str = "file", fix: str | None = None) -> None:
    """Refuse in one line a ``path`` that ``option`` cannot write. ``kind``: ``file`` (a file made or
    replaced), ``folder`` (a folder made or replaced whole, beside which it is built), ``in`` (a
    folder that files are written in). Refused: a file where a folder must be or under one, a folder
    where a file must be, a place where no new entry can be made. Missing parents are fine: the
    writer makes them. ``fix``: what to do (default: choose another ``option``)."""
    path = Path(path)
    fix = fix or f"choose another {option}"
    if kind == "in" and (path.exists() or path.is_symlink()) and not path.is_dir():
        raise InvalidOptionError(f"cannot write in {path}: it is a file, not a folder; {fix}")
    if kind == "file" and path.is_dir():
        raise InvalidOptionError(f"{option} {path} is a folder; {option} names a file to write, e.g. {path / 'NAME'}")
    where = path if kind == "in" and path.is_dir() else existing_ancestor(path)
    if not where.is_dir():
        raise InvalidOptionError(f"cannot write {path}: {where} is a file, not a folder; {fix}")
    # os.access says yes to root everywhere; making an entry is the only honest test (read-only
    # mounts, /sys, /proc, full quotas).
    try:
        os.rmdir(tempfile.mkdtemp(dir=where, prefix=".kvexport-probe-"))
    except OSError as e:
        raise InvalidOptionError(
            f"cannot write {path}: {where} refuses new {'files' if kind == 'file' else 'folders'} ({e.strerror}); {fix}"
        )


def existing_ancestor(path: Path) -> Path:
    """The path's parent, or its nearest ancestor that exists (the missing parents are made)."""
    parent = Path(path).absolute().parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    return parent


def write_text(path: Path, text: str, option: str) -> None:
    """Write ``text`` to ``path`` whole or not at all (its missing parents made), failing in one line."""
    write_file(path, option, lambda tmp: tmp.write_text(text))


def write_file(path: Path, option: str, write) -> None:
    """``write(tmp)`` a hidden sibling of ``path``, then rename it into place: ``path`` is whole or
    as it was. An OSError (a full disk, a folder made read-only meanwhile) is one line."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    missing = [p for p in path.absolute().parents if not p.exists()]
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write(tmp)
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        for parent in missing:  # innermost first
            with contextlib.suppress(OSError):
                parent.rmdir()
        if isinstance(e, OSError):
            raise _write_error(path, option, e) from None
        raise


def _write_error(path: Path, option: str, error: OSError) -> InvalidOptionError:
    hint = "free some space or choose another" if error.errno in (errno.ENOSPC, errno.EDQUOT) else "choose another"
    return InvalidOptionError(f"cannot write {path}: {error.strerror or error}; {hint} {option}")
