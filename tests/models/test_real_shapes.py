"""models/real_shapes.py: a streamed checkpoint, written a tensor at a time, in shards, that
transformers loads with nothing missing; a shape with overrides."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoConfig

from kvexport.errors import InvalidOptionError
from kvexport.models import real_shapes, sources
from kvexport.models.presets import char_tokenizer


def test_a_streamed_checkpoint_loads_whole_in_shards(tmp_path, monkeypatch):
    monkeypatch.setattr(real_shapes, "SHARD_BYTES", 64 * 1024)  # several shards of a tiny model
    config = AutoConfig.for_model("llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, vocab_size=128, tie_word_embeddings=True)
    written = real_shapes.write_streamed(config, tmp_path)
    char_tokenizer().save_pretrained(tmp_path)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 1 and all((tmp_path / f).is_file() for f in shards)
    model, _ = sources.load_model(sources.resolve(str(tmp_path)))  # refuses a weight missing or mis-shaped
    assert written == sum(p.numel() for p in model.parameters())
    assert index["metadata"]["total_size"] == 2 * written  # bfloat16, and no saved buffer in Llama
    norms = [p for n, p in model.named_parameters() if "norm" in n]
    assert norms and all(torch.equal(p, torch.ones_like(p)) for p in norms)


def test_a_shape_takes_overrides_and_an_unknown_shape_is_refused():
    config = real_shapes.shape_config("gemma3-1b", {"num_hidden_layers": 2, "layer_types": ["sliding_attention", "full_attention"]})
    assert (config.model_type, config.num_hidden_layers, config.hidden_size, config.sliding_window) == ("gemma3_text", 2, 1152, 512)
    with pytest.raises(InvalidOptionError, match="unknown shape 'gemma9'; choose one of: gemma3-1b"):
        real_shapes.shape_config("gemma9")
