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


@pytest.mark.parametrize(
    "name, phrase",
    [("definitely/not-cached-anywhere", "--offline forbids downloading it"), ("./missing-folder", "not found")],
)
def test_unresolvable_names_say_why(name, phrase):
    with pytest.raises(ModelNotFoundError, match=phrase):
        sources.resolve(name, offline=True)  # offline: a hub id must not reach the real Hub
