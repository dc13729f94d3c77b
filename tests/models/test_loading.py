"""Loading a model's weights: transformers' loading report of every family, compact bfloat16
weights, and weights left in the checkpoint until they are read."""

from __future__ import annotations

import pytest
import torch

from kvexport.models import gguf_conversion, loading, presets, sources


EMPTY_REPORT = {"missing_keys": [], "unexpected_keys": [], "mismatched_keys": [], "error_msgs": []}


def loading_report(folder) -> dict:
    """transformers' loading report of a model folder, as the export loads it."""
    from transformers import AutoModelForCausalLM

    _, report = loading.with_loading_report(lambda **report: AutoModelForCausalLM.from_pretrained(folder, **report))
    return {key: sorted(value) for key, value in report.items()}


@pytest.mark.parametrize("name", sorted(presets.PRESETS))
def test_every_preset_family_loads_back_with_no_weight_missing_or_unexpected(tmp_path, name):
    """Each family the export takes, saved as a folder and loaded as the export loads one: no key
    missing, unexpected or mis-shaped (tied weights, non-persistent buffers and the keys a class
    ignores are not reported), and the weights are the saved ones."""
    model, tokenizer = presets.build_preset(name)
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    assert loading_report(tmp_path) == EMPTY_REPORT
    loaded, _ = sources.load_model(sources.resolve(str(tmp_path)))
    saved = model.state_dict()
    assert all(torch.equal(tensor, saved[key]) for key, tensor in loaded.state_dict().items())


@pytest.mark.slow
@pytest.mark.parametrize("alias", sorted(sources.ALIASES))
def test_the_real_models_load_with_no_weight_missing_or_unexpected(tmp_path, alias):
    """The shipped GGUFs convert with nothing made up (the GGUF read's report is refused otherwise),
    and the converted folder loads with an empty report."""
    folder = gguf_conversion.plain_folder(sources.resolve(alias), tmp_path)
    assert loading_report(folder) == EMPTY_REPORT


@pytest.mark.parametrize(
    "name, embedding", [("tiny-llama", None), ("tiny-gemma3", "int4"), ("tiny-qwen3.5", None), ("tiny-smollm3", "int8")]
)
def test_compact_weights_quantize_to_the_float32_loads_model(tmp_path, name, embedding):
    """A bfloat16 checkpoint loaded for 8da4w (and an embedding quantization) keeps its linear
    weights (and embedding tables) in bfloat16 until they are quantized (half the bytes at the
    peak), and the quantized model is the float32 load's: the same logits, bit for bit."""
    from kvexport.exporter.executorch.quantize import quantize_model
    from kvexport.exporter.quantization import Quantization

    model, tokenizer = presets.build_preset(name)
    model.to(torch.bfloat16).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    source = sources.resolve(str(tmp_path))
    kinds = (torch.nn.Linear,) + (torch.nn.Embedding,) * bool(embedding)
    plain, _ = sources.load_model(source)
    compact, _ = sources.load_model(source, compact=("linear",) + ("embedding",) * bool(embedding))
    narrow = [m.weight for m in compact.modules() if isinstance(m, kinds)]
    assert narrow and all(w.dtype == torch.bfloat16 for w in narrow)
    assert all(p.dtype == torch.float32 for p in compact.parameters() if not any(p is w for w in narrow))
    for model in (plain, compact):
        quantize_model(model, Quantization("8da4w", embedding))
        loading.widen_compact_weights(model)
    ids = torch.tensor([[1, 5, 9, 2, 7, 3]])
    with torch.no_grad():
        assert torch.equal(plain(input_ids=ids).logits, compact(input_ids=ids).logits)


@pytest.mark.parametrize("name", sorted(presets.PRESETS))
def test_a_deferred_load_leaves_the_large_weights_in_the_checkpoint(tmp_path, name):
    """Each family, from a bfloat16 checkpoint: every Linear and Embedding weight the checkpoint
    stores under its own name loads as a placeholder whose values are read back as the plain load
    has them, bit for bit; the other weights (Nemotron-H's, whose checkpoint names differ) load as
    they always do."""
    from kvexport.models.deferred_weights import checkpoint_index

    model, tokenizer = presets.build_preset(name)
    model.to(torch.bfloat16).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    source = sources.resolve(str(tmp_path))
    plain, _ = sources.load_model(source)
    deferred, _, weights = sources.load_model_deferred(source)
    stored = checkpoint_index(tmp_path)
    large = {f"{n}.weight" for n, m in deferred.named_modules() if isinstance(m, (torch.nn.Linear, torch.nn.Embedding))}
    assert large & stored.keys() or name == "tiny-nemotron-h"
    expected = plain.state_dict()
    for key, tensor in deferred.state_dict().items():  # a tied lm_head: its embedding's placeholder
        entry = weights.source_of(tensor)
        if key in large and key in stored:
            assert entry is not None, key
        assert torch.equal(weights.read(entry) if entry else tensor, expected[key]), key


def test_a_placeholder_loading_converted_is_refused(tmp_path):
    from kvexport.errors import KvexportError
    from kvexport.models.deferred_weights import CheckpointTensor, DeferredWeights

    model, _ = presets.build_preset("tiny-llama")
    weights = DeferredWeights(torch.float32)
    weights.by_address[1] = CheckpointTensor(tmp_path / "model.safetensors", "model.layers.0.mlp.up_proj.weight", (64, 32))
    with pytest.raises(KvexportError, match=r"loading converted the checkpoint's model.layers.0.mlp.up_proj.weight \(and 0 more\)"):
        weights.check_loaded(model)
