"""A GGUF file converted once into the kvexport cache, and the error for one that cannot be read."""

from __future__ import annotations

import pytest

from kvexport.errors import ModelNotFoundError
from kvexport.models import gguf_conversion, sources


def test_a_gguf_is_converted_once_per_content_not_per_copy(tmp_path):
    """A reinstalled model package rewrites its GGUF with a new mtime: it must reuse the conversion."""
    import os

    first, reinstalled, other = tmp_path / "a" / "m.gguf", tmp_path / "b" / "m.gguf", tmp_path / "c" / "m.gguf"
    for path, content in ((first, b"GGUF same"), (reinstalled, b"GGUF same"), (other, b"GGUF diff")):
        path.parent.mkdir()
        path.write_bytes(content)
    os.utime(reinstalled, (1e9, 1e9))
    folder = gguf_conversion.converted_folder(first, tmp_path)
    assert gguf_conversion.converted_folder(reinstalled, tmp_path) == folder
    assert gguf_conversion.converted_folder(other, tmp_path) != folder
    assert folder.parent == tmp_path / "gguf" and folder.name.startswith("m-")


def test_a_conversion_another_process_finished_first_is_used(tmp_path, monkeypatch):
    """Two exports of one GGUF started together both convert it; the later rename must not fail."""
    from types import SimpleNamespace

    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    folder = gguf_conversion.converted_folder(gguf, tmp_path)

    def save(path):
        (path / "config.json").write_text("{}")
        folder.mkdir(parents=True, exist_ok=True)  # the other process's rename lands meanwhile
        (folder / "config.json").write_text('{"theirs": true}')

    converted = SimpleNamespace(save_pretrained=save, config=SimpleNamespace(), hf_quantizer=None)
    monkeypatch.setattr(gguf_conversion, "_checked_gguf_model", lambda source: converted)
    monkeypatch.setattr(gguf_conversion, "_read_gguf", lambda read, source: converted)
    assert gguf_conversion.plain_folder(sources.resolve(str(gguf)), tmp_path) == folder
    assert (folder / "config.json").read_text() == '{"theirs": true}'
    assert [p.name for p in folder.parent.iterdir()] == [folder.name]  # no temporary folder left


def test_a_killed_conversion_s_folder_is_removed_by_the_next_one(tmp_path):
    """A conversion killed midway (out of memory) leaves a model's float32 weights in a hidden folder;
    the next conversion in that cache removes it, and leaves a running one's alone."""
    import os
    import socket
    import subprocess
    import sys

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    cache, host = tmp_path / "gguf", socket.gethostname()
    abandoned = cache / f".tmp-{gone.stdout.strip()}@{host}.abc"
    running = cache / f".tmp-{os.getpid()}@{host}.def"
    elsewhere = cache / f".tmp-{gone.stdout.strip()}@another-{host}.ghi"  # a shared disk: its process is not seen here
    for folder in (abandoned, running, elsewhere):
        folder.mkdir(parents=True)
        (folder / "model.safetensors").write_bytes(b"weights")
    gguf_conversion.remove_abandoned_conversions(cache)
    assert not abandoned.exists()
    assert (running / "model.safetensors").is_file() and (elsewhere / "model.safetensors").is_file()


def test_a_truncated_gguf_is_reported_not_crashed_on(tmp_path):
    real = sources.resolve("smollm2-135m").path
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(real.read_bytes()[:4096])
    source = sources.resolve(str(broken))
    with pytest.raises(ModelNotFoundError, match="cannot read .*broken.gguf' as a GGUF model"):
        sources.load_config(source)
