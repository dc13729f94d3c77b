"""The artifact folder: program, tokenizer files and ``kvexport.json``, published atomically.

A folder is built under a hidden temporary sibling and renamed into place only once complete, so
an export that fails or is interrupted leaves nothing at the output path, and a previous artifact
there stays intact until the new one is whole.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from ..errors import ArtifactError, InvalidOptionError

MANIFEST = "kvexport.json"
# The manifest's own sha256, in sha256sum's format: the manifest lists every other file's sum, and
# a flipped digit in it (a cache length, a window) would otherwise go unnoticed.
MANIFEST_SUM = "kvexport.json.sha256"
FORMAT = "kvexport-artifact"
FORMAT_VERSION = 1


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def file_entries(folder: Path) -> dict:
    """sha256 and size of every file in the folder but the manifest."""
    return {
        p.name: {"sha256": sha256_file(p), "bytes": p.stat().st_size}
        for p in sorted(folder.iterdir())
        if p.is_file() and p.name not in (MANIFEST, MANIFEST_SUM)
    }


def write_manifest(folder: Path, manifest: dict) -> None:
    manifest = {"format": FORMAT, "format_version": FORMAT_VERSION, **manifest, "files": file_entries(folder)}
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=False) + "\n")
    (folder / MANIFEST_SUM).write_text(f"{sha256_file(folder / MANIFEST)}  {MANIFEST}\n")


def check_output_path(out: Path, force: bool) -> None:
    """Refuse up front an output that exists (without ``--force``) or cannot be written."""
    if out.exists() and not force:
        raise InvalidOptionError(f"output {out} already exists; pass --force to replace it")
    if out.exists() and not out.is_dir():
        raise InvalidOptionError(f"output {out} exists and is not a folder")
    parent = out.absolute().parent
    if not parent.is_dir():
        raise InvalidOptionError(f"cannot write {out}: folder {parent} does not exist")
    if not os.access(parent, os.W_OK):
        raise InvalidOptionError(f"cannot write {out}: folder {parent} is not writable")


@contextlib.contextmanager
def staged_folder(out: Path):
    """Yield an empty temporary folder beside ``out``; on success move it to ``out``.

    On any exception (KeyboardInterrupt and SystemExit included) the temporary folder is removed
    and ``out`` is left as it was.
    """
    out = out.absolute()
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp-"))
    try:
        yield tmp
        _publish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


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


def read_manifest(folder: Path, verify: bool = True) -> dict:
    """The folder's manifest, checked: format, version, listed files present and (``verify``) intact."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ArtifactError(f"{folder} is not a folder (expected a kvexport artifact folder)")
    path = folder / MANIFEST
    if not path.is_file():
        raise ArtifactError(f"{folder} has no {MANIFEST}; it is not a kvexport artifact (re-run kvexport export)")
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ArtifactError(f"{path} is not valid JSON ({e}); re-run kvexport export")
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ArtifactError(f"{path} is not a kvexport manifest; re-run kvexport export")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise ArtifactError(
            f"{path} has format version {manifest.get('format_version')}, this kvexport reads {FORMAT_VERSION}; "
            "re-export with this version"
        )
    # Folders exported before the manifest had its own sum have none: their files are still checked.
    sum_file = folder / MANIFEST_SUM
    if verify and sum_file.is_file() and sum_file.read_bytes().split()[:1] != [sha256_file(path).encode()]:
        raise ArtifactError(f"{path} does not match {MANIFEST_SUM}: the manifest is corrupt or was changed")
    for key in ("target", "program", "max_cache_len", "vocab_size", "eos_token_ids", "files", "dtype"):
        if key not in manifest:
            raise ArtifactError(f"{path} lacks '{key}'; re-run kvexport export")
    if manifest["program"] not in manifest["files"]:
        raise ArtifactError(f"{path} does not list its program {manifest['program']} among its files")
    for name, entry in manifest["files"].items():
        file = folder / name
        if not file.is_file():
            raise ArtifactError(f"{folder} is missing {name}, listed in {MANIFEST}")
        if verify and (file.stat().st_size != entry["bytes"] or sha256_file(file) != entry["sha256"]):
            raise ArtifactError(f"{file} does not match the sha256 in {MANIFEST}: the file is corrupt or was changed")
    return manifest
