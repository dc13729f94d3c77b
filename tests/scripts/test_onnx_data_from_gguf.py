"""scripts/onnx_data_from_gguf.py: an ONNX artifact's weights file written back from its checkpoint,
byte for byte, or refused."""

from __future__ import annotations

import shutil

import pytest
import torch

from kvexport.exporter import pipeline
from kvexport.models import presets

from tests.helpers import load_script


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_the_weights_file_is_rebuilt_from_the_checkpoint_byte_for_byte(tmp_path, dtype):
    """Tied embeddings, per-head norms and folded constants (tiny Gemma 3): every byte back, each
    range from its checkpoint tensor (transposed where the graph holds it so) or as it travelled;
    a checkpoint that differs by one weight is refused and nothing is written."""
    script = load_script("onnx_data_from_gguf")
    model, tokenizer = presets.build_preset("tiny-gemma3")
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    exported = tmp_path / "exported"
    pipeline.export_model(pipeline.ExportOptions(str(tmp_path / "model"), "onnx", exported, max_cache_len=32, dtype=dtype))
    script.make_map(exported, tmp_path / "model", tmp_path / "map.json")
    travelled = tmp_path / "travelled"
    shutil.copytree(exported, travelled, ignore=shutil.ignore_patterns(script.DATA))
    script.rebuild(tmp_path / "model", tmp_path / "map.json", travelled)
    assert (travelled / script.DATA).read_bytes() == (exported / script.DATA).read_bytes()

    (travelled / script.DATA).unlink()
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight[0, 0] += 1
    model.save_pretrained(tmp_path / "model")
    with pytest.raises(SystemExit, match="the rebuilt model.onnx.data has sha256"):
        script.rebuild(tmp_path / "model", tmp_path / "map.json", travelled)
    assert not (travelled / script.DATA).exists()
