"""The export's memory plan: said before the weights load, refused when the machine cannot hold it,
and close to what an export measures."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from kvexport.exporter import memory_plan, pipeline
from kvexport.models import presets
from tests.helpers import assert_one_line_error, run_cli


def test_the_memory_checked_is_a_container_s_limit_where_that_is_less(tmp_path, monkeypatch):
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    v2, v1 = tmp_path / "memory.max", tmp_path / "memory.limit_in_bytes"
    monkeypatch.setattr(memory_plan, "CGROUP_MEMORY_LIMITS", (v2, v1))
    assert memory_plan.total_memory_bytes() == physical  # neither file
    v2.write_text("max\n")
    v1.write_text("9223372036854771712\n")  # v1's "no limit"
    assert memory_plan.total_memory_bytes() == physical
    v1.write_text(f"{2**30}\n")
    assert memory_plan.total_memory_bytes() == min(2**30, physical)


def test_a_cache_larger_than_memory_is_refused_before_loading(tmp_path, capsys, monkeypatch):
    assert memory_plan.total_memory_bytes() > 2**20  # this machine's, as the OS says
    monkeypatch.setattr(pipeline.sources, "load_model", lambda *a, **k: pytest.fail("loaded the model"))
    # tiny-llama's cache: 2 layers x 2 (keys, values) x 2 heads x 16 dims x 4 bytes = 0.5 KiB a position.
    monkeypatch.setattr(memory_plan, "total_memory_bytes", lambda: 100 * 2**10)
    code, _, err = run_cli(capsys, "tiny-llama", "-o", tmp_path / "out", "--max-cache-len", "512")
    assert_one_line_error(code, err, "--max-cache-len 512: the KV cache alone needs 256.0 KiB, more than this machine's "
                                     "100.0 KiB of memory; --max-cache-len 200 is the most whose cache fits")
    assert list(tmp_path.iterdir()) == []


def test_an_export_beyond_the_machine_s_memory_is_refused_before_loading(tmp_path, capsys, monkeypatch):
    """The cache fits, the libraries and weights do not: refused with the plan's figure, nothing written."""
    monkeypatch.setattr(pipeline.sources, "load_model", lambda *a, **k: pytest.fail("loaded the model"))
    monkeypatch.setattr(memory_plan, "total_memory_bytes", lambda: 64 * 2**20)
    code, _, err = run_cli(capsys, "tiny-llama", "-o", tmp_path / "out", "--target", "onnx")
    assert_one_line_error(code, err, "exporting tiny-llama (float32 -> onnx) needs about 6", "MiB of memory at its peak, more than this machine's 64.0 MiB")
    assert list(tmp_path.iterdir()) == []


def test_an_export_beyond_the_free_disk_is_refused_before_loading(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(pipeline.sources, "load_model", lambda *a, **k: pytest.fail("loaded the model"))
    monkeypatch.setattr(memory_plan.shutil, "disk_usage", lambda path: SimpleNamespace(free=1024))
    code, _, err = run_cli(capsys, "tiny-llama", "-o", tmp_path / "deeper" / "out")
    assert_one_line_error(code, err, "writes about", "to disk, more than the 1.0 KiB free where", "free some disk or write it elsewhere (-o)")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gemma3", "tiny-granite4"])
def test_parameters_are_counted_once_each_without_weights(name):
    model, _ = presets.build_preset(name)
    unique = {id(p): p.numel() for p in model.parameters()}
    counted = memory_plan.count_parameters(model.config)
    assert counted.total == sum(unique.values())
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    assert counted.embedding == sum(unique[i] for i in embeddings)


@pytest.mark.parametrize("target, quantize", [("onnx", ()), ("executorch", ()),
                                               ("executorch", ("--quantize", "8da4w", "--quantize-embedding", "int8"))],
                         ids=["onnx", "executorch", "executorch-8da4w"])
def test_the_memory_plan_is_within_a_quarter_of_what_an_export_measures(tmp_path, target, quantize):
    """A small model (tens of MB of weights, saved in bfloat16 as checkpoints ship) exported in a
    process of its own, each weight read from the checkpoint as it is written (ONNX), serialized
    (ExecuTorch) or quantized (8da4w): its peak resident memory against the plan's estimate."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("llama", hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=32000)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(tmp_path / "model")
    presets.char_tokenizer().save_pretrained(tmp_path / "model")
    options = pipeline.ExportOptions(str(tmp_path / "model"), target=target, out=tmp_path / "out", max_cache_len=256,
                                     quantize=quantize[1] if quantize else None, quantize_embedding=quantize[3] if quantize else None)
    plan = pipeline.plan_export(options)
    assert plan.defers_weights
    estimate = memory_plan.footprint(plan, memory_plan.count_parameters(plan.config)).peak_bytes / 2**20
    done = subprocess.run(
        [sys.executable, "-m", "kvexport.cli", str(tmp_path / "model"), "--target", target, "-o", str(tmp_path / "out"),
         "--max-cache-len", "256", *quantize, "--json", "--quiet"],
        capture_output=True, text=True, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    measured = json.loads(done.stdout.strip().splitlines()[-1])["peak_rss_mb"]
    assert abs(estimate - measured) <= 0.25 * measured, (estimate, measured)
