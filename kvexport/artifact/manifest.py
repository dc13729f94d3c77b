"""``kvexport.json``: what an artifact folder holds (program, weights, tokenizer files, each with its
sha256) and how to run it; written by the exporter, read and verified by every runtime."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from ..errors import ArtifactError

MANIFEST = "kvexport.json"
# The targets an artifact can be for (the exporter has one subpackage each).
TARGETS = ("executorch", "onnx")
# The manifest's own sha256, in sha256sum's format: the manifest lists every other file's sum, and
# a flipped digit in it (a cache length, a window) would otherwise go unnoticed.
MANIFEST_SUM = "kvexport.json.sha256"
FORMAT = "kvexport-artifact"
FORMAT_VERSION = 5  # what each version changed: CHANGELOG.md#artifact-format
# The versions each target still runs (a version that changed only the other target's files).
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
