"""A `.pte` exported from a checkpoint reads each weight as it needs it (a float one as XNNPACK
serializes it, an 8da4w one just before it quantizes it): the same bytes as an export of the
loaded model, and every weight read."""

from __future__ import annotations

import hashlib

import pytest
import torch

from kvexport.errors import KvexportError
from kvexport.exporter import pipeline
from kvexport.models import deferred_weights, presets


def _sha256(folder) -> dict:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(folder.iterdir()) if f.suffix in (".pte", ".ptd")}


def _checkpoint(tmp_path, name: str):
    """The preset's model, and its bfloat16 checkpoint in ``tmp_path / "model"``."""
    model, tokenizer = presets.build_preset(name)
    model.to(torch.bfloat16).save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    return model


def _counting_reads(monkeypatch) -> list[str]:
    reads = []
    read = deferred_weights.DeferredWeights.read
    monkeypatch.setattr(deferred_weights.DeferredWeights, "read",
                        lambda self, entry, **kwargs: reads.append(entry.key) or read(self, entry, **kwargs))
    return reads


def _exported_both_ways(tmp_path, monkeypatch, **options) -> dict[bool, dict]:
    """The sha256 of the `.pte` and `.ptd` exported from the checkpoint with the model loaded first
    (False) and with its weights read as they are needed (True), with one ``--sdpa-query`` (``auto``
    may choose differently from one export to the next)."""
    if options.get("kv_cache", "float") == "float":
        options = {"sdpa_query": "grouped", **options}
    files = {}
    for deferred in (False, True):
        monkeypatch.setattr(pipeline.ExportPlan, "defers_weights", property(lambda plan, deferred=deferred: deferred))
        out = tmp_path / f"deferred-{deferred}"
        pipeline.export_model(pipeline.ExportOptions(str(tmp_path / "model"), target="executorch", out=out,
                                                     max_cache_len=32, **options))
        files[deferred] = _sha256(out)
    return files


def _large_weights(model) -> list[str]:
    return [f"{n}.weight" for n, m in model.named_modules() if isinstance(m, (torch.nn.Linear, torch.nn.Embedding))]


@pytest.mark.parametrize(("name", "options"),
                         [("tiny-llama", {}), ("tiny-gemma3", {"max_draft_tokens": 2}),
                          ("tiny-qwen3", {"kv_cache": "int8", "dtype": "float16"})])
def test_float_weights_read_as_serialized_give_the_loaded_model_s_bytes(tmp_path, monkeypatch, name, options):
    """A tied table, read for XNNPACK's lm_head and again for the lookup outside it (Llama); a
    ring and a second method, ``verify``, sharing the weights (Gemma 3); an int8 KV cache in
    float16, whose probe reads each weight as its module runs (Qwen 3)."""
    model = _checkpoint(tmp_path, name)
    reads = _counting_reads(monkeypatch)
    files = _exported_both_ways(tmp_path, monkeypatch, **options)
    assert files[True] == files[False] and "model.pte" in files[True]
    assert set(reads) == set(deferred_weights.checkpoint_index(tmp_path / "model")) & set(_large_weights(model))


def test_a_weight_lowering_copied_before_reading_it_is_refused(tmp_path, monkeypatch):
    """Where XNNPACK would serialize a copy of a placeholder (memory nobody wrote), the export
    fails in one line and leaves no artifact."""
    from executorch.backends.xnnpack.operators import node_visitor

    _checkpoint(tmp_path, "tiny-llama")
    get_param_tensor = node_visitor.get_param_tensor
    monkeypatch.setattr(node_visitor, "get_param_tensor", lambda program, node: (
        t.clone() if isinstance(t := get_param_tensor(program, node), torch.Tensor) else t))
    out = tmp_path / "out"
    options = pipeline.ExportOptions(str(tmp_path / "model"), target="executorch", out=out, max_cache_len=32)
    assert pipeline.plan_export(options).defers_weights
    with pytest.raises(KvexportError, match=r"never read the checkpoint's .*weight \(and \d+ more\)"):
        pipeline.export_model(options)
    assert not out.exists()


@pytest.mark.parametrize(("name", "embedding", "lm_head", "kv_cache"),
                         [("tiny-llama", "int8", None, "float"), ("tiny-gemma3", None, "int4", "float"),
                          ("tiny-qwen3", "int8", None, "int8")])
def test_weights_read_as_quantized_give_the_loaded_model_s_bytes(tmp_path, monkeypatch, name, embedding, lm_head, kv_cache):
    """Tied embeddings (Llama: its table int8, its lm_head int8 by default), a ring and an int4
    lm_head with the table left in float (Gemma 3), an int8 KV cache (Qwen 3), from a bfloat16
    checkpoint."""
    model = _checkpoint(tmp_path, name)
    reads = _counting_reads(monkeypatch)
    files = _exported_both_ways(tmp_path, monkeypatch, quantize="8da4w", quantize_embedding=embedding,
                                quantize_lm_head=lm_head, kv_cache=kv_cache)
    large = _large_weights(model)
    stored = set(deferred_weights.checkpoint_index(tmp_path / "model")) & set(large)
    # Each module's weight read once (a tied lm_head reads its table's again), nothing else.
    assert set(reads) == stored and len(reads) == len(large)
    assert files[True] == files[False] and "model.pte" in files[True]


@pytest.mark.parametrize("kv_cache", ["float", "int8"])
def test_a_plan_from_a_checkpoint_reads_the_weights_as_it_quantizes(tmp_path, kv_cache):
    """8da4w from a checkpoint plans for one byte a quantized weight, not the bfloat16 model (an
    int8 KV cache too: ExecuTorch's runs nothing at export)."""
    from kvexport.exporter import memory_plan

    _checkpoint(tmp_path, "tiny-llama")

    def planned(source: str) -> int:
        plan = pipeline.plan_export(pipeline.ExportOptions(source, target="executorch", out=tmp_path / "out",
                                                           max_cache_len=32, quantize="8da4w", kv_cache=kv_cache))
        return plan.defers_weights, memory_plan.footprint(plan, memory_plan.count_parameters(plan.config)).peak_bytes

    from_checkpoint, from_preset = planned(str(tmp_path / "model")), planned("tiny-llama")
    assert from_checkpoint[0] and not from_preset[0]
    assert from_checkpoint[1] < from_preset[1]
