"""``--kv-cache int8`` on the ExecuTorch target: what the export records and refuses, and the lowered
program against the module it was lowered from.

The cache's arithmetic (positions, rings, masks, the int8 rows) is tested against attention over the
whole history in ``tests/exporter/test_kv_cache.py``; the int8 artifacts against eager transformers
by agreement in ``matrices/tiny.toml`` (tiny presets) and on the real models
(docs/quantization.md#int8-kv-cache).
"""

from __future__ import annotations

import pytest
import torch

from kvexport.exporter.decoder import ExportableDecoder
from kvexport.exporter.executorch.quantized_kv_cache import QUANTIZED_CACHES
from kvexport.exporter.executorch.target import INT8_KV_ROW_EXTRA_BYTES
from kvexport.exporter.pipeline import ExportOptions, plan_export
from kvexport.models.presets import WINDOW, build_preset
from kvexport.runtime.programs import load_program

from tests.conftest import NEW_TOKENS, PROMPT, TEST_CACHE_LEN
from tests.helpers import assert_generation_matches, assert_one_line_error, greedy_with, run_cli, torch_forward


def test_an_int8_cache_counts_its_rows_scales_and_zero_points(tmp_path):
    """tiny-gemma3: a ring of 6 slots, a full layer of 64 positions, one KV head of 16."""
    plans = {kv: plan_export(ExportOptions("tiny-gemma3", max_cache_len=64, kv_cache=kv, out=tmp_path / kv)) for kv in ("float", "int8")}
    rows = sum(2 * layer.kv_heads * layer.slots for layer in plans["int8"].layers())
    assert rows == 2 * (6 + 64)
    assert plans["int8"].kv_cache_bytes == rows * (16 + INT8_KV_ROW_EXTRA_BYTES)
    assert plans["float"].kv_cache_bytes == rows * 16 * 4
    assert "KV cache int8 " in plans["int8"].summary()


@pytest.mark.parametrize(
    "args, phrases",
    [
        (["tiny-llama", "--kv-cache", "int4"], ["unknown --kv-cache 'int4'", "float, int8"]),
        (["tiny-gemma2", "--kv-cache", "int8"], ["--kv-cache int8 does not export soft-capped attention", "--kv-cache float", "--target onnx"]),
        (["tiny-llama", "--int8-kv-sdpa", "int4"], ["unknown --int8-kv-sdpa 'int4'", "auto, quantized, dequantized"]),
        (["tiny-llama", "--int8-kv-sdpa", "quantized"], ["--int8-kv-sdpa goes with --kv-cache int8", "--kv-cache float"]),
        (["tiny-llama", "-t", "onnx", "--kv-cache", "int8", "--int8-kv-sdpa", "dequantized"],
         ["--int8-kv-sdpa is for --target executorch", "--target onnx"]),
    ],
    ids=["unknown", "soft-capped", "unknown-kernel", "kernel-without-int8", "kernel-for-onnx"],
)
def test_kv_cache_mistakes_get_one_line_before_loading(tmp_path, capsys, monkeypatch, args, phrases):
    from kvexport.exporter import pipeline

    monkeypatch.setattr(pipeline.sources, "load_model", lambda *a, **k: pytest.fail("loaded the model"))
    code, _, err = run_cli(capsys, "export", *args, "-o", tmp_path / "x")
    assert_one_line_error(code, err, *phrases)
    assert not (tmp_path / "x").exists()


def test_the_int8_pte_computes_what_its_module_computes(artifact):
    """gpt-oss: attention sinks, so both its sliding and its full layers read the rows dequantized
    (the path no fused kernel takes). The lowered program generates what the same module does in
    eager PyTorch, past the window; ``manifest`` and buffers say int8."""
    model, tokenizer = build_preset("tiny-gpt-oss")
    ids = tokenizer(PROMPT).input_ids
    folder = artifact("tiny-gpt-oss", kv_cache="int8")
    program = load_program(folder)
    assert program.manifest.kv_cache["dtype"] == "int8"
    module = ExportableDecoder(model, TEST_CACHE_LEN, QUANTIZED_CACHES)
    assert {cache.k.dtype for cache in module.caches} == {torch.int8}
    expected = greedy_with(torch_forward(module), ids, NEW_TOKENS)
    assert_generation_matches(greedy_with(program.forward, ids, NEW_TOKENS), expected, 1e-3, "tiny-gpt-oss int8 KV")


HEADS, KV_HEADS, HEAD_DIM, SLOTS, START = 9, 3, 16, 40, 13  # SmolLM2's query-head groups


def _call(tokens: int, masked: bool):
    """int8 rows of ``SLOTS`` positions, a call's query of ``tokens`` rows from ``START``, its mask
    (causal from the start, some keys hidden too where ``masked``), ``by_length``'s arguments for it,
    and the reference attention over the dequantized rows of a given query."""
    from kvexport.exporter.executorch.quantized_kv_cache import dequantize_rows, quantize_rows

    rows = tuple(r for _ in range(2) for r in quantize_rows(torch.randn(1, SLOTS, KV_HEADS, HEAD_DIM)))
    keys, values = (dequantize_rows(*rows[i:i + 3], torch.float32) for i in (0, 3))
    visible = torch.arange(SLOTS)[None] <= START + torch.arange(tokens)[:, None]
    if masked:
        visible &= torch.rand(tokens, SLOTS) > 0.3
        visible[:, 0] = True
    mask = torch.zeros(tokens, SLOTS).masked_fill(~visible, float("-inf"))
    query = torch.randn(1, HEADS, tokens, HEAD_DIM)
    args = dict(mask=mask) if masked else dict(first=torch.tensor([START]))
    k, v = (x.transpose(1, 2).repeat_interleave(HEADS // KV_HEADS, dim=1) for x in (keys, values))

    def reference(q):
        return (torch.softmax(q @ k.transpose(-1, -2) / HEAD_DIM**0.5 + mask, dim=-1) @ v).transpose(1, 2)

    return rows, query, mask, args, reference


@pytest.mark.parametrize("masked", [False, True])
def test_a_longer_call_attends_in_float_over_the_rows_the_one_token_kernel_reads(masked):
    """A one-token call is the int8 kernel itself; a longer one (prefill, a verification) is softmax
    attention over the dequantized rows with the query rounded as that kernel rounds it, causal from
    the call's start or under its mask (9 query heads over 3 KV heads, as SmolLM2's)."""
    from kvexport.exporter.executorch.quantized_kv_cache import by_length, dequantize_rows, quantize_rows, quantized_sdpa

    torch.manual_seed(0)
    tokens = 6
    rows, query, mask, args, reference = _call(tokens, masked)
    got = by_length(query, rows, None, **args)
    rounded = dequantize_rows(*quantize_rows(query.transpose(1, 2)), torch.float32).transpose(1, 2)
    torch.testing.assert_close(got, reference(rounded), atol=1e-5, rtol=1e-5)

    one = query[:, :, -1:]
    last = START + tokens - 1
    one_args = dict(mask=mask[-1:]) if masked else dict(first=torch.tensor([last]))
    kernel = quantized_sdpa(one, rows, 0 if masked else last, mask[-1:] if masked else None, None)
    assert torch.equal(by_length(one, rows, None, **one_args), kernel)


def test_the_float_kernels_dequantization_is_the_reference_bit_for_bit():
    """``as_float`` (a per-tensor dequantize, a subtraction, a product) against
    ``quantized_decomposed``'s per-token dequantize in float64, rows of every range."""
    from kvexport.exporter.executorch.quantized_kv_cache import as_float, dequantize_rows, quantize_rows

    torch.manual_seed(0)
    x = torch.randn(1, 50, 3, 16) * torch.logspace(-4, 4, 50)[None, :, None, None] + torch.randn(1, 50, 3, 1)
    rows = quantize_rows(x)
    assert torch.equal(as_float(*rows), dequantize_rows(*rows, torch.float32))


@pytest.mark.parametrize("tokens", [1, 6])
@pytest.mark.parametrize("masked", [False, True])
def test_without_the_int8_kernel_every_call_attends_in_float_over_the_dequantized_rows(masked, tokens):
    """``int8_kernel=False`` (``--int8-kv-sdpa dequantized``): a decode step as a longer call,
    softmax attention over the dequantized rows with the query as it is (9 query heads over 3 KV
    heads), causal from the call's start or under its mask."""
    from kvexport.exporter.executorch.quantized_kv_cache import by_length

    torch.manual_seed(1)
    rows, query, _, args, reference = _call(tokens, masked)
    got = by_length(query, rows, None, int8_kernel=False, **args)
    torch.testing.assert_close(got, reference(query), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("machine, chosen", [("aarch64", "quantized"), ("arm64", "quantized"), ("x86_64", "dequantized")])
def test_auto_takes_the_int8_kernel_where_its_products_are_neon_kernels(monkeypatch, machine, chosen):
    from kvexport.exporter.executorch import target

    monkeypatch.setattr(target.platform, "machine", lambda: machine)
    assert target.choose_int8_kv_sdpa("auto", "int8") == chosen
    assert target.choose_int8_kv_sdpa("quantized", "int8") == "quantized"  # what the user asked for
    assert target.choose_int8_kv_sdpa("auto", "float") is None  # a float cache has no such choice


@pytest.mark.parametrize("kernel", ["quantized", "dequantized"])
def test_the_int8_pte_of_either_kernel_computes_what_its_module_computes(artifact, kernel):
    """tiny-gemma3: rings and a full layer of one KV head, plain softmax attention (the fused
    kernels' path); the lowered program generates what the same module does in eager PyTorch past
    the window, the prompt in two calls, the second longer than one token and starting after the
    rings have wrapped (where a call reads rows its own writes replace), and records the kernel it
    was exported with. Keys and values are rounded to int8 as
    they are written (and the int8 kernel's query too), so the delegate's float differences move an
    element by a rounding step now and then: the logits agree within 1e-2."""
    from kvexport.exporter.executorch.quantized_kv_cache import quantized_caches

    model, tokenizer = build_preset("tiny-gemma3")
    ids = tokenizer(PROMPT).input_ids
    program = load_program(artifact("tiny-gemma3", kv_cache="int8", int8_kv_sdpa=kernel))
    assert program.manifest.export_options["int8_kv_sdpa"] == kernel
    module = ExportableDecoder(model, TEST_CACHE_LEN, quantized_caches(int8_kernel=kernel == "quantized"))
    chunks = [WINDOW + 4, len(ids) - WINDOW - 4]
    expected = greedy_with(torch_forward(module), ids, NEW_TOKENS, chunks)
    actual = greedy_with(program.forward, ids, NEW_TOKENS, chunks)
    assert_generation_matches(actual, expected, 1e-2, f"tiny-gemma3 int8 KV {kernel}")
