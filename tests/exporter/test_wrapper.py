"""The wrapper in eager PyTorch against transformers' own generate, for every preset."""

from __future__ import annotations

import pytest

from kvexport.exporter.wrapper import ExportableDecoder

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
