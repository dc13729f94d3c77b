"""Artifact folders: published whole or not at all, and checked when read."""

from __future__ import annotations

import json
import re

import pytest

from kvexport.errors import ArtifactError
from kvexport.artifact import manifest as artifact
from kvexport.artifact import staging


def minimal_manifest():
    return {
        "target": "executorch",
        "program": "model.pte",
        "max_cache_len": 8,
        "vocab_size": 4,
        "eos_token_ids": [1],
        "bos_token_id": None,
        "dtype": "float32",
        "layers": [{"cache": "ring", "window": 4}, {"cache": "static", "window": None}],
        "source": {"name": "tiny-llama", "kind": "preset", "path": None},
    }


def make_artifact(folder):
    with staging.staged_folder(folder) as tmp:
        (tmp / "model.pte").write_bytes(b"program")
        artifact.write_manifest(tmp, minimal_manifest())


@pytest.mark.usefixtures("sigint_raises_keyboard_interrupt")
def test_manifest_checks(tmp_path):
    out = tmp_path / "out"
    make_artifact(out)
    manifest = json.loads((out / "kvexport.json").read_text())
    manifest["format_version"] = 99
    (out / "kvexport.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match="format version 99"):
        artifact.read_manifest(out)
    # Every ExecuTorch version still runs; ONNX graphs before 6 had kvexport's own cache interface.
    for version in (1, 2, 3, 4, 5, 6):
        manifest["format_version"], manifest["target"] = version, "executorch"
        (out / "kvexport.json").write_text(json.dumps(manifest))
        assert artifact.read_manifest(out, verify=False).format_version == version
        manifest["target"] = "onnx"
        (out / "kvexport.json").write_text(json.dumps(manifest))
        if version == 6:
            assert artifact.read_manifest(out, verify=False).format_version == version
            continue
        with pytest.raises(ArtifactError, match=f"format version {version}, this kvexport reads 6 for onnx artifacts; re-export"):
            artifact.read_manifest(out, verify=False)
    (out / "kvexport.json").write_text("{not json")
    with pytest.raises(ArtifactError, match="not valid JSON"):
        artifact.read_manifest(out)


def test_a_listed_file_that_is_missing_or_changed_is_refused(tmp_path):
    out = tmp_path / "out"
    make_artifact(out)
    (out / "model.pte").write_bytes(b"progrAm")
    with pytest.raises(ArtifactError, match="does not match the sha256"):
        artifact.read_manifest(out)
    (out / "model.pte").unlink()
    with pytest.raises(ArtifactError, match="missing model.pte"):
        artifact.read_manifest(out)


def test_a_shared_layer_reading_an_earlier_cache_is_accepted(tmp_path):
    out = tmp_path / "out"
    with staging.staged_folder(out) as tmp:
        (tmp / "model.pte").write_bytes(b"program")
        manifest = minimal_manifest()
        manifest["layers"] += [{"cache": "shared", "reads": 0, "window": 4, "slots": 0}, {"cache": "shared", "reads": 1, "window": None}]
        artifact.write_manifest(tmp, manifest)
    layers = artifact.read_manifest(out).layers
    assert [layer.cache for layer in artifact.buffer_layers(layers)] == ["ring", "static"]


@pytest.mark.parametrize(
    "change, phrase",
    [
        (lambda m: m.update(max_cache_len="8"), "'max_cache_len' should be a positive integer"),
        (lambda m: m.update(max_cache_len=True), "'max_cache_len' should be a positive integer"),
        (lambda m: m.update(target="tflite"), "'target' should be 'executorch' or 'onnx'"),
        (lambda m: m.update(eos_token_ids=1), "'eos_token_ids' should be a list of token ids"),
        (lambda m: m.update(layers=[{"cache": "ring", "window": "4"}]), "'layers' should be"),
        (lambda m: m.pop("source"), "lacks 'source'"),
        (lambda m: m["files"].update({"../model.pte": m["files"]["model.pte"]}), "'files' should be"),
        (lambda m: m["files"]["model.pte"].update(bytes="7"), "'files' should be"),
        (lambda m: m.update(program="other.pte"), "does not list its program file other.pte"),
        (lambda m: m.update(weights="model.ptd"), "does not list its weights file model.ptd"),
        # Ranges, and fields that must agree with one another (issue 41, part 4).
        (lambda m: m.update(interface={"max_tokens_per_call": -1}),
         "'interface.max_tokens_per_call' should be a positive integer at most max_cache_len (8), not -1"),
        (lambda m: m.update(interface={"max_tokens_per_call": 9}), "'interface.max_tokens_per_call' should be"),
        (lambda m: m.update(interface={"inputs": ["tokens"]}), "'interface.inputs' should be a list of named tensors"),
        (lambda m: m["layers"][1].update(kv_heads=0), "'layers[1].kv_heads' should be a positive integer, not 0"),
        (lambda m: m["layers"][1].update(head_dim=2.5), "'layers[1].head_dim' should be a positive integer"),
        (lambda m: m["layers"][1].update(slots=-8), "'layers[1].slots' should be a positive integer"),
        (lambda m: m["layers"][1].update(index=0), "'layers[1].index' should be 1, its place in the list"),
        (lambda m: m["layers"][0].update(window=None), "'layers[0].window' should be a window below max_cache_len (8)"),
        (lambda m: m["layers"][0].update(window=8), "'layers[0].window' should be a window below max_cache_len (8)"),
        (lambda m: m["layers"][1].update(window=4), "'layers[1].cache' should be \"ring\" for a window of 4"),
        (lambda m: m.update(layers=[]), "'layers' should be a list of layer caches, one a layer"),
        (lambda m: m["source"].update(kind="website"), "'source.kind' should be 'preset' or 'alias'"),
        (lambda m: m["source"].update(path=["/x"]), "'source.path' should be text"),
        (lambda m: m["source"].update(name=""), "'source.name' should be the model's name"),
        (lambda m: m["files"]["model.pte"].update(sha256="x" * 64), "'files' should be"),
        (lambda m: m["files"].update({"/etc/passwd": m["files"]["model.pte"]}), "'files' should be"),
        (lambda m: m["files"].update({"kvexport.json": m["files"]["model.pte"]}), "'files' should be"),
        (lambda m: m["files"].update({"a\0b": m["files"]["model.pte"]}), "'files' should be"),
        (lambda m: m.update(versions={"executorch": 1.5}), "'versions' should be package -> version"),
        (lambda m: m.update(quantization="8da4w"), "'quantization' should be the quantization scheme"),
        (lambda m: m.update(bos_token_id=-1), "'bos_token_id' should be a token id"),
        (lambda m: m.update(format_version=True), "has format version true"),
        (lambda m: m.update(target=["onnx"]), "'target' should be 'executorch' or 'onnx', not [\"onnx\"]"),
        # KV sharing: a shared layer reads an earlier layer that holds a cache, and holds none itself.
        (lambda m: m["layers"].append({"cache": "shared", "reads": 2, "window": None}),
         "'layers[2].reads' should be the index of an earlier layer that holds a cache, not 2"),
        (lambda m: m["layers"].extend([{"cache": "shared", "reads": 0, "window": 4}, {"cache": "shared", "reads": 2}]),
         "'layers[3].reads' should be the index of an earlier layer that holds a cache, not 2"),
        (lambda m: m["layers"].append({"cache": "shared", "reads": 1, "slots": 8}),
         "'layers[2].slots' should be 0 for a layer that holds no cache, not 8"),
        (lambda m: m.update(genai_unsupported=["why"]), "'genai_unsupported' should be text"),
        # A hybrid layer's mixer (Falcon-H1): a state the runtimes size from its fields.
        (lambda m: m["layers"][1].update(mixer={"cache": "recurrent", "channels": 8, "slots": 3}),
         "'layers[1].mixer' should be a state"),
        (lambda m: m["layers"][1].update(mixer={"cache": "static", "channels": 8, "slots": 3}), "'layers[1].mixer' should be"),
    ],
    ids=[
        "cache-len-string",
        "cache-len-bool",
        "unknown-target",
        "eos-not-a-list",
        "window-string",
        "no-source",
        "file-outside-the-folder",
        "file-size-string",
        "program-not-listed",
        "weights-not-listed",
        "tokens-per-call-negative",
        "tokens-per-call-above-the-cache",
        "inputs-not-named",
        "kv-heads-zero",
        "head-dim-not-an-integer",
        "slots-negative",
        "index-out-of-place",
        "ring-without-a-window",
        "ring-window-not-below-the-cache",
        "static-with-a-window-below-the-cache",
        "no-layers",
        "unknown-source-kind",
        "source-path-not-text",
        "source-without-a-name",
        "sha256-not-hex",
        "absolute-file-name",
        "manifest-listing-itself",
        "file-name-with-a-nul",
        "version-not-text",
        "quantization-not-a-table",
        "negative-bos",
        "format-version-bool",
        "target-a-list",
        "shared-reading-itself",
        "shared-reading-a-shared-layer",
        "shared-with-slots",
        "genai-unsupported-not-text",
        "mixer-without-its-state",
        "mixer-of-a-kv-kind",
    ],
)
def test_an_inconsistent_manifest_is_refused(tmp_path, change, phrase):
    out = tmp_path / "out"
    make_artifact(out)
    manifest = json.loads((out / "kvexport.json").read_text())
    change(manifest)
    (out / "kvexport.json").write_text(json.dumps(manifest))
    (out / "kvexport.json.sha256").unlink()  # as if edited with its sum: the fields are checked too
    with pytest.raises(ArtifactError, match=re.escape(phrase)):
        artifact.read_manifest(out)


def test_the_manifest_is_written_as_given_or_not_at_all(tmp_path):
    """The exporter's fields go through ``Manifest`` to the file: the same keys and values, in the
    file's order whatever order they came in; a key that no field holds is refused, not dropped."""
    given = minimal_manifest()
    make_artifact(tmp_path / "out")
    text = (tmp_path / "out" / "kvexport.json").read_text()
    assert {k: v for k, v in json.loads(text).items() if k not in ("format", "format_version", "files")} == given
    assert list(json.loads(text)) == ["format", "format_version", "target", "source", "dtype", "max_cache_len", "vocab_size",
                                      "bos_token_id", "eos_token_ids", "layers", "program", "files"]
    for unknown in ({"layers": [{"cache": "static", "window": None, "colour": "red"}]}, {"source": {**given["source"], "x": 1}}):
        with pytest.raises(RuntimeError, match="as given"), staging.staged_folder(tmp_path / "refused") as tmp:
            (tmp / "model.pte").write_bytes(b"program")
            artifact.write_manifest(tmp, {**given, **unknown})
        assert not (tmp_path / "refused").exists()


def test_a_hybrid_layer_is_a_kv_buffer_and_a_state():
    """Falcon-H1's layers: each counts among the layers with KV buffers and, by its ``mixer``, among
    those with states, under the layer's own index."""
    mixer = {"cache": "recurrent", "channels": 8, "slots": 3, "state": [2, 4, 4]}
    layers = [{"index": 0, "layer_type": "full_attention", "cache": "static", "window": None, "mixer": mixer},
              {"index": 1, "layer_type": "conv", "cache": "conv", "window": None, "channels": 8, "slots": 3}]  # fmt: skip
    layers = [artifact.Layer.from_json(layer) for layer in layers]
    assert artifact.buffer_layers(layers) == layers[:1]
    assert artifact.state_layers(layers) == [artifact.Layer.from_json({"index": 0, "layer_type": "full_attention", **mixer}), layers[1]]


def test_a_changed_manifest_is_refused(tmp_path):
    """One digit of the manifest (here the cache length) is as fatal as a byte of the weights."""
    out = tmp_path / "out"
    make_artifact(out)
    text = (out / "kvexport.json").read_text()
    (out / "kvexport.json").write_text(text.replace('"max_cache_len": 8', '"max_cache_len": 9'))
    with pytest.raises(ArtifactError, match="kvexport.json does not match kvexport.json.sha256"):
        artifact.read_manifest(out)
    (out / "kvexport.json.sha256").unlink()  # a folder exported before the manifest had its own sum
    assert artifact.read_manifest(out).max_cache_len == 9


def test_a_source_without_a_kind_is_still_read(tmp_path):
    """Manifests name the source's kind since the hub came in; one without it is resolved by name."""
    out = tmp_path / "out"
    make_artifact(out)
    manifest = json.loads((out / "kvexport.json").read_text())
    del manifest["source"]["kind"]
    (out / "kvexport.json").write_text(json.dumps(manifest))
    (out / "kvexport.json.sha256").unlink()
    assert artifact.read_manifest(out).source.kind is None


@pytest.mark.parametrize("what", ["link-outside", "link-inside", "folder", "fifo", "manifest-link", "sum-link"])
def test_a_listed_file_that_is_a_link_or_not_a_regular_file_is_refused(tmp_path, what):
    """run reads (and pack copies) only regular files of the folder: never through a symlink to
    elsewhere, never a FIFO or a device that would block or never end."""
    import os
    import shutil

    out = tmp_path / "out"
    make_artifact(out)
    outside = tmp_path / "elsewhere.pte"
    outside.write_bytes(b"program")  # the very bytes: the sha256 alone would not catch the link
    if what == "link-outside":
        (out / "model.pte").unlink()
        (out / "model.pte").symlink_to(outside)
    elif what == "link-inside":
        os.replace(out / "model.pte", out / "real.pte")
        (out / "model.pte").symlink_to("real.pte")
    elif what == "folder":
        (out / "model.pte").unlink()
        (out / "model.pte").mkdir()
    elif what == "fifo":
        (out / "model.pte").unlink()
        os.mkfifo(out / "model.pte")
    else:
        name = "kvexport.json" if what == "manifest-link" else "kvexport.json.sha256"
        shutil.move(out / name, tmp_path / name)
        (out / name).symlink_to(tmp_path / name)
    phrase = "is not a regular file" if what in ("folder", "fifo") else "is a symbolic link"
    with pytest.raises(ArtifactError, match=phrase):
        artifact.read_manifest(out)
    with pytest.raises(ArtifactError, match=phrase):
        artifact.read_manifest(out, verify=False)


def test_a_listed_file_is_read_as_it_was_verified(tmp_path):
    out = tmp_path / "out"
    make_artifact(out)
    manifest = artifact.read_manifest(out)
    assert artifact.read_listed_file(out, manifest, "model.pte") == b"program"
    assert artifact.read_listed_file(out, manifest, "tokenizer.json") is None  # not listed: not read
    (out / "model.pte").write_bytes(b"progrAm")  # changed after read_manifest verified it
    with pytest.raises(ArtifactError, match="model.pte does not match the sha256"):
        artifact.read_listed_file(out, manifest, "model.pte")
