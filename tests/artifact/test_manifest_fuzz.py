"""Random edits of ``kvexport.json`` (its sum rewritten, as a tool that knows the format would) and of
the files it lists, against ``run``, ``check``, ``pack`` and the device runner.

The only outcomes allowed: exit 0 with what the unedited artifact gives (the same prompt ids, new
ids and text), or one ``kvexport: error:`` line and exit 2. Never a traceback, never another
generation. ``check`` is held to its refusals: an artifact it accepts reaches the eager model, which
is not loaded here (the comparison itself is check's own tests' business).

One tiny ONNX artifact is copied per example; ``max_examples`` per command keeps the run short, and
the examples are the same every run (a failure in CI reproduces). To search further:
``KVEXPORT_FUZZ_EXAMPLES=2000 KVEXPORT_FUZZ_RANDOM=1 pytest tests/artifact/test_manifest_fuzz.py
--hypothesis-show-statistics``.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kvexport import device
from kvexport.artifact.manifest import sha256_file

from tests.helpers import assert_one_line_error, edit_manifest, run_cli

PROMPT = "The quick brown fox"
# --ignore-eos: which ids end a generation is the manifest's to say (an ONNX graph does not know).
RUN_ARGS = ["--prompt", PROMPT, "--max-new-tokens", "6", "--ignore-eos", "--json"]
EXAMPLES = int(os.environ.get("KVEXPORT_FUZZ_EXAMPLES", "100"))

# Names a manifest must never make a runtime read: outside the folder, the manifest itself, odd ones.
NAMES = ["../x", "/etc/passwd", "..", ".", "", "a/b", "kvexport.json", "kvexport.json.sha256", "model.onnx",
         "model.onnx.data", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "x" * 300, "a\0b",
         "a\nb"]
LEAVES = st.one_of(
    st.none(),
    st.booleans(),
    st.sampled_from([0, 1, -1, 2, 3, 6, 15, 16, 17, 63, 64, 65, 99, 100, 101, 128, 2**31, 2**63, -(2**70), 10**30]),
    st.integers(),
    st.floats(),  # NaN and infinities included: json writes them, and reads them back
    st.sampled_from(NAMES + ["float16", "bfloat16", "float32", "int8", "ring", "static", "onnx", "executorch",
                             "preset", "hub", "folder", "gguf", "alias", "tiny-llama", "tiny-gemma3", "kvexport-artifact"]),
    st.text(max_size=12),
)
VALUES = st.recursive(
    LEAVES, lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)),
    max_leaves=5,
)


def paths(value, prefix=()):
    """Every path into a JSON value (keys and list indices), containers included."""
    found = [prefix]
    if isinstance(value, dict):
        for key, item in value.items():
            found += paths(item, (*prefix, key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            found += paths(item, (*prefix, i))
    return found


def important_paths(manifest: dict) -> list[tuple]:
    """The fields a runtime reads: drawn as often as all the others together."""
    listed = [("format",), ("format_version",), ("target",), ("program",), ("external_data",), ("dtype",),
              ("max_cache_len",), ("vocab_size",), ("eos_token_ids",), ("bos_token_id",), ("tokenizer_adds_bos",),
              ("layers",), ("source",), ("source", "kind"), ("source", "name"), ("source", "path"), ("files",),
              ("interface",), ("interface", "max_tokens_per_call"), ("interface", "inputs"), ("interface", "outputs"),
              ("quantization",), ("versions",), ("versions", "onnxruntime")]
    for i, layer in enumerate(manifest["layers"]):
        listed += [("layers", i, key) for key in layer]
    for name in manifest["files"]:
        listed += [("files", name), ("files", name, "sha256"), ("files", name, "bytes")]
    listed += [("interface", "inputs", j, "name") for j in range(len(manifest["interface"]["inputs"]))]
    return listed


def _parent(manifest, path):
    for key in path[:-1]:
        manifest = manifest[key]
    return manifest


@st.composite
def manifest_edit(draw, manifest: dict):
    """One edit: (kind, path, value)."""
    path = draw(st.one_of(st.sampled_from(important_paths(manifest)), st.sampled_from(paths(manifest)[1:])))
    kind = draw(st.sampled_from(["set", "set", "delete", "nudge", "swap", "add", "rename-file"]))
    if kind == "swap":
        return kind, path, draw(st.sampled_from(paths(manifest)[1:]))
    if kind == "nudge":
        return kind, path, draw(st.sampled_from([-1, 1, 2, -2, 1000, 2**31, "double", "negate", "zero"]))
    if kind == "rename-file":
        return kind, ("files", draw(st.sampled_from(sorted(manifest["files"])))), draw(st.sampled_from(NAMES))
    if kind == "add":
        return kind, (draw(st.sampled_from(["extra", "interface", "layers", "source", "files"])),), draw(VALUES)
    return kind, path, draw(VALUES)


def apply_edit(manifest: dict, edit) -> None:
    kind, path, value = edit
    try:
        container, key = _parent(manifest, path), path[-1]
        current = container[key]
    except (KeyError, IndexError, TypeError):  # an earlier edit removed or replaced the way there
        return
    if not isinstance(container, (dict, list)):  # a text, indexed
        return
    if kind == "set":
        container[key] = value
    elif kind == "delete":
        del container[key]
    elif kind == "nudge":  # a number a little or a lot off: 63 for 64, 128, -64, 0
        if isinstance(current, (int, float)) and not isinstance(current, bool) and math.isfinite(current):
            if isinstance(value, int):
                container[key] = current + value
            else:
                container[key] = {"double": current * 2, "negate": -current, "zero": 0}[value]
    elif kind == "swap":
        try:
            other_container, other_key = _parent(manifest, value), value[-1]
            other = other_container[other_key]
        except (KeyError, IndexError, TypeError):
            return
        if not isinstance(other_container, (dict, list)) or value[: len(path)] == path or path[: len(value)] == value:
            return  # a text, or one inside the other
        container[key], other_container[other_key] = other, current
    elif kind == "add":
        if isinstance(current, dict):
            current[f"added-{len(current)}"] = value
        elif isinstance(current, list):
            current.append(value)
    elif kind == "rename-file" and isinstance(container, dict):
        container[value] = container.pop(key)


# What is done to the folder's files besides the manifest: a listed file made a symlink (to a copy
# of itself outside, whose bytes still match; or to a file elsewhere, its entry rewritten to match),
# a file replaced by a folder, a new listed file that is a symlink to /etc/passwd.
FILE_EDITS = [None, None, None, "link-to-a-copy-outside", "link-to-etc-passwd", "folder", "listed-link-to-etc-passwd",
              "link-inside"]


def apply_file_edit(folder: Path, outside: Path, edit: str | None, name: str) -> None:
    target = folder / name
    if edit is None or not target.is_file() or target.is_symlink():
        return
    if edit == "link-to-a-copy-outside":
        shutil.move(target, outside / name)
        target.symlink_to(outside / name)
    elif edit == "link-inside":
        target.rename(folder / f"real-{name}")
        target.symlink_to(f"real-{name}")
    elif edit == "link-to-etc-passwd":
        target.unlink()
        target.symlink_to("/etc/passwd")
        rewrite_entry(folder, name, {"sha256": sha256_file(target), "bytes": target.stat().st_size})
    elif edit == "folder":
        target.unlink()
        target.mkdir()
    elif edit == "listed-link-to-etc-passwd":
        (folder / "passwd").symlink_to("/etc/passwd")
        rewrite_entry(folder, "passwd", {"sha256": sha256_file(folder / "passwd"), "bytes": (folder / "passwd").stat().st_size})


def rewrite_entry(folder: Path, name: str, entry: dict) -> None:
    """The file's entry in kvexport.json (and the sums) rewritten to match it, where an edit left a
    table of files to write it in."""

    def change(manifest):
        if isinstance(manifest, dict) and isinstance(manifest.get("files"), dict):
            manifest["files"][name] = entry

    edit_manifest(change)(folder)


# A listed file's contents replaced, its entry and the sums rewritten to match: what is damaged is
# the file itself. Not the weights' bytes in place: other weights of the same size are a valid
# artifact of another model, which only check can tell.
CONTENTS = st.one_of(
    st.binary(max_size=64),
    st.sampled_from([b"", b"{}", b"[]", b"null", b'{"model": 1}', b'{"chat_template": 5}', b"\xff\xfe",
                     b"{{ raise_exception('x') }}", b'{"model": {"type": "BPE"}}', b"[" * 100_000]),
    st.builds(lambda n: ("cut", n), st.integers(0, 4096)),
)


def replace_contents(folder: Path, name: str, contents) -> None:
    path = folder / name
    if not path.is_file() or path.is_symlink():
        return
    if isinstance(contents, tuple):  # ("cut", n): the file cut to n bytes
        data = path.read_bytes()[: contents[1]]
    elif name == "model.onnx.data":
        return
    else:
        data = contents
    path.write_bytes(data)
    rewrite_entry(folder, name, {"sha256": sha256_file(path), "bytes": len(data)})


@pytest.fixture(scope="module")
def pristine(artifact):
    """(folder, manifest, what run generates) of the unedited artifact."""
    from kvexport.cli import main

    folder = artifact("tiny-llama", "onnx")
    out = io.StringIO()
    with pytest.raises(SystemExit) as exit_info, contextlib.redirect_stdout(out):
        main(["run", str(folder), *RUN_ARGS])
    assert exit_info.value.code == 0
    return folder, json.loads((folder / "kvexport.json").read_text()), generation(out.getvalue())


def generation(out: str) -> tuple:
    result = json.loads(out)
    return result["prompt_ids"], result["new_ids"], result["text"]


class ReachedEager(Exception):
    """check accepted the artifact and went on to load the eager model."""


def outcome(code, err) -> str:
    """The gist of a refusal, for --hypothesis-show-statistics: its first words, paths left out."""
    if code == 0:
        return "ran as before"
    line = err.strip().splitlines()[-1].removeprefix("kvexport: error: ") if err.strip() else f"exit {code}"
    return " ".join(word for word in line.split() if "/" not in word)[:48]


def assert_one_line(code, err, what):
    assert_one_line_error(code, err, "")
    # Nothing else on stderr either (check says first what it checks): a line break inside the
    # message would pass assert_one_line_error's count.
    lines = [line for line in err.strip().splitlines() if not (what == "check" and line.startswith("checking "))]
    assert len(lines) == 1, err


def assert_same_or_one_line(code, out, err, expected, what):
    event(f"{what}: {outcome(code, err)}")
    if code == 0:
        assert generation(out) == expected, f"{what}: exit 0 with another generation\n{err}"
    else:
        assert_one_line(code, err, what)


def _edited_copy(pristine, data, tmp):
    folder, manifest, _ = pristine
    copy = Path(tmp) / "artifact"
    shutil.copytree(folder, copy)
    edits = data.draw(st.lists(manifest_edit(manifest), min_size=1, max_size=3), label="edits")
    edit_manifest(lambda m: [apply_edit(m, e) for e in edits])(copy)
    file_edit = data.draw(st.sampled_from(FILE_EDITS), label="file edit")
    name = data.draw(st.sampled_from(sorted(manifest["files"])), label="of file")
    outside = Path(tmp) / "outside"
    outside.mkdir()
    apply_file_edit(copy, outside, file_edit, name)
    if data.draw(st.integers(0, 4), label="replace a file's contents") == 0:
        name = data.draw(st.sampled_from(sorted(manifest["files"])), label="whose")
        replace_contents(copy, name, data.draw(CONTENTS, label="with"))
    return copy


@pytest.mark.parametrize("command", ["run", "device", "pack", "check"])
@settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=not os.environ.get("KVEXPORT_FUZZ_RANDOM"),
    database=None,  # nothing written into the checkout
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(data=st.data())
def test_an_edited_manifest_runs_as_before_or_is_refused_in_one_line(pristine, capsys, monkeypatch, command, data):
    from kvexport.checker import check

    expected = pristine[2]
    capsys.readouterr()
    with tempfile.TemporaryDirectory(prefix="kvexport-fuzz-") as tmp:
        folder = _edited_copy(pristine, data, tmp)
        if command == "run":
            code, out, err = run_cli(capsys, "run", folder, *RUN_ARGS)
            assert_same_or_one_line(code, out, err, expected, "run")
        elif command == "device":
            code = device.main([str(folder), *RUN_ARGS])
            out, err = capsys.readouterr()
            assert_same_or_one_line(code, out, err, expected, "device")
        elif command == "pack":
            archive = Path(tmp) / "packed.tar"
            code, out, err = run_cli(capsys, "pack", folder, "-o", archive)
            if code == 0:  # what it packed runs as before on the device, or is refused there
                code = device.main([str(archive), *RUN_ARGS])
                out, err = capsys.readouterr()
                assert_same_or_one_line(code, out, err, expected, "device on the packed archive")
            else:
                event(f"pack: {outcome(code, err)}")
                assert_one_line(code, err, "pack")
                assert not archive.exists()
        else:
            def reached(*args, **kwargs):
                raise ReachedEager

            monkeypatch.setattr(check, "load_reference", reached)
            try:
                code, out, err = run_cli(capsys, "check", folder, "-p", PROMPT, "--max-new-tokens", "6")
            except ReachedEager:
                event("check: reached the eager model")
                capsys.readouterr()
            else:
                event(f"check: {outcome(code, err)}")
                assert_one_line(code, err, "check")
