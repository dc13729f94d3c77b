"""An ONNX export that reads each weight from the checkpoint as it writes it: the same bytes as an
export of the loaded model, and no weight held before."""

from __future__ import annotations

import hashlib

import pytest
import torch

from kvexport.exporter import pipeline
from kvexport.exporter.onnx import lazy_weights, target
from kvexport.models import presets


def _sha256(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gemma3", "tiny-qwen3.5"])
def test_weights_read_as_written_give_the_loaded_model_s_bytes(tmp_path, monkeypatch, name):
    """Tied embeddings (Llama), per-head norms and a ring (Gemma 3), linear attention's states (Qwen
    3.5), from a bfloat16 checkpoint: model.onnx and model.onnx.data equal, byte for byte, those of
    the export that loads every weight first, and every Linear and Embedding weight was lazy."""
    model, tokenizer = presets.build_preset(name)
    model.to(torch.bfloat16).save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    large = {id(m.weight) for m in model.modules() if isinstance(m, (torch.nn.Linear, torch.nn.Embedding))}
    made_lazy = []

    def counted(graph, weights):
        made_lazy.append(lazy_weights.read_weights_when_written(graph, weights))
        return made_lazy[-1]

    monkeypatch.setattr(target, "read_weights_when_written", counted)
    reported = []
    monkeypatch.setattr(lazy_weights, "report", reported.append)
    files = {}
    for deferred in (False, True):
        monkeypatch.setattr(pipeline.ExportPlan, "defers_weights", property(lambda plan, deferred=deferred: deferred))
        out = tmp_path / f"deferred-{deferred}"
        pipeline.export_model(pipeline.ExportOptions(str(tmp_path / "model"), target="onnx", out=out, max_cache_len=32))
        files[deferred] = [_sha256(out / f) for f in (target.PROGRAM_FILE, target.DATA_FILE)]
    assert made_lazy == [len(large)]
    assert files[True] == files[False]
    # The status line counted each weight as it was read.
    assert reported == [f"{done} of {len(large)} weights read from the checkpoint" for done in range(1, len(large) + 1)]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gemma3"])
def test_a_half_export_reads_each_weight_as_its_module_runs_and_as_it_is_written(tmp_path, monkeypatch, name, dtype):
    """``--dtype float16`` and ``bfloat16`` defer their weights too: the eager probe reads each as
    its module runs (one at a time, and no weight is left read after it), the graph each as it is
    written (bfloat16 through ml_dtypes: numpy has none); the files equal, byte for byte, those of
    the export that loads every weight first."""
    from kvexport.models.deferred_weights import DeferredWeights

    model, tokenizer = presets.build_preset(name)
    model.to(torch.bfloat16).save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    options = dict(target="onnx", max_cache_len=32, dtype=dtype)
    assert pipeline.plan_export(pipeline.ExportOptions(str(tmp_path / "model"), out=tmp_path / "plan", **options)).defers_weights
    read, most_held = [0], [0]
    plain_read = DeferredWeights.read

    def counted(weights, entry, keep_bfloat16=False):
        read[0] += 1
        return plain_read(weights, entry, keep_bfloat16)

    probe = pipeline._refuse_if_it_overflows

    def probe_counting_weights_held(model, tokenizer, dtype):
        def held(module, args):
            most_held[0] = max(most_held[0], sum(p.device.type == "cpu" for m in model.modules()
                                                 if isinstance(m, (torch.nn.Linear, torch.nn.Embedding)) for p in [m.weight]))
        handles = [m.register_forward_pre_hook(held) for m in model.modules()]
        probe(model, tokenizer, dtype)
        for handle in handles:
            handle.remove()

    monkeypatch.setattr(DeferredWeights, "read", counted)
    monkeypatch.setattr(pipeline, "_refuse_if_it_overflows", probe_counting_weights_held)
    files = {}
    for deferred in (True, False):
        monkeypatch.setattr(pipeline.ExportPlan, "defers_weights", property(lambda plan, deferred=deferred: deferred))
        out = tmp_path / f"deferred-{deferred}"
        pipeline.export_model(pipeline.ExportOptions(str(tmp_path / "model"), out=out, **options))
        files[deferred] = [_sha256(out / f) for f in (target.PROGRAM_FILE, target.DATA_FILE)]
        if deferred:
            assert read[0] > 0 and most_held[0] <= 1, (read, most_held)
    assert files[True] == files[False]


def test_a_probe_that_reads_a_weight_outside_its_module_loads_the_model_first(tmp_path, monkeypatch):
    """A model whose forward reads a deferred weight other than by calling its module fails on the
    weight's stand-in, never on a placeholder's unwritten memory: the export reads every weight then,
    and writes the loaded model's bytes."""
    model, tokenizer = presets.build_preset("tiny-llama")
    model.to(torch.bfloat16).save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    probe = pipeline._refuse_if_it_overflows
    seen = []

    def probe_reading_the_table(model, tokenizer, dtype):
        seen.append(model.get_input_embeddings().weight.device.type)
        model.get_input_embeddings().weight[0, :1] + torch.ones(1)  # not through the module's call
        probe(model, tokenizer, dtype)

    monkeypatch.setattr(pipeline, "_refuse_if_it_overflows", probe_reading_the_table)
    out = tmp_path / "out"
    pipeline.export_model(pipeline.ExportOptions(str(tmp_path / "model"), "onnx", out, max_cache_len=32, dtype="float16"))
    monkeypatch.setattr(pipeline, "_refuse_if_it_overflows", probe)
    monkeypatch.setattr(pipeline.ExportPlan, "defers_weights", property(lambda plan: False))
    loaded = tmp_path / "loaded"
    pipeline.export_model(pipeline.ExportOptions(str(tmp_path / "model"), "onnx", loaded, max_cache_len=32, dtype="float16"))
    assert seen == ["meta", "cpu"]
    assert [_sha256(out / f) for f in (target.PROGRAM_FILE, target.DATA_FILE)] == \
        [_sha256(loaded / f) for f in (target.PROGRAM_FILE, target.DATA_FILE)]


def test_a_transpose_folds_lazily_with_its_permutation(tmp_path):
    """Transpose(weight), and a transpose of that, fold into initializers read when written, with the
    values onnxscript's own folding computes."""
    import numpy as np
    import onnx_ir as ir
    from onnxscript.optimizer import fold_constants
    from safetensors.torch import save_file

    from kvexport.models.deferred_weights import CheckpointTensor, DeferredWeights

    stored = torch.arange(24, dtype=torch.float32).reshape(2, 3, 4)
    save_file({"w": stored}, str(tmp_path / "w.safetensors"))
    weights = DeferredWeights(torch.float32)
    entry = CheckpointTensor(tmp_path / "w.safetensors", "w", (2, 3, 4))
    w = ir.Value(name="w", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([2, 3, 4]),
                 const_value=ir.LazyTensor(lazy_weights._Read(weights, entry), ir.DataType.FLOAT, ir.Shape([2, 3, 4])))
    first = ir.node("Transpose", [w], attributes={"perm": [2, 0, 1]})
    second = ir.node("Transpose", [first.outputs[0]], attributes={"perm": [0, 2, 1]})
    second.outputs[0].name = "out"
    graph = ir.Graph([], [second.outputs[0]], nodes=[first, second], initializers=[w], opset_imports={"": 21})
    with lazy_weights.lazy_transposes():
        fold_constants(ir.Model(graph, ir_version=10))
    folded = graph.initializers["out"].const_value
    assert isinstance(folded, ir.LazyTensor) and folded.raw.perm == (2, 1, 0)
    assert np.array_equal(folded.numpy(), np.transpose(np.transpose(stored.numpy(), (2, 0, 1)), (0, 2, 1)))


def test_an_int8_cache_calibrated_at_export_loads_the_model_whole(tmp_path):
    """ONNX's int8 KV cache runs the model at export to fix its scales, so every weight loads first;
    ExecuTorch's runs nothing then, so its exports still read each weight as they quantize or
    serialize it."""
    model, tokenizer = presets.build_preset("tiny-llama")
    model.to(torch.bfloat16).save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")

    def defers(target_name: str, kv_cache: str, **options) -> bool:
        return pipeline.plan_export(pipeline.ExportOptions(str(tmp_path / "model"), target_name, tmp_path / "out",
                                                           max_cache_len=32, kv_cache=kv_cache, **options)).defers_weights

    assert defers("onnx", "float") and not defers("onnx", "int8")
    assert defers("executorch", "int8", quantize="8da4w") and defers("executorch", "int8")
