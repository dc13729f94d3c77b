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
import signal
import tempfile
import threading
from pathlib import Path

from ..errors import ArtifactError, InvalidOptionError

MANIFEST = "kvexport.json"
# The targets an artifact can be for (the exporter has one subpackage each).
TARGETS = ("executorch", "onnx")
# The manifest's own sha256, in sha256sum's format: the manifest lists every other file's sum, and
# a flipped digit in it (a cache length, a window) would otherwise go unnoticed.
MANIFEST_SUM = "kvexport.json.sha256"
FORMAT = "kvexport-artifact"
# 2: an ONNX graph's full-attention layers take and return the whole head-major buffer
# (GroupQueryAttention); version 1 took the filled prefix, sequence-major, and returned new rows.
# 3: so do its sliding layers, over a buffer of 2 * window rows from row ring_start (an input);
# version 2 took the whole ring, sequence-major, and returned the new rows.
# 4: a call takes at most interface.max_tokens_per_call tokens (--prefill-chunk), which a `.pte`
# now enforces (its memory is planned for it); before, an ExecuTorch artifact took max_cache_len.
# 5: an ONNX graph's attention kernels take their total lengths as inputs in host memory
# (total_length, ring_total_length), which onnxruntime-gpu needs; 3 and 4 still run on the CPU.
FORMAT_VERSION = 5
# The versions each target still runs: 2, 3 and 5 changed nothing in an ExecuTorch artifact, and 4
# nothing in an ONNX graph (its interface already had max_tokens_per_call).
_READABLE_VERSIONS = {"executorch": (1, 2, 3, 4, 5), "onnx": (3, 4, 5)}


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


def read_manifest(folder: Path, verify: bool = True) -> dict:
    """The folder's manifest, checked: format, version, listed files present and (``verify``) intact."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ArtifactError(f"{folder} is not a folder; give the folder kvexport export wrote")
    path = folder / MANIFEST
    if not path.is_file():
        raise ArtifactError(f"{folder} has no {MANIFEST}; it is not a kvexport artifact (re-run kvexport export)")
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ArtifactError(f"{path} is not valid JSON ({e}); re-run kvexport export")
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ArtifactError(f"{path} is not a kvexport manifest; re-run kvexport export")
    readable = _READABLE_VERSIONS.get(manifest.get("target"), (FORMAT_VERSION,))
    if manifest.get("format_version") not in readable:
        raise ArtifactError(
            f"{path} has format version {manifest.get('format_version')}, this kvexport reads "
            f"{' or '.join(map(str, readable))} for {manifest.get('target')} artifacts; re-export with this version"
        )
    # Folders exported before the manifest had its own sum have none: their files are still checked.
    sum_file = folder / MANIFEST_SUM
    if verify and sum_file.is_file() and sum_file.read_bytes().split()[:1] != [sha256_file(path).encode()]:
        raise ArtifactError(
            f"{path} does not match {MANIFEST_SUM}: the manifest is corrupt or was changed; "
            "copy the artifact again or re-run kvexport export"
        )
    for key, (valid, expected) in _FIELDS.items():
        if key not in manifest:
            raise ArtifactError(f"{path} lacks '{key}'; re-run kvexport export")
        if not valid(manifest[key]):
            raise ArtifactError(
                f"{path}: '{key}' should be {expected}, not {json.dumps(manifest[key])[:60]}; "
                "the manifest was edited or damaged, re-run kvexport export"
            )
    for key in ("program", "weights", "external_data"):  # the files a runtime opens
        name = manifest.get(key)
        if name is not None and (not isinstance(name, str) or name not in manifest["files"]):
            raise ArtifactError(f"{path} does not list its {key} file {name} among its files; re-run kvexport export")
    for name, entry in manifest["files"].items():
        file = folder / name
        if not file.is_file():
            raise ArtifactError(f"{folder} is missing {name}, listed in {MANIFEST}; re-run kvexport export")
        if verify and (file.stat().st_size != entry["bytes"] or sha256_file(file) != entry["sha256"]):
            raise ArtifactError(
                f"{file} does not match the sha256 in {MANIFEST}: the file is corrupt or was changed; "
                "copy the artifact again or re-run kvexport export"
            )
    return manifest


def _count(value, minimum: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def _file_entry(name, entry) -> bool:
    # Plain names only: a manifest must not point run/check outside its folder.
    return (
        name not in ("", ".", "..")
        and Path(name).name == name
        and isinstance(entry, dict)
        and isinstance(entry.get("sha256"), str)
        and _count(entry.get("bytes"))
    )


def _layer(layer) -> bool:
    return isinstance(layer, dict) and layer.get("cache") in ("ring", "static") and (
        layer.get("window") is None or _count(layer.get("window"), 1)
    )


# What run and check read from kvexport.json: key -> (test, what it should be).
_FIELDS = {
    "target": (lambda v: v in TARGETS, " or ".join(map(repr, TARGETS))),
    "program": (lambda v: isinstance(v, str), "a file name"),
    "dtype": (lambda v: v in ("float32", "float16", "bfloat16"), "float32, float16 or bfloat16"),
    "max_cache_len": (lambda v: _count(v, 1), "a positive integer"),
    "vocab_size": (lambda v: _count(v, 1), "a positive integer"),
    "eos_token_ids": (lambda v: isinstance(v, list) and all(_count(i) for i in v), "a list of token ids"),
    "layers": (lambda v: isinstance(v, list) and all(_layer(x) for x in v), "a list of layer caches"),
    "source": (lambda v: isinstance(v, dict) and isinstance(v.get("name"), str), "the source model"),
    "files": (
        lambda v: isinstance(v, dict) and all(_file_entry(n, e) for n, e in v.items()),
        "file name -> {sha256, bytes}",
    ),
}
