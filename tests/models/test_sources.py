"""Resolving MODEL arguments, and the errors for those that are not models."""

from __future__ import annotations

import pytest

from kvexport.errors import ModelNotFoundError
from kvexport.models import sources


def test_aliases_point_at_the_shipped_gguf_files():
    for alias in sources.ALIASES:
        source = sources.resolve(alias)
        assert source.kind == "alias" and source.path.suffix == ".gguf" and source.path.is_file()


def test_presets_resolve_without_files():
    assert sources.resolve("tiny-qwen3").kind == "preset"


def test_local_folder_and_gguf(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert sources.resolve(str(tmp_path)).kind == "folder"
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    assert sources.resolve(str(gguf)).kind == "gguf"


def test_a_gguf_is_converted_once_per_content_not_per_copy(tmp_path):
    """A reinstalled model package rewrites its GGUF with a new mtime: it must reuse the conversion."""
    import os

    first, reinstalled, other = tmp_path / "a" / "m.gguf", tmp_path / "b" / "m.gguf", tmp_path / "c" / "m.gguf"
    for path, content in ((first, b"GGUF same"), (reinstalled, b"GGUF same"), (other, b"GGUF diff")):
        path.parent.mkdir()
        path.write_bytes(content)
    os.utime(reinstalled, (1e9, 1e9))
    folder = sources._converted_folder(first, tmp_path)
    assert sources._converted_folder(reinstalled, tmp_path) == folder
    assert sources._converted_folder(other, tmp_path) != folder
    assert folder.parent == tmp_path / "gguf" and folder.name.startswith("m-")


def test_a_conversion_another_process_finished_first_is_used(tmp_path, monkeypatch):
    """Two exports of one GGUF started together both convert it; the later rename must not fail."""
    from types import SimpleNamespace

    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    folder = sources._converted_folder(gguf, tmp_path)

    def save(path):
        (path / "config.json").write_text("{}")
        folder.mkdir(parents=True, exist_ok=True)  # the other process's rename lands meanwhile
        (folder / "config.json").write_text('{"theirs": true}')

    converted = SimpleNamespace(save_pretrained=save, config=SimpleNamespace(), hf_quantizer=None)
    monkeypatch.setattr(sources, "_read_gguf", lambda read, source: converted)
    assert sources._plain_folder(sources.resolve(str(gguf)), tmp_path) == folder
    assert (folder / "config.json").read_text() == '{"theirs": true}'
    assert [p.name for p in folder.parent.iterdir()] == [folder.name]  # no temporary folder left


@pytest.mark.parametrize(
    "name, phrase",
    [("definitely/not-cached-anywhere", "--offline forbids downloading it"), ("./missing-folder", "not found")],
)
def test_unresolvable_names_say_why(name, phrase):
    with pytest.raises(ModelNotFoundError, match=phrase):
        sources.resolve(name, offline=True)  # offline: a hub id must not reach the real Hub


def test_a_truncated_gguf_is_reported_not_crashed_on(tmp_path):
    real = sources.resolve("smollm2-135m").path
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(real.read_bytes()[:4096])
    source = sources.resolve(str(broken))
    with pytest.raises(ModelNotFoundError, match="cannot read .*broken.gguf' as a GGUF model"):
        sources.load_config(source)
