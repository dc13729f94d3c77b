"""``kvexport.json``: what an artifact folder holds (program, weights, tokenizer files, each with its
sha256) and how to run it; written by the exporter, read and verified by every runtime."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..choices import Dtype, Target
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


def _to_json(value, always: tuple[str, ...] = ()) -> dict:
    """A manifest dataclass as JSON, its fields in declaration order (the file's); a field that is
    None is left out unless ``always`` writes it (as null)."""
    out = {}
    for f in dataclasses.fields(value):
        item = getattr(value, f.name)
        if item is None and f.name not in always:
            continue
        out[f.name] = _json_value(item)
    return out


def _from_json(cls, data: dict, **nested):
    """``cls`` from a JSON object: its fields' keys (others are not read), lists as tuples, the
    ``nested`` fields through their own type."""
    values = {}
    for f in dataclasses.fields(cls):
        value = data.get(f.name)
        if value is not None and f.name in nested:
            value = nested[f.name].from_json(value)
        values[f.name] = tuple(value) if isinstance(value, list) else value
    return cls(**values)


def _json_value(item):
    if hasattr(item, "to_json"):
        return item.to_json()
    if isinstance(item, (list, tuple)):
        return [_json_value(x) for x in item]
    if isinstance(item, dict):
        return {k: _json_value(v) for k, v in item.items()}
    return item


@dataclass(frozen=True)
class FileEntry:
    """A file of the artifact: its sha256 and size."""

    sha256: str
    bytes: int

    def to_json(self) -> dict:
        return _to_json(self)


@dataclass(frozen=True)
class Source:
    """Where the artifact's model came from (``check`` loads it again): a preset, an alias, a local
    folder or GGUF file, or a Hub model at the commit it was exported from."""

    name: str
    kind: str | None = None
    path: str | None = None
    revision: str | None = None
    commit: str | None = None
    gguf_file: str | None = None

    @classmethod
    def from_json(cls, data: dict) -> Source:
        return _from_json(cls, data)

    def to_json(self) -> dict:
        # revision goes with commit (a Hub model), even where it was not named (null)
        return _to_json(self, always=("kind", "path") + ("revision",) * (self.commit is not None))


@dataclass(frozen=True)
class State:
    """A hybrid layer's second state, beside its KV cache (Falcon-H1's Mamba-2 mixer): a
    convolution's ``[1, channels, slots]`` and, for ``recurrent``, a recurrent state's shape."""

    cache: str
    slots: int | None = None
    channels: int | None = None
    state: tuple[int, ...] | None = None

    @classmethod
    def from_json(cls, data: dict) -> State:
        return _from_json(cls, data)

    def to_json(self) -> dict:
        return _to_json(self)


@dataclass(frozen=True)
class Layer:
    """One decoder layer's entry: the cache it holds (``static``, ``ring``, ``shared``, ``conv``,
    ``recurrent`` or ``none``), its window, and the sizes a runtime builds its buffers from."""

    index: int | None = None
    layer_type: str | None = None
    cache: str = "none"
    reads: int | None = None  # a shared layer: the earlier layer whose cache it reads
    window: int | None = None
    chunk: int | None = None
    slots: int | None = None
    channels: int | None = None
    kv_heads: int | None = None
    head_dim: int | None = None
    state: tuple[int, ...] | None = None  # a recurrent state's shape
    mixer: State | None = None

    @classmethod
    def from_json(cls, data: dict) -> Layer:
        return _from_json(cls, data, mixer=State)

    def to_json(self) -> dict:
        return _to_json(self, always=("window",))

    @property
    def holds_kv(self) -> bool:
        """Holds a KV cache of its own (a ``shared`` layer reads another's)."""
        return self.cache in ("static", "ring")


@dataclass(frozen=True)
class Interface:
    """The program's inputs and outputs as the manifest describes them (each a dict of name, dtype,
    shape and what it means) and how calls follow one another."""

    inputs: tuple[dict, ...] | None = None
    outputs: tuple[dict, ...] | None = None
    symbols: Any = None
    calls: str | None = None
    max_tokens_per_call: int | None = None
    convention: Any = None
    cache: Any = None

    @classmethod
    def from_json(cls, data: dict) -> Interface:
        return _from_json(cls, data)

    def to_json(self) -> dict:
        return _to_json(self)

    def names(self, kind: str) -> list[str]:
        """The names of the ``inputs`` or the ``outputs``, in order."""
        return [entry["name"] for entry in getattr(self, kind) or ()]


@dataclass(frozen=True)
class Manifest:
    """``kvexport.json``, read and checked (``read_manifest``) or about to be written
    (``write_manifest``); ``None`` where the file has no such key. Descriptive parts a runtime does
    not interpret (the export's options, the quantization, the versions) stay JSON objects; what a
    target's lowering recorded beyond these fields is in ``facts``, in the order it was written."""

    target: Target
    source: Source
    dtype: Dtype
    max_cache_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    layers: tuple[Layer, ...]
    program: str
    files: dict[str, FileEntry]
    format_version: int = FORMAT_VERSION
    export_options: dict | None = None
    model_type: str | None = None
    quantization: dict | None = None
    bos_token_id: int | None = None
    tokenizer_adds_bos: bool | None = None
    kv_cache: dict | None = None
    kv_cache_bytes: int | None = None
    kv_cache_bytes_if_all_full: int | None = None
    state_bytes: int | None = None
    max_draft_tokens: int = 0
    interface: Interface | None = None
    versions: dict = dataclasses.field(default_factory=dict)
    weights: str | None = None  # ExecuTorch: the .ptd beside the .pte
    external_data: str | None = None  # ONNX: the graph's weights
    genai_unsupported: str | None = None  # ONNX: why onnxruntime-genai cannot run the folder
    genai_config: str | None = None
    facts: dict = dataclasses.field(default_factory=dict)

    # The file's order (the fields above are in the order a dataclass needs: required ones first).
    ORDER = (
        "format_version", "target", "source", "export_options", "model_type", "dtype", "max_cache_len",
        "quantization", "vocab_size", "bos_token_id", "eos_token_ids", "tokenizer_adds_bos", "layers", "kv_cache",
        "kv_cache_bytes", "kv_cache_bytes_if_all_full", "state_bytes", "max_draft_tokens", "interface", "versions",
        "program", "weights", "external_data", "genai_unsupported", "genai_config",
    )  # fmt: skip

    @classmethod
    def from_json(cls, data: dict, path: Path | str = MANIFEST) -> Manifest:
        """The manifest in ``data``, checked as ``read_manifest`` checks a file (``path`` names it
        in the errors)."""
        _check_fields(Path(path), data)
        declared = {f.name for f in dataclasses.fields(cls)} - {"facts"}
        values = {key: data[key] for key in declared if key in data}
        return cls(**{
            **values,
            "target": Target(data["target"]),
            "dtype": Dtype(data["dtype"]),
            "source": Source.from_json(data["source"]),
            "eos_token_ids": tuple(data["eos_token_ids"]),
            "layers": tuple(Layer.from_json(layer) for layer in data["layers"]),
            "files": {name: FileEntry(entry["sha256"], entry["bytes"]) for name, entry in data["files"].items()},
            "interface": Interface.from_json(data["interface"]) if data.get("interface") is not None else None,
            "max_draft_tokens": data.get("max_draft_tokens") or 0,
            "versions": data.get("versions") or {},
            "facts": {key: value for key, value in data.items() if key not in declared and key != "format"},
        })  # fmt: skip

    def to_json(self) -> dict:
        """The manifest as kvexport.json holds it: the fields in ``ORDER``, the target's facts, the
        files. ``bos_token_id`` is written even where null (the tokenizer has none)."""
        values = {key: getattr(self, key) for key in self.ORDER}
        values["max_draft_tokens"] = self.max_draft_tokens or None
        values["versions"] = self.versions or None
        out = {"format": FORMAT}
        out |= {key: _json_value(value) for key, value in values.items() if value is not None or key == "bos_token_id"}
        return out | _json_value(self.facts) | {"files": _json_value(self.files)}

    @property
    def kv_cache_dtype(self) -> str:
        """The KV cache's element type: int8 where asked, else the artifact's dtype."""
        return (self.kv_cache or {}).get("dtype", self.dtype)

    @property
    def max_tokens_per_call(self) -> int:
        """The most tokens one forward call of the program takes; runners split longer prompts.
        Artifacts written before ``--prefill-chunk`` took calls as long as the cache."""
        return (self.interface and self.interface.max_tokens_per_call) or self.max_cache_len

    @property
    def rewind(self) -> int:
        """How many positions before the sequence's end a call may start (after drafted tokens were
        rejected): any, where every layer's cache is a full one of its own (a call writes its rows
        again and attention reads none past them), else a ring's spare slots (``max_draft_tokens``)."""
        full = all(layer.cache in ("static", "none") for layer in self.layers)
        return self.max_cache_len if full else self.max_draft_tokens

    @property
    def rows_by_position(self) -> bool:
        """Whether every cache holds rows by position that a call writes again (a full layer's, or a
        ring's that is not a chunk's): what a call starting before the sequence's end needs, with a
        ring's evicted rows kept somewhere. A state has moved on, a shared layer reads another's."""
        return all(layer.cache in ("static", "none") or (layer.cache == "ring" and not layer.chunk) for layer in self.layers)

    @property
    def files_bytes(self) -> int:
        return sum(entry.bytes for entry in self.files.values())

    def version(self, package: str) -> str | None:
        """The version of ``package`` it was exported with."""
        return self.versions.get(package)


def buffer_layers(layers) -> list[Layer]:
    """The layers that hold a KV cache of their own, in order (a ``shared`` layer reads an earlier
    layer's, a ``conv`` layer holds a convolution's state): an ONNX graph's n-th past and present
    buffers are the n-th of these."""
    return [layer for layer in layers if layer.holds_kv]


def state_layers(layers) -> list[Layer]:
    """The layers that hold a state (``conv``, ``recurrent``), in order: those instead of a KV cache,
    and a hybrid layer's ``mixer`` (Falcon-H1) beside its KV cache, as an entry of its own with the
    layer's index. An ONNX graph passes their states after every KV buffer."""
    states = []
    for layer in layers:
        if layer.cache in ("conv", "recurrent"):
            states.append(layer)
        elif layer.mixer is not None:
            m = layer.mixer
            states.append(Layer(layer.index, layer.layer_type, m.cache, slots=m.slots, channels=m.channels, state=m.state))
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


def write_manifest(folder: Path, fields: dict) -> Manifest:
    """Write the folder's manifest: ``fields`` (as kvexport.json names them) and every file's sum,
    checked as a runtime will check them; return it."""
    data = {"format": FORMAT, "format_version": FORMAT_VERSION, **fields, "files": file_entries(folder)}
    manifest = Manifest.from_json(data, folder / MANIFEST)
    written = manifest.to_json()
    if written != json.loads(json.dumps(data)):  # a key no field holds would be dropped, an absent one made null
        raise RuntimeError(f"{MANIFEST}: the Manifest would not write back the fields it was given as given")
    (folder / MANIFEST).write_text(json.dumps(written, indent=2, sort_keys=False) + "\n")
    (folder / MANIFEST_SUM).write_text(f"{sha256_file(folder / MANIFEST)}  {MANIFEST}\n")
    return manifest


def read_manifest(folder: Path, verify: bool = True) -> Manifest:
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
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise ArtifactError(f"{path} is not valid JSON ({str(e) or 'nested too deeply'}); re-run kvexport export")
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ArtifactError(f"{path} is not a kvexport manifest; re-run kvexport export")
    target = data.get("target")
    readable = _READABLE_VERSIONS.get(target, (FORMAT_VERSION,)) if isinstance(target, str) else (FORMAT_VERSION,)
    version = data.get("format_version")
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
    manifest = Manifest.from_json(data, path)
    for name, entry in manifest.files.items():
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
        if verify and (file.stat().st_size != entry.bytes or sha256_file(file) != entry.sha256):
            raise ArtifactError(
                f"{file} does not match the sha256 in {MANIFEST}: the file is corrupt or was changed; "
                "copy the artifact again or re-run kvexport export"
            )
    return manifest


def read_listed_file(folder: Path, manifest: Manifest, name: str) -> bytes | None:
    """The bytes of a file the manifest lists, checked against its sha256 as read (what is used is
    what was verified); ``None`` where the manifest does not list it, whatever the folder holds."""
    entry = manifest.files.get(name)
    if entry is None:
        return None
    _refuse_a_link(Path(folder), name)
    path = Path(folder) / name
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ArtifactError(f"{Path(folder)}: cannot read {name}, listed in {MANIFEST} ({e.strerror}); re-run kvexport export")
    if len(data) != entry.bytes or hashlib.sha256(data).hexdigest() != entry.sha256:
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


def _check_fields(path: Path, manifest: dict) -> None:
    """Every field a runtime reads: there, of its type, in its range, agreeing with the others."""
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
        "verify_tokens": (lambda v: _count(v, 2), "the most tokens a .pte's verify call takes"),
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
