"""Resolving MODEL arguments, and the errors for those that are not models."""

from __future__ import annotations

import pytest
import torch

from kvexport.errors import ModelNotFoundError
from kvexport.models import presets, sources


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
    monkeypatch.setattr(sources, "_checked_gguf_model", lambda source: converted)
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


EMPTY_REPORT = {"missing_keys": [], "unexpected_keys": [], "mismatched_keys": [], "error_msgs": []}


def loading_report(folder) -> dict:
    """transformers' loading report of a model folder, as the export loads it."""
    from transformers import AutoModelForCausalLM

    _, report = sources._with_loading_report(lambda **report: AutoModelForCausalLM.from_pretrained(folder, **report))
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
    folder = sources._plain_folder(sources.resolve(alias), tmp_path)
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
        sources.widen_compact_weights(model)
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
