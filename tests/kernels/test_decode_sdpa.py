"""``kvexport::decode_sdpa`` (``--decode-attention kvexport``): the kernel as ExecuTorch runs it
against torch's own attention, and artifacts that call it against eager transformers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvexport.checker.check import run_check
from kvexport.errors import InvalidOptionError, KvexportError
from kvexport.exporter.pipeline import ExportOptions, plan_export
from kvexport.runtime.programs import load_program

from tests.conftest import PROMPT

SLOTS = 800


class OneCall(torch.nn.Module):
    """One call of the op (``int8``: of ``decode_sdpa_int8``, the rows values, scales and zero points)."""

    def __init__(self, int8: bool):
        super().__init__()
        self.op = torch.ops.kvexport.decode_sdpa_int8 if int8 else torch.ops.kvexport.decode_sdpa

    def forward(self, q, *rows_and_position):
        *rows, position = rows_and_position
        end = position.item()
        torch._check(end >= 1)
        torch._check(end <= rows[0].shape[1])
        return self.op(q, *rows, end, q.shape[-1] ** -0.5 * 2)


def random_rows(heads, kv_heads, d, seed, int8):
    """A query ``[1, 1, H, D]`` and a cache's rows, float or int8 as kvexport writes them, with the
    float keys and values they stand for."""
    from kvexport.exporter.executorch.quantized_kv_cache import dequantize_rows, quantize_rows

    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, n, h, d, generator=g) * 3 for n, h in ((1, heads), (SLOTS, kv_heads), (SLOTS, kv_heads)))
    if not int8:
        return q, (k, v), k, v
    k_rows, v_rows = quantize_rows(k), quantize_rows(v)
    return q, (*k_rows, *v_rows), dequantize_rows(*k_rows, torch.float32), dequantize_rows(*v_rows, torch.float32)


@pytest.fixture(scope="module")
def programs():
    """``shape -> method``: the op alone, lowered to ExecuTorch, run by its runtime with the kernel loaded."""
    from executorch.exir import to_edge_transform_and_lower
    from executorch.runtime import Runtime

    from kvexport.kernels import define_ops, load_kernels
    from kvexport.runtime.executorch_program import register_kernels

    define_ops()
    register_kernels()
    load_kernels()
    loaded = {}

    def method(heads, kv_heads, d, int8):
        key = heads, kv_heads, d, int8
        if key not in loaded:
            q, rows, _, _ = random_rows(heads, kv_heads, d, 0, int8)  # distinct tensors: export would alias equal ones
            exported = torch.export.export(OneCall(int8), (q, *rows, torch.tensor([3])), strict=False)
            program = Runtime.get().load_program(to_edge_transform_and_lower(exported).to_executorch().buffer)
            loaded[key] = program, program.load_method("forward")  # the method needs its program alive
        return loaded[key][1]

    return method


@pytest.mark.parametrize(("heads", "kv_heads", "d"), [(9, 3, 64), (4, 1, 256), (8, 8, 16), (6, 2, 12)],
                         ids=["smollm2", "gemma3", "mha", "odd-head-dim"])
@pytest.mark.parametrize("end", [1, 7, 256, 257, 700])
@pytest.mark.parametrize("int8", [False, True], ids=["float", "int8"])
def test_the_kernel_attends_as_torch_does(programs, heads, kv_heads, d, end, int8):
    """Blocks of 256 positions, the last one partial, and a single position; scores large enough
    that most probabilities underflow (the scale is twice the usual). An int8 cache against torch
    over its rows dequantized."""
    q, rows, k, v = random_rows(heads, kv_heads, d, end, int8)
    got = programs(heads, kv_heads, d, int8).execute([q, *rows, torch.tensor([end])])[0]
    expected = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k[:, :end].transpose(1, 2), v[:, :end].transpose(1, 2), scale=d**-0.5 * 2, enable_gqa=True
    ).transpose(1, 2)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-gemma3"])
def test_an_artifact_decoding_with_it_generates_eager_tokens(artifact, preset):
    """Full layers decode with the kernel, prefill with ExecuTorch's; Gemma 3's rings as before.
    Speculative: a verification is a longer call, drafts from prompt lookup."""
    folder = artifact(preset, "executorch", decode_attention="kvexport", max_draft_tokens=4)
    assert b"kvexport::decode_sdpa\x00" in (folder / "model.pte").read_bytes()
    for draft in (None, "ngram"):
        report = run_check(folder, [(PROMPT, 20)], draft=draft, draft_tokens=3)
        assert report.ok, report.prompts[0]


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-gemma3"])
def test_an_int8_cache_decodes_as_the_float_kernel_over_its_rows_dequantized(artifact, preset):
    """The same int8 rows (ExecuTorch's per-token scheme, written by the same program) read in place
    by the kernel, and dequantized into ``llama::custom_sdpa`` (``--int8-kv-sdpa dequantized``):
    the same logits within float32 rounding, call after call past tiny Gemma 3's window."""
    kernel = load_program(artifact(preset, "executorch", kv_cache="int8", decode_attention="kvexport"))
    dequantized = load_program(artifact(preset, "executorch", kv_cache="int8", int8_kv_sdpa="dequantized"))
    assert kernel.manifest.facts["custom_ops"].count("kvexport::decode_sdpa_int8") == 1
    tokens = [(7 * i + 3) % 90 + 5 for i in range(40)]
    np.testing.assert_allclose(kernel.forward(tokens[:12], 0), dequantized.forward(tokens[:12], 0), atol=1e-4, rtol=0)
    for position in range(12, len(tokens)):
        got, expected = kernel.forward([tokens[position]], position), dequantized.forward([tokens[position]], position)
        np.testing.assert_allclose(got, expected, atol=1e-3, rtol=0)


@pytest.mark.parametrize(("options", "phrase"), [
    (dict(target="onnx"), "--decode-attention is for --target executorch; for --target onnx leave it out"),
    (dict(dtype="float16"), "attends in float32: it goes with --dtype float32 \\(the default\\), not float16"),
    (dict(decode_attention="fast"), "unknown --decode-attention 'fast'; choose one of: custom-sdpa, kvexport"),
], ids=["onnx", "float16", "unknown"])
def test_what_the_kernel_cannot_read_is_refused_before_loading(tmp_path, options, phrase):
    with pytest.raises(InvalidOptionError, match=phrase):
        plan_export(ExportOptions("tiny-llama", **{"target": "executorch", "decode_attention": "kvexport", **options},
                                  out=tmp_path / "a", max_cache_len=64))


def test_without_a_compiler_the_error_says_what_to_do(tmp_path, monkeypatch):
    from kvexport.kernels import _build

    monkeypatch.setenv("KVEXPORT_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    with pytest.raises(KvexportError, match=r"C\+\+ compiler.*install one"):
        _build()
    assert not any(tmp_path.rglob("*.so"))
