"""The wrapper in eager PyTorch against transformers' own generate, for every preset."""

from __future__ import annotations

import pytest
import torch

from kvexport.exporter.decoder import ExportableDecoder
from kvexport.exporter.onnx.decoder import ExternalCacheDecoder

from tests.conftest import NEW_TOKENS, PROMPT, TEST_CACHE_LEN
from tests.helpers import FP32_LOGIT_ATOL, assert_generation_matches, eager_reference, greedy_with, torch_forward


def test_wrapper_matches_eager_past_the_window(tiny):
    name, model, tokenizer = tiny
    ids = tokenizer(PROMPT).input_ids
    expected = eager_reference(model, ids, NEW_TOKENS)
    decoder = ExportableDecoder(model, TEST_CACHE_LEN)
    got = greedy_with(torch_forward(decoder), ids, NEW_TOKENS)
    assert_generation_matches(got, expected, FP32_LOGIT_ATOL, name)


@pytest.mark.parametrize("chunks", [[1] * 44, [5, 13, 26], [40, 4]])
def test_chunked_prefill_matches_one_call(chunks):
    # A hybrid (ring + static) preset, prompt fed in calls shorter and longer than the window (6).
    from kvexport.models.presets import build_preset

    model, tokenizer = build_preset("tiny-gemma3")
    ids = tokenizer(PROMPT).input_ids
    assert len(ids) == sum(chunks)
    expected = eager_reference(model, ids, NEW_TOKENS)
    decoder = ExportableDecoder(model, TEST_CACHE_LEN)
    got = greedy_with(torch_forward(decoder), ids, NEW_TOKENS, chunks=chunks)
    assert_generation_matches(got, expected, FP32_LOGIT_ATOL, f"chunks {chunks}")


def test_a_new_sequence_at_position_zero_ignores_the_previous_one():
    from kvexport.models.presets import build_preset

    model, tokenizer = build_preset("tiny-mistral")
    decoder = ExportableDecoder(model, TEST_CACHE_LEN)
    forward = torch_forward(decoder)
    greedy_with(forward, tokenizer("something else entirely, and long").input_ids, 10)
    ids = tokenizer(PROMPT).input_ids
    assert_generation_matches(greedy_with(forward, ids, NEW_TOKENS), eager_reference(model, ids, NEW_TOKENS), FP32_LOGIT_ATOL, "reuse")


def external_cache_forward(decoder: ExternalCacheDecoder):
    """``forward(tokens, start)`` over the external-cache wrapper, with the cache rules of
    kvexport.json's ``interface`` written in torch (the ONNX runner's, without ONNX): calls of at
    most W tokens, each ring buffer's rows kept contiguous in positions from row ``ring_start``."""
    window = min((layer.window for layer in decoder.caches if layer.window), default=None)
    buffers = []
    for layer, spec in zip(decoder.caches, decoder.specs):
        rows = 2 * layer.window if layer.window else decoder.max_cache_len
        buffers.append([torch.zeros(1, spec.kv_heads, rows, spec.head_dim) for _ in range(2)])
    rows_in_use = 0

    def call(tokens, start):
        nonlocal rows_in_use
        ring_start = []
        if window:
            if start == 0:
                rows_in_use = 0
            elif rows_in_use + len(tokens) > 2 * window:  # the last W - 1 rows to the top
                keep = window - 1
                for layer, kv in zip(decoder.caches, buffers):
                    for buffer in kv if layer.window else []:
                        buffer[:, :, :keep] = buffer[:, :, rows_in_use - keep : rows_in_use].clone()
                rows_in_use = keep
            ring_start = [torch.tensor([rows_in_use])]
        past = [b for kv in buffers for b in kv]
        with torch.no_grad():
            logits, *present = decoder(torch.tensor([tokens]), torch.tensor([start]), *ring_start, *past)
        for buffer, written in zip(past, present):  # present is the buffer with the call's rows written
            buffer.copy_(written)
        rows_in_use += len(tokens)
        return logits

    def forward(tokens, start):
        step = window or len(tokens)
        for first in range(0, len(tokens), step):
            logits = call(tokens[first : first + step], start + first)
        return logits[0].numpy()

    return forward


@pytest.mark.parametrize("chunks", [None, [5, 13, 26], [1] * 44])
def test_external_cache_wrapper_matches_eager(chunks):
    from kvexport.models.presets import build_preset

    model, tokenizer = build_preset("tiny-gemma3")
    ids = tokenizer(PROMPT).input_ids
    expected = eager_reference(model, ids, NEW_TOKENS)
    forward = external_cache_forward(ExternalCacheDecoder(model, TEST_CACHE_LEN))
    assert_generation_matches(greedy_with(forward, ids, NEW_TOKENS, chunks=chunks), expected, FP32_LOGIT_ATOL, f"chunks {chunks}")


def test_external_cache_wrapper_with_one_kv_head_matches_eager():
    # One KV head, as Gemma 3 270M has (the tiny presets have two).
    from kvexport.models.presets import PRESETS, build_tiny, tiny_config

    model_type, overrides = PRESETS["tiny-gemma3"]
    model, tokenizer = build_tiny(tiny_config(model_type, {**overrides, "num_key_value_heads": 1}))
    ids = tokenizer(PROMPT).input_ids
    forward = external_cache_forward(ExternalCacheDecoder(model, TEST_CACHE_LEN))
    got = greedy_with(forward, ids, NEW_TOKENS, chunks=[5, 13, 26])
    assert_generation_matches(got, eager_reference(model, ids, NEW_TOKENS), FP32_LOGIT_ATOL, "one kv head")
