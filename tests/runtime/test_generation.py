"""The generation loop's limits and stopping rules, on a fake program with scripted logits."""

from __future__ import annotations

import numpy as np
import pytest

from kvexport.errors import InvalidOptionError, PromptTooLongError
from kvexport.runtime.generation import Sampling, check_fits, generate
from tests.helpers import fake_manifest


class ScriptedProgram:
    """Always prefers token (position % 5); records every call."""

    def __init__(self, max_cache_len=16, vocab=5):
        self.manifest = fake_manifest(max_cache_len=max_cache_len)
        self.vocab = vocab
        self.calls: list[tuple[list[int], int]] = []

    def forward(self, tokens, start):
        self.calls.append((list(tokens), start))
        logits = np.zeros(self.vocab, dtype=np.float32)
        logits[(start + len(tokens)) % self.vocab] = 1.0
        return logits


def test_prefill_once_then_one_call_per_token_at_contiguous_positions():
    program = ScriptedProgram()
    result = generate(program, [1, 2, 3], 4)
    assert result.new_ids == [3, 4, 0, 1]
    assert program.calls == [([1, 2, 3], 0), ([3], 3), ([4], 4), ([0], 5)]


def test_stops_at_eos_unless_told_otherwise():
    assert generate(ScriptedProgram(), [1, 2, 3], 4, eos_ids={4}).new_ids == [3, 4]
    assert generate(ScriptedProgram(), [1, 2, 3], 4, eos_ids=set()).new_ids == [3, 4, 0, 1]


def test_without_a_limit_it_stops_when_the_cache_is_full_and_says_so():
    program = ScriptedProgram(max_cache_len=8)
    result = generate(program, [1, 2, 3], None)
    assert result.stopped_by == "max_cache_len"
    assert len(result.new_ids) == 6  # positions 3..7 are fed back, the 6th token is not
    assert max(start + len(t) for t, start in program.calls) == 8  # never wraps past the cache


@pytest.mark.parametrize(
    "prompt_len, new, error",
    [(0, 4, InvalidOptionError), (4, 0, InvalidOptionError), (4, -1, InvalidOptionError), (17, 1, PromptTooLongError), (10, 8, PromptTooLongError)],
)
def test_refuses_what_cannot_fit_before_running(prompt_len, new, error):
    with pytest.raises(error):
        check_fits(prompt_len, new, 16)


def test_largest_generation_that_fits_is_accepted():
    check_fits(10, 7, 16)  # prompt 10 + 7 new writes positions 0..15


def test_sampling_is_reproducible_with_a_seed_and_respects_top_p():
    logits = np.array([2.0, 1.9, -5.0, -5.0], dtype=np.float32)
    draws = Sampling(1.0, 1.0, seed=3)
    again = Sampling(1.0, 1.0, seed=3)
    assert [draws.pick(logits) for _ in range(20)] == [again.pick(logits) for _ in range(20)]
    nucleus = Sampling(1.0, 0.5, seed=0)
    assert {nucleus.pick(logits) for _ in range(50)} == {0}  # token 0 alone holds >= 50% of the mass


def test_a_prompt_fed_from_a_later_position_continues_the_sequence_and_counts_it_in_the_fit():
    """``start``: the cache already holds positions 0..start-1 (a chat's earlier turns)."""
    program = ScriptedProgram(max_cache_len=8)
    result = generate(program, [1, 2], None, start=3)
    assert program.calls[0] == ([1, 2], 3)
    assert [start for _, start in program.calls] == [3, 5, 6, 7]
    assert result.stopped_by == "max_cache_len" and len(result.new_ids) == 4  # positions 5..7 fed back, the 4th not
    with pytest.raises(PromptTooLongError):
        generate(ScriptedProgram(max_cache_len=8), [1, 2], 5, start=3)  # 3 + 2 + 5 - 1 > 8
    with pytest.raises(InvalidOptionError, match="empty"):
        generate(ScriptedProgram(), [], 2, start=3)
