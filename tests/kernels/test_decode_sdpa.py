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
from kvexport.runtime.tokenizer import ArtifactTokenizer

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
        torch._check(end >= q.shape[1])
        torch._check(end <= rows[0].shape[1])
        return self.op(q, *rows, end, q.shape[-1] ** -0.5 * 2)


def random_rows(tokens, heads, kv_heads, d, seed, int8):
    """A query ``[1, T, H, D]`` and a cache's rows, float or int8 as kvexport writes them, with the
    float keys and values they stand for."""
    from kvexport.exporter.executorch.quantized_kv_cache import dequantize_rows, quantize_rows

    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, n, h, d, generator=g) * 3 for n, h in ((tokens, heads), (SLOTS, kv_heads), (SLOTS, kv_heads)))
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

    def method(tokens, heads, kv_heads, d, int8):
        key = tokens, heads, kv_heads, d, int8
        if key not in loaded:
            q, rows, _, _ = random_rows(tokens, heads, kv_heads, d, 0, int8)  # distinct tensors: export would alias equal ones
            exported = torch.export.export(OneCall(int8), (q, *rows, torch.tensor([tokens])), strict=False)
            program = Runtime.get().load_program(to_edge_transform_and_lower(exported).to_executorch().buffer)
            loaded[key] = program, program.load_method("forward")  # the method needs its program alive
        return loaded[key][1]

    return method


@pytest.mark.parametrize(("heads", "kv_heads", "d"), [(9, 3, 64), (4, 1, 256), (8, 8, 16), (6, 2, 12), (6, 2, 40)],
                         ids=["smollm2", "gemma3", "mha", "odd-head-dim", "head-dim-past-16s"])
@pytest.mark.parametrize("end", [1, 7, 256, 257, 700])
@pytest.mark.parametrize("tokens", [1, 3, 9], ids=["decode", "three-rows", "verification"])
@pytest.mark.parametrize("int8", [False, True], ids=["float", "int8"])
def test_the_kernel_attends_as_torch_does(programs, tokens, heads, kv_heads, d, end, int8):
    """Blocks of 256 positions, the last one partial, and a single position; scores large enough
    that most probabilities underflow (the scale is twice the usual). Several query rows: each the
    position before the next, causal (at ``end`` 257 the last row alone reaches the second block).
    An int8 cache against torch over its rows dequantized. The shapes and row counts take each of
    the kernel's paths: few rows folded (a head of 40: 8 values past its 16s) or many over
    transposed keys, values a row at a time or a tile at a time."""
    end = max(end, tokens)
    q, rows, k, v = random_rows(tokens, heads, kv_heads, d, end, int8)
    got = programs(tokens, heads, kv_heads, d, int8).execute([q, *rows, torch.tensor([end])])[0]
    causal = torch.arange(end)[None, :] <= torch.arange(end - tokens, end)[:, None]
    q, k, v = (x.double().transpose(1, 2) for x in (q, k[:, :end], v[:, :end]))  # float32 SDPA errs by more
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=causal, scale=d**-0.5 * 2, enable_gqa=True)
    # int8: the kernel scales its integer products (q·k_q − zero_point·Σq) rather than dequantizing first.
    torch.testing.assert_close(got, expected.transpose(1, 2).float(), atol=5e-5 if int8 else 2e-5, rtol=1e-4)


def test_the_ops_torch_math_is_causal_over_its_rows():
    """The reference the exported program runs eagerly (and ``torch.export`` traces through): each
    query row attends up to its own position, the last row everything."""
    from kvexport.kernels import decode_sdpa_reference

    q, (k, v), _, _ = random_rows(5, 4, 2, 8, 0, int8=False)
    out = decode_sdpa_reference(q, k, v, 12, 0.5)
    for row in range(5):
        alone = decode_sdpa_reference(q[:, row : row + 1], k, v, 12 - 4 + row, 0.5)
        torch.testing.assert_close(out[:, row : row + 1], alone, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-gemma3"])
def test_an_artifact_decoding_with_it_generates_eager_tokens(artifact, preset):
    """Full layers attend with the kernel in calls of up to ``MOST_TOKENS`` (decode steps, short
    prompts, verifications of drafts from prompt lookup) and with ExecuTorch's in longer ones
    (``PROMPT``); Gemma 3's rings as before."""
    from kvexport.kernels import MOST_TOKENS

    folder = artifact(preset, "executorch", decode_attention="kvexport", max_draft_tokens=4)
    assert b"kvexport::decode_sdpa\x00" in (folder / "model.pte").read_bytes()
    tokenizer, short_prompt = ArtifactTokenizer(folder), PROMPT[:12]
    assert len(tokenizer.encode(short_prompt)) <= MOST_TOKENS < len(tokenizer.encode(PROMPT))
    for draft in (None, "ngram"):
        report = run_check(folder, [(PROMPT, 20), (short_prompt, 20)], draft=draft, draft_tokens=3)
        assert report.ok, report.prompts


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-gemma3"])
def test_an_int8_cache_decodes_as_the_float_kernel_over_its_rows_dequantized(artifact, preset):
    """The same int8 rows (ExecuTorch's per-token scheme, written by the same program) read in place
    by the kernel, and dequantized into ``llama::custom_sdpa`` (``--int8-kv-sdpa dequantized``):
    the same logits within float32 rounding, call after call past tiny Gemma 3's window."""
    kernel = load_program(artifact(preset, "executorch", kv_cache="int8", decode_attention="kvexport"))
    dequantized = load_program(artifact(preset, "executorch", kv_cache="int8", int8_kv_sdpa="dequantized"))
    assert kernel.manifest.facts["custom_ops"].count("kvexport::decode_sdpa_int8") == 1
    tokens = [(7 * i + 3) % 90 + 5 for i in range(40)]
    np.testing.assert_allclose(kernel.forward(tokens[:20], 0), dequantized.forward(tokens[:20], 0), atol=1e-4, rtol=0)
    calls = [(20, 25)] + [(position, position + 1) for position in range(25, len(tokens))]  # 5 tokens, then one at a time
    for first, end in calls:
        got, expected = kernel.forward(tokens[first:end], first), dequantized.forward(tokens[first:end], first)
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
