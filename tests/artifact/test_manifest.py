"""Artifact folders: published whole or not at all, and checked when read."""

from __future__ import annotations

import json
import re
import signal

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
        "dtype": "float32",
        "layers": [{"cache": "ring", "window": 4}, {"cache": "static", "window": None}],
        "source": {"name": "tiny-llama", "kind": "preset", "path": None},
    }


def make_artifact(folder):
    with staging.staged_folder(folder) as tmp:
        (tmp / "model.pte").write_bytes(b"program")
        artifact.write_manifest(tmp, minimal_manifest())


@pytest.fixture
def sigint_raises_keyboard_interrupt():
    """A process a non-interactive shell starts in the background ignores SIGINT; give this one
    Python's own handler for the test, as a kvexport started from a terminal has."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.mark.usefixtures("sigint_raises_keyboard_interrupt")
def test_manifest_checks(tmp_path):
    out = tmp_path / "out"
    make_artifact(out)
    manifest = json.loads((out / "kvexport.json").read_text())
    manifest["format_version"] = 99
    (out / "kvexport.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match="format version 99"):
        artifact.read_manifest(out)
    # Version 1 to 3 ExecuTorch artifacts still run; version 1 and 2 ONNX graphs had other cache interfaces.
    for version in (1, 2, 3):
        manifest["format_version"], manifest["target"] = version, "executorch"
        (out / "kvexport.json").write_text(json.dumps(manifest))
        assert artifact.read_manifest(out, verify=False)["format_version"] == version
        manifest["target"] = "onnx"
        (out / "kvexport.json").write_text(json.dumps(manifest))
        if version == 3:  # version 3 ONNX graphs still run (on the CPU): 4 changed only ExecuTorch programs
            assert artifact.read_manifest(out, verify=False)["format_version"] == version
            continue
        with pytest.raises(ArtifactError, match=f"format version {version}, this kvexport reads 3 or 4 or 5 for onnx artifacts; re-export"):
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


def test_a_changed_manifest_is_refused(tmp_path):
    """One digit of the manifest (here the cache length) is as fatal as a byte of the weights."""
    out = tmp_path / "out"
    make_artifact(out)
    text = (out / "kvexport.json").read_text()
    (out / "kvexport.json").write_text(text.replace('"max_cache_len": 8', '"max_cache_len": 9'))
    with pytest.raises(ArtifactError, match="kvexport.json does not match kvexport.json.sha256"):
        artifact.read_manifest(out)
    (out / "kvexport.json.sha256").unlink()  # a folder exported before the manifest had its own sum
    assert artifact.read_manifest(out)["max_cache_len"] == 9
