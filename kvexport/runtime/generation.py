"""Generation with an artifact program: one prefill call, then one call per new token.

numpy only, so the device runner can use it without torch.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from ..errors import InvalidOptionError, PromptTooLongError


@dataclass
class Sampling:
    """Greedy when ``temperature`` is 0."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self):
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidOptionError(f"temperature must be a finite number >= 0 (0 is greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:  # NaN fails this too
            raise InvalidOptionError(f"top-p must be in (0, 1], got {self.top_p}")
        if self.seed is not None and self.seed < 0:
            raise InvalidOptionError(f"the sampling seed must be >= 0, got {self.seed}")
        self._rng = np.random.default_rng(self.seed)

    def pick(self, logits: np.ndarray) -> int:
        if self.temperature == 0:
            return int(np.argmax(logits))
        z = logits.astype(np.float64) / self.temperature
        p = np.exp(z - z.max())
        p /= p.sum()
        if self.top_p < 1:
            order = np.argsort(-p)
            keep = order[: int(np.searchsorted(np.cumsum(p[order]), self.top_p)) + 1]
            mask = np.zeros_like(p)
            mask[keep] = p[keep]
            p = mask / mask.sum()
        return int(self._rng.choice(len(p), p=p))


@dataclass
class Generation:
    prompt_ids: list[int]
    new_ids: list[int] = field(default_factory=list)
    stopped_by: str = "max_new_tokens"  # or "eos", "max_cache_len"
    text: str = ""  # new_ids decoded, where a tokenizer was at hand
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0

    @property
    def prefill_tokens_per_s(self) -> float:
        return len(self.prompt_ids) / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        # The first new token comes from the prefill call; each later one costs one decode call.
        steps = len(self.new_ids) - 1
        return steps / self.decode_seconds if steps > 0 and self.decode_seconds else 0.0


def check_fits(prompt_len: int, max_new_tokens: int | None, max_cache_len: int) -> None:
    """Refuse, before running anything, a generation that cannot fit in the cache."""
    if prompt_len == 0:
        raise InvalidOptionError("the prompt is empty; give some text")
    if max_new_tokens is not None and max_new_tokens < 1:
        raise InvalidOptionError(f"--max-new-tokens must be at least 1, got {max_new_tokens}")
    if prompt_len > max_cache_len:
        raise PromptTooLongError(
            f"the prompt is {prompt_len} tokens, longer than the artifact's max_cache_len {max_cache_len}; "
            "shorten it or re-export with a larger --max-cache-len"
        )
    # The last new token is never fed back, so prompt + N - 1 positions are written.
    if max_new_tokens is not None and prompt_len + max_new_tokens - 1 > max_cache_len:
        raise PromptTooLongError(
            f"prompt ({prompt_len} tokens) + --max-new-tokens {max_new_tokens} exceeds the artifact's "
            f"max_cache_len {max_cache_len}; ask for at most {max_cache_len - prompt_len + 1} new tokens "
            "or re-export with a larger --max-cache-len"
        )


def check_call(tokens: list[int], start: int, next_start: int, max_cache_len: int, rewind: int = 0) -> None:
    """A call a program takes: some tokens, inside the cache, where the sequence is (or at 0, a new
    one, or up to ``rewind`` positions before: after drafted tokens a verification rejected)."""
    end = start + len(tokens)
    if not tokens:
        raise InvalidOptionError("forward needs at least one token")
    if end > max_cache_len:
        raise PromptTooLongError(f"positions {start}..{end - 1} do not fit in the artifact's max_cache_len {max_cache_len}")
    if start != 0 and not next_start - rewind <= start <= next_start:
        back = f", or up to {rewind} positions before (the artifact's max_draft_tokens)" if rewind else ""
        raise InvalidOptionError(
            f"calls must be contiguous: this one starts at {start}, the sequence is at {next_start}{back} "
            "(start at 0 for a new sequence)"
        )


def check_rows_by_position(manifest) -> None:
    """Refuse to draft with an artifact that cannot go back over rejected drafts at all."""
    if not manifest.rows_by_position:
        raise InvalidOptionError(
            "--draft: the drafting artifact holds a state, another layer's cache or a chunked-attention ring, "
            "which cannot go back over rejected drafts; draft with an artifact of full or sliding layers, or ngram"
        )


def check_verification(tokens: list[int], max_draft_tokens: int) -> None:
    """A verification a program takes: the last chosen token and at most ``max_draft_tokens`` drafted ones."""
    if not max_draft_tokens:
        raise InvalidOptionError("this artifact does not verify drafted tokens; re-export it with --max-draft-tokens")
    if len(tokens) > max_draft_tokens + 1:
        raise InvalidOptionError(f"a verification takes at most {max_draft_tokens + 1} tokens, got {len(tokens)}")


def generate(
    program,
    prompt_ids: list[int],
    max_new_tokens: int | None,
    eos_ids: set[int] = frozenset(),
    sampling: Sampling | None = None,
    on_token: Callable[[int], None] | None = None,
    on_logits: Callable[[int, np.ndarray], bool] | None = None,
    start: int = 0,
) -> Generation:
    """Generate up to ``max_new_tokens`` (``None``: until EOS or the cache is full).

    ``start``: the position ``prompt_ids`` are fed from; the cache already holds the ``start``
    positions before it (a chat's earlier turns), and the fit check counts them.

    ``on_logits(step, logits)`` sees the logits each new token is chosen from; returning False
    stops the generation (the parity check uses it to stop at a divergence).
    """
    max_cache_len = program.manifest.max_cache_len
    if not prompt_ids:
        check_fits(0, max_new_tokens, max_cache_len)
    check_fits(start + len(prompt_ids), max_new_tokens, max_cache_len)
    sampling = sampling or Sampling()
    result = Generation(list(prompt_ids))
    limit = max_new_tokens if max_new_tokens is not None else max_cache_len - start - len(prompt_ids) + 1

    t0 = time.perf_counter()
    logits = program.forward(list(prompt_ids), start)
    result.prefill_seconds = time.perf_counter() - t0
    pos = start + len(prompt_ids)
    t0 = time.perf_counter()
    while True:
        if on_logits is not None and on_logits(len(result.new_ids), logits) is False:
            result.stopped_by = "caller"
            break
        token = sampling.pick(logits)
        result.new_ids.append(token)
        if on_token is not None:
            on_token(token)
        if token in eos_ids:
            result.stopped_by = "eos"
            break
        if len(result.new_ids) >= limit:
            result.stopped_by = "max_new_tokens" if max_new_tokens is not None else "max_cache_len"
            break
        logits = program.forward([token], pos)
        pos += 1
    result.decode_seconds = time.perf_counter() - t0
    return result
