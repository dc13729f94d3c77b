"""``kvexport.json``: what an artifact folder holds (program, weights, tokenizer files, each with its
sha256) and how to run it; written by the exporter, read and verified by every runtime."""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
from pathlib import Path

from ..choices import Target
from ..errors import ArtifactError

MANIFEST = "kvexport.json"
# The targets an artifact can be for (the exporter has one subpackage each).
TARGETS = tuple(t.value for t in Target)
# The manifest's own sha256, in sha256sum's format: the manifest lists every other file's sum, and
# a flipped digit in it (a cache length, a window) would otherwise go unnoticed.
MANIFEST_SUM = "kvexport.json.sha256"
FORMAT = "kvexport-artifact"
FORMAT_VERSION = 6  # what each version changed: CHANGELOG.md#artifact-format
# The versions each target still runs (a version that changed only the other target's files).
_READABLE_VERSIONS = {"executorch": (1, 2, 3, 4, 5, 6), "onnx": (6,)}
# Where an artifact's model came from (``models.model_source.ModelSource.kind``): check loads it again.
SOURCE_KINDS = ("preset", "alias", "folder", "gguf", "hub")
_EDITED = "the manifest was edited or damaged, re-run kvexport export"


def buffer_layers(layers: list[dict]) -> list[dict]:
    """The layers that hold a KV cache of their own, in order (a ``shared`` layer reads an earlier
    layer's, a ``conv`` layer holds a convolution's state): an ONNX graph's n-th past and present
    buffers are the n-th of these."""
    return [layer for layer in layers if layer["cache"] in ("static", "ring")]


def state_layers(layers: list[dict]) -> list[dict]:
    """The layers that hold a state (``conv``, ``recurrent``), in order: those instead of a KV cache,
    and a hybrid layer's ``mixer`` (Falcon-H1) beside its KV cache, as an entry of its own with the
    layer's index. An ONNX graph passes their states after every KV buffer."""
    states = []
    for layer in layers:
        if layer["cache"] in ("conv", "recurrent"):
            states.append(layer)
        elif isinstance(layer.get("mixer"), dict):
            states.append({"index": layer["index"], "layer_type": layer["layer_type"], **layer["mixer"]})
    return states


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
    """The folder's manifest, checked: format, version, every field a runtime reads (types, ranges and
    how they fit together), and the listed files present, regular files of the folder (no symlinks)
    and (``verify``) intact. What only the program can confirm (its shapes, its metadata) is checked
    where it loads (``runtime/onnx_program.py``, ``runtime/executorch_program.py``)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ArtifactError(f"{folder} is not a folder; give the folder kvexport export wrote")
    path = folder / MANIFEST
    _refuse_a_link(folder, MANIFEST)
    if not path.is_file():
        raise ArtifactError(f"{folder} has no {MANIFEST}; it is not a kvexport artifact (re-run kvexport export)")
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise ArtifactError(f"{path} is not valid JSON ({str(e) or 'nested too deeply'}); re-run kvexport export")
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ArtifactError(f"{path} is not a kvexport manifest; re-run kvexport export")
    target = manifest.get("target")
    readable = _READABLE_VERSIONS.get(target, (FORMAT_VERSION,)) if isinstance(target, str) else (FORMAT_VERSION,)
    version = manifest.get("format_version")
    if not _count(version) or version not in readable:
        raise ArtifactError(
            f"{path} has format version {_shown(version)}, this kvexport reads "
            f"{' or '.join(map(str, readable))} for {target if isinstance(target, str) else _shown(target)} artifacts; "
            "re-export with this version"
        )
    # Folders exported before the manifest had its own sum have none: their files are still checked.
    _refuse_a_link(folder, MANIFEST_SUM)
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
            raise ArtifactError(f"{path}: '{key}' should be {expected}, not {_shown(manifest[key])}; {_EDITED}")
    _check_details(path, manifest)
    for key in ("program", "weights", "external_data", "genai_config"):  # the files a runtime opens
        name = manifest.get(key)
        if name is not None and (not isinstance(name, str) or name not in manifest["files"]):
            shown = name if isinstance(name, str) and name.isprintable() else _shown(name)
            raise ArtifactError(f"{path} does not list its {key} file {shown} among its files; re-run kvexport export")
    for name, entry in manifest["files"].items():
        file = folder / name
        _refuse_a_link(folder, name)
        try:
            mode = file.stat().st_mode
        except FileNotFoundError:
            raise ArtifactError(f"{folder} is missing {name}, listed in {MANIFEST}; re-run kvexport export")
        except OSError as e:
            raise ArtifactError(f"{folder}: cannot read {name}, listed in {MANIFEST} ({e.strerror}); re-run kvexport export")
        if not stat.S_ISREG(mode):
            raise ArtifactError(f"{file} is not a regular file, yet {MANIFEST} lists it; {_EDITED}")
        if verify and (file.stat().st_size != entry["bytes"] or sha256_file(file) != entry["sha256"]):
            raise ArtifactError(
                f"{file} does not match the sha256 in {MANIFEST}: the file is corrupt or was changed; "
                "copy the artifact again or re-run kvexport export"
            )
    return manifest


def read_listed_file(folder: Path, manifest: dict, name: str) -> bytes | None:
    """The bytes of a file the manifest lists, checked against its sha256 as read (what is used is
    what was verified); ``None`` where the manifest does not list it, whatever the folder holds."""
    entry = manifest["files"].get(name)
    if entry is None:
        return None
    _refuse_a_link(Path(folder), name)
    path = Path(folder) / name
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ArtifactError(f"{Path(folder)}: cannot read {name}, listed in {MANIFEST} ({e.strerror}); re-run kvexport export")
    if len(data) != entry["bytes"] or hashlib.sha256(data).hexdigest() != entry["sha256"]:
        raise ArtifactError(
            f"{path} does not match the sha256 in {MANIFEST}: the file is corrupt or was changed; "
            "copy the artifact again or re-run kvexport export"
        )
    return data


def program_mismatch(what: str, says, has) -> ArtifactError:
    """The error for a manifest that disagrees with the program it describes (the runtimes check it)."""
    return ArtifactError(f"{MANIFEST} says {what} {says} but the program has {has}; the manifest was edited or damaged, re-export")


def _refuse_a_link(folder: Path, name: str) -> None:
    # A symlink would make run read (and pack copy) a file outside the folder, through the artifact.
    if (folder / name).is_symlink():
        raise ArtifactError(
            f"{folder / name} is a symbolic link; an artifact's files must be regular files inside its folder: "
            "copy the artifact with its files (cp -L), or re-run kvexport export"
        )


def _shown(value) -> str:
    return json.dumps(value)[:60]


def _check_details(path: Path, manifest: dict) -> None:
    """What the types alone do not say: ranges, and the fields that must agree with one another."""

    def refuse(key: str, expected: str, value):
        raise ArtifactError(f"{path}: '{key}' should be {expected}, not {_shown(value)}; {_EDITED}")

    max_cache_len = manifest["max_cache_len"]
    layers = manifest["layers"]
    if not layers:
        refuse("layers", "a list of layer caches, one a layer", layers)
    for i, layer in enumerate(layers):
        window = layer.get("window")
        shared = layer["cache"] == "shared"
        if shared and not (_count(layer.get("reads")) and layer["reads"] < i and layers[layer["reads"]]["cache"] != "shared"):
            refuse(f"layers[{i}].reads", "the index of an earlier layer that holds a cache", layer.get("reads"))
        if layer["cache"] == "ring" and (window is None or window >= max_cache_len):
            refuse(f"layers[{i}].window", f"a window below max_cache_len ({max_cache_len}) for a ring cache", window)
        if "chunk" in layer and layer["chunk"] != window:  # a chunked layer's ring holds one chunk
            refuse(f"layers[{i}].chunk", f"its window ({window})", layer["chunk"])
        if layer["cache"] == "static" and window is not None and window < max_cache_len:
            refuse(f"layers[{i}].cache", f'"ring" for a window of {window} below max_cache_len ({max_cache_len})', layer["cache"])
        mixer = layer.get("mixer")  # a hybrid layer's state (state_layers): the runtimes size it from these
        if mixer is not None and not (
            isinstance(mixer, dict) and mixer.get("cache") in ("conv", "recurrent")
            and all(_count(mixer.get(field), 1) for field in ("channels", "slots"))
            and (mixer["cache"] == "conv" or _sizes(mixer.get("state")))
        ):  # fmt: skip
            refuse(f"layers[{i}].mixer", "a state: its cache, channels, slots and (recurrent) state sizes", mixer)
        # ONNX runtimes name and shape each layer's buffers from these (runtime/onnx_program.py
        # requires them).
        for field in ("index", "kv_heads", "head_dim", "slots", "channels"):
            if field not in layer:
                continue
            value = layer.get(field)
            if field == "index" and not (_count(value) and value == i):
                refuse(f"layers[{i}].index", f"{i}, its place in the list", value)
            if field == "slots" and shared and value != 0:
                refuse(f"layers[{i}].slots", "0 for a layer that holds no cache", value)
            elif field != "index" and not (field == "slots" and shared) and not _count(value, 1):
                refuse(f"layers[{i}].{field}", "a positive integer", value)
    interface = manifest.get("interface")
    if "interface" in manifest:
        if not isinstance(interface, dict):
            refuse("interface", "the program's inputs and outputs", interface)
        for key in ("inputs", "outputs"):
            entries = interface.get(key)
            if key in interface and not (
                isinstance(entries, list) and all(isinstance(e, dict) and isinstance(e.get("name"), str) for e in entries)
            ):
                refuse(f"interface.{key}", "a list of named tensors", entries)
        calls = interface.get("max_tokens_per_call")
        if calls is not None and not (_count(calls, 1) and calls <= max_cache_len):  # null: as if absent
            refuse("interface.max_tokens_per_call", f"a positive integer at most max_cache_len ({max_cache_len})", calls)
    source = manifest["source"]
    if source.get("kind") is not None and source["kind"] not in SOURCE_KINDS:
        refuse("source.kind", " or ".join(map(repr, SOURCE_KINDS)), source["kind"])
    # check resolves these again (and names them in its messages): one line of text each.
    if not (source["name"] and source["name"].isprintable()):
        refuse("source.name", "the model's name", source["name"])
    for key in ("path", "revision", "commit", "gguf_file"):
        if source.get(key) is not None and not (isinstance(source[key], str) and source[key] and source[key].isprintable()):
            refuse(f"source.{key}", "text", source[key])
    optional = {
        "bos_token_id": (lambda v: v is None or _count(v), "a token id"),
        "tokenizer_adds_bos": (lambda v: isinstance(v, bool), "true or false"),
        "versions": (lambda v: isinstance(v, dict) and all(isinstance(x, str) for x in v.values()), "package -> version"),
        "quantization": (_quantization, "the quantization scheme"),
        "export_options": (lambda v: isinstance(v, dict), "the export's options"),
        "model_type": (lambda v: isinstance(v, str), "text"),
        "genai_unsupported": (lambda v: isinstance(v, str) and v.isprintable(), "text (why genai cannot run the folder)"),
        "kv_cache_bytes": (_count, "a number of bytes"),
        "kv_cache": (lambda v: isinstance(v, dict) and v.get("dtype") == "int8", "the KV cache's element type (int8)"),
        "max_draft_tokens": (lambda v: _count(v, 1), "a positive number of drafted tokens a call verifies"),
    }
    for key, (valid, expected) in optional.items():
        if key in manifest and not valid(manifest[key]):
            refuse(key, expected, manifest[key])


def _sizes(value) -> bool:
    """A list of positive sizes (a recurrent state's shape)."""
    return isinstance(value, list) and bool(value) and all(_count(x, 1) for x in value)


def _quantization(value) -> bool:
    if value is None:
        return True
    return (
        isinstance(value, dict)
        and (value.get("scheme") is None or isinstance(value["scheme"], str))
        and all(value.get(part) is None or isinstance(value[part], dict) for part in ("linear", "lm_head", "embedding"))
    )


def _count(value, minimum: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def _file_entry(name, entry) -> bool:
    # Plain names only: a manifest must not point run/check outside its folder.
    return (
        _plain_name(name)
        and name not in (MANIFEST, MANIFEST_SUM)
        and isinstance(entry, dict)
        and isinstance(entry.get("sha256"), str)
        and re.fullmatch("[0-9a-f]{64}", entry["sha256"]) is not None
        and _count(entry.get("bytes"))
    )


def _plain_name(name: str) -> bool:
    """A file name of the folder itself: no folder part, nothing the OS cannot take."""
    try:
        encoded = os.fsencode(name)
    except UnicodeError:
        return False
    return (
        name not in ("", ".", "..")
        and Path(name).name == name
        and name.isprintable()  # no NUL, no line break: names show in one-line messages
        and len(encoded) <= 255
    )


def _layer(layer) -> bool:
    return isinstance(layer, dict) and layer.get("cache") in ("ring", "static", "shared", "conv", "recurrent", "none") and (
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
