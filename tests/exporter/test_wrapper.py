"""The wrapper in eager PyTorch against transformers' own generate, for every preset."""

from __future__ import annotations

import pytest
import torch

from kvexport.exporter.wrapper import ExportableDecoder, ExternalCacheDecoder

from ..conftest import NEW_TOKENS, PROMPT, TEST_CACHE_LEN
from ..helpers import FP32_LOGIT_ATOL, assert_generation_matches, eager_reference, greedy_with, torch_forward


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
    kvexport.json's ``interface`` written in torch (the ONNX runner's, without ONNX)."""
    buffers = []
    for layer, spec in zip(decoder.caches, decoder.specs):
        if layer.window:  # a sequence-major ring
            shape = (1, layer.window, spec.kv_heads, spec.head_dim)
        else:  # a head-major static buffer
            shape = (1, spec.kv_heads, decoder.max_cache_len, spec.head_dim)
        buffers.append([torch.zeros(shape) for _ in range(2)])

    def forward(tokens, start):
        n = len(tokens)
        past = [b for kv in buffers for b in kv]
        with torch.no_grad():
            logits, *present = decoder(torch.tensor([tokens]), torch.tensor([start]), *past)
        for layer, kv, rows in zip(decoder.caches, buffers, zip(present[0::2], present[1::2])):
            for buffer, new in zip(kv, rows):
                if layer.window is None:  # present is the whole buffer, rows start .. start+n-1 written
                    buffer.copy_(new)
                else:  # the newest token of each slot
                    keep = min(n, layer.window)
                    buffer[:, [p % layer.window for p in range(start + n - keep, start + n)]] = new[:, n - keep:]
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
