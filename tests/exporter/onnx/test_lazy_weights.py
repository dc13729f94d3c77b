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
    files = {}
    for deferred in (False, True):
        monkeypatch.setattr(pipeline.ExportPlan, "defers_weights", property(lambda plan, deferred=deferred: deferred))
        out = tmp_path / f"deferred-{deferred}"
        pipeline.export_model(pipeline.ExportOptions(str(tmp_path / "model"), target="onnx", out=out, max_cache_len=32))
        files[deferred] = [_sha256(out / f) for f in (target.PROGRAM_FILE, target.DATA_FILE)]
    assert made_lazy == [len(large)]
    assert files[True] == files[False]


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
    ExecuTorch's runs nothing then, so its 8da4w export still reads each weight as it quantizes it."""
    model, tokenizer = presets.build_preset("tiny-llama")
    model.to(torch.bfloat16).save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")

    def defers(target_name: str, kv_cache: str, **options) -> bool:
        return pipeline.plan_export(pipeline.ExportOptions(str(tmp_path / "model"), target_name, tmp_path / "out",
                                                           max_cache_len=32, kv_cache=kv_cache, **options)).defers_weights

    assert defers("onnx", "float") and not defers("onnx", "int8")
    assert defers("executorch", "int8", quantize="8da4w") and not defers("executorch", "int8")
