"""One-file artifacts: ``kvexport pack`` writes an artifact folder as a tar archive, and the runners
open a folder or an archive alike, every file checked against its sha256 in ``kvexport.json``
before anything loads.

The archive holds ``NAME/kvexport.json`` first, then the files it lists, all under one folder
named like the artifact, so ``tar xf`` gives the folder back. It is uncompressed unless its name
ends in ``.tar.gz`` or ``.tgz`` (weights hardly compress). Standard library only: it runs on the
device.
"""

from __future__ import annotations

import contextlib
import errno
import gzip
import os
import shutil
import tarfile
import tempfile
import zlib
from collections.abc import Iterator
from pathlib import Path, PurePosixPath

from ..errors import ArtifactError, InvalidOptionError
from .manifest import MANIFEST, MANIFEST_SUM, read_manifest, sha256_file


def pack(folder: Path, out: Path | None = None, force: bool = False) -> tuple[Path, str]:
    """Write the artifact folder as one archive (default ``FOLDER.tar`` beside it); return its path and sha256."""
    folder = Path(folder).resolve()
    manifest = read_manifest(folder, verify=True)  # never pack a corrupt artifact
    out = Path(out) if out else folder.with_name(folder.name + ".tar")
    parent = out.absolute().parent
    if not parent.is_dir():
        raise InvalidOptionError(f"cannot write {out}: folder {parent} does not exist")
    # The output's real place (its folder's symlinks resolved; a symlink as the output itself is replaced, not followed).
    where = parent.resolve() / out.name
    if where == folder or folder in where.parents:
        raise InvalidOptionError(
            f"output {out} is inside the artifact folder {folder}: the archive would replace or add to what it packs; "
            "choose an -o outside it"
        )
    if out.is_dir():
        raise InvalidOptionError(f"output {out} is a folder; -o names the archive file, e.g. {out / (folder.name + '.tar')}")
    if (out.exists() or out.is_symlink()) and not force:
        raise InvalidOptionError(f"output {out} already exists; pass --force to replace it")
    mode = "w:gz" if out.name.endswith((".tar.gz", ".tgz")) else "w"
    # Written beside the output and renamed into place: an interrupted pack leaves no partial archive.
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        with tarfile.open(tmp, mode) as tar:
            sums = [MANIFEST, MANIFEST_SUM] if (folder / MANIFEST_SUM).is_file() else [MANIFEST]
            for name in [*sums, *manifest.files]:  # the manifest first: it lists what follows
                tar.add(folder / name, arcname=f"{folder.name}/{name}", recursive=False)
        os.replace(tmp, out)
    except OSError as e:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        if e.filename is not None and Path(e.filename) not in (tmp, out):
            raise  # not the archive: a file of the artifact that could not be read
        hint = "free some space or choose another -o" if e.errno in (errno.ENOSPC, errno.EDQUOT) else "choose another -o"
        raise InvalidOptionError(f"cannot write {out}: {e.strerror or e}; {hint}") from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return out, sha256_file(out)


@contextlib.contextmanager
def open_artifact(path: Path) -> Iterator[tuple[Path, dict]]:
    """``(folder, manifest)`` for an artifact folder or archive, every file verified. An archive is
    unpacked into a temporary folder, removed on exit."""
    path = Path(path)
    if path.is_dir():
        yield path, read_manifest(path, verify=True)
        return
    if not path.is_file():
        raise ArtifactError(f"{path} does not exist; give an artifact folder or an archive from kvexport pack")
    with tempfile.TemporaryDirectory(prefix="kvexport-") as tmp:
        folder = _unpack(path, Path(tmp))
        try:
            manifest = read_manifest(folder, verify=True)
        except ArtifactError as e:  # name the file inside the archive, not the temporary folder
            raise ArtifactError(f"archive {path}: {str(e).replace(str(folder), folder.name)}") from None
        yield folder, manifest


def _unpack(archive: Path, into: Path) -> Path:
    """Extract the archive's files into ``into``; return the artifact folder. Only regular files
    directly under one top folder are accepted, so nothing can land outside ``into``."""
    try:
        tar = tarfile.open(archive, "r:*")  # plain or gzipped
    except tarfile.TarError:
        raise ArtifactError(f"{archive} is not a tar archive; give an artifact folder or an archive from kvexport pack")
    top = None
    try:
        with tar:
            for member in tar:
                path = PurePosixPath(member.name)
                parts = path.parts
                if (
                    not member.isfile()
                    or path.is_absolute()
                    or len(parts) != 2
                    or {".", ".."} & set(parts)
                    or parts[0] != (top or parts[0])
                ):
                    raise ArtifactError(
                        f"{archive} is not a kvexport archive (unexpected member {member.name!r}); make it with kvexport pack"
                    )
                if top is None:
                    top = parts[0]
                    (into / top).mkdir()
                with tar.extractfile(member) as src, open(into / top / parts[1], "wb") as dst:
                    shutil.copyfileobj(src, dst, 1 << 20)
    except (tarfile.TarError, EOFError, zlib.error, gzip.BadGzipFile) as e:
        raise ArtifactError(f"{archive} is truncated or corrupt ({e}); copy it again or pack it again")
    except OSError as e:  # where it is unpacked (TMPDIR): full, or a name it cannot take
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise ArtifactError(
                f"cannot unpack {archive} into {into.parent}: {e.strerror}; free some space or set TMPDIR to a folder with room"
            )
        raise ArtifactError(f"cannot unpack {archive} into {into.parent} ({e.strerror or e}); is it an archive from kvexport pack?")
    if top is None:
        raise ArtifactError(f"{archive} is empty; make it with kvexport pack")
    return into / top
