"""Speculative decoding that changes no token: a drafter proposes up to ``k`` tokens, one
verification call of the artifact scores the last chosen token and all of them, and the longest
prefix the model itself picks is kept, followed by the model's own next token. Greedy only: each
kept token is the argmax of the model's own logits at its position, as in plain decoding.

The verification is the program's ``verify`` (an artifact exported with ``--max-draft-tokens``): the
logits of every position of a call, and a next call that may start where the accepted tokens end,
before the rejected ones.

Drafters (``prefill(context)`` once a generation, then ``propose(context, k) -> tokens``; the
context is everything before the next token, a chat's earlier turns included):

- ``PromptLookup``: the tokens that followed the last earlier occurrence of the context's final
  n-gram (prompt lookup decoding); no second model. Strong where the answer copies its prompt.
- ``ModelDrafter``: another artifact with the same tokenizer (the same model at 4 bits, or a smaller
  one of its family), greedy, its own cache kept in step with the conversation.

numpy only, as ``generation``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import InvalidOptionError
from .generation import Generation, check_fits

NGRAM = "ngram"  # --draft's value for prompt lookup


class PromptLookup:
    """Prompt lookup: find the context's last ``n`` tokens earlier in it (the longest ``n`` up to
    ``max_ngram`` that occurs), and propose what followed the latest occurrence."""

    def __init__(self, max_ngram: int = 3):
        self.max_ngram = max_ngram

    def prefill(self, context: list[int]) -> None:
        """Nothing to feed: the context is searched as each proposal is made."""

    def propose(self, context: list[int], k: int) -> list[int]:
        for n in range(min(self.max_ngram, len(context) - 1), 0, -1):
            tail = context[-n:]
            for i in range(len(context) - n - 1, -1, -1):
                if context[i : i + n] == tail:
                    return context[i + n : i + n + k]
        return []


def common_prefix_length(a: list[int], b: list[int]) -> int:
    """How many ids ``a`` and ``b`` share from their start."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


class ModelDrafter:
    """Greedy drafts from another artifact's program. Its cache holds the tokens it was fed
    (``fed``, from position 0); a prefill or proposal feeds what the context has beyond their
    common prefix, going back over drafts that were rejected (``reach_back``),
    or from position 0 where it would have to go back further (a chat turn whose template renders
    the earlier ones differently)."""

    def __init__(self, program):
        self.program = program
        self.fed: list[int] = []
        self.rewind = program.manifest.rewind
        self.exact = True  # whether going back leaves the cache as a program that never went further has it
        self.max_cache_len = program.manifest.max_cache_len

    def reach_back(self, rejected: int) -> None:
        """Go back over up to ``rejected`` drafts after a verification: exactly where the program
        can (``draft_rewind``), else as near as a ring without spare slots does."""
        if rejected > self.rewind:
            self.exact = self.program.draft_rewind(rejected)
            self.rewind = rejected

    def prefill(self, context: list[int]) -> None:
        """Feed the prompt, before the first proposal (which then feeds the tokens after it only)."""
        if len(context) < self.max_cache_len:
            self._feed(context)

    def _feed(self, context: list[int]) -> np.ndarray:
        """Feed ``context`` beyond what the cache already holds of it (its last token always: its
        logits, returned, draft the next); ``fed`` is then ``context``."""
        common = common_prefix_length(self.fed, context[:-1])
        if common < len(self.fed) - self.rewind:
            common = 0
        logits = self.program.forward(context[common:], common)
        self.fed = list(context)
        return logits

    def propose(self, context: list[int], k: int) -> list[int]:
        k = min(k, self.max_cache_len - len(context))
        if k <= 0:
            return []
        logits = self._feed(context)
        drafts = [int(np.argmax(logits))]
        while len(drafts) < k:
            logits = self.program.forward([drafts[-1]], len(context) + len(drafts) - 1)
            drafts.append(int(np.argmax(logits)))
        self.fed = context + drafts[:-1]
        return drafts


@dataclass
class Speculation:
    """What a speculative generation did: verification calls, tokens drafted, tokens accepted."""

    draft_tokens: int
    calls: int = 0
    drafted: int = 0
    accepted: int = 0
    plain_calls: int = 0  # one-token calls where the drafter proposed nothing

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    def summary(self) -> dict:
        return {"draft_tokens": self.draft_tokens, "verify_calls": self.calls, "drafted": self.drafted,
                "accepted": self.accepted, "acceptance": round(self.acceptance, 4), "plain_calls": self.plain_calls}


@dataclass
class SpeculativeGeneration(Generation):
    speculation: Speculation = field(default_factory=lambda: Speculation(0))


def load_drafter(draft: str, stack: contextlib.ExitStack, device: str = "cpu"):
    """``--draft``: ``ngram`` (prompt lookup) or an artifact folder or archive with the same tokenizer
    (an archive's folder stays unpacked until ``stack`` closes)."""
    if draft == NGRAM:
        return PromptLookup()
    from ..artifact.archive import open_artifact
    from .programs import load_program

    path = Path(draft)
    if not path.exists():
        raise InvalidOptionError(f"--draft {draft}: give 'ngram' (prompt lookup) or an artifact folder or archive")
    folder, manifest = stack.enter_context(open_artifact(path))
    return ModelDrafter(load_program(folder, manifest, device))


def check_drafter(program, drafter, draft_tokens: int | None) -> int:
    """Refuse a speculative run the artifacts cannot do, before anything runs; the tokens drafted
    per verification (``draft_tokens``, default: the artifact's most)."""
    most = program.manifest.max_draft_tokens
    if not most:
        raise InvalidOptionError(
            "--draft: this artifact does not verify drafted tokens; re-export it with --max-draft-tokens K"
        )
    draft_tokens = most if draft_tokens is None else draft_tokens
    if not 1 <= draft_tokens <= most:
        raise InvalidOptionError(f"--draft-tokens must be from 1 to the artifact's max_draft_tokens ({most}), got {draft_tokens}")
    if isinstance(drafter, ModelDrafter):
        if drafter.program.manifest.vocab_size != program.manifest.vocab_size:
            raise InvalidOptionError(
                f"--draft: the drafting artifact's vocabulary ({drafter.program.manifest.vocab_size} tokens) is not "
                f"this artifact's ({program.manifest.vocab_size}); draft with a model of the same tokenizer"
            )
        drafter.reach_back(draft_tokens - 1)
    return draft_tokens


def generate_with_draft(
    program,
    prompt_ids: list[int],
    max_new_tokens: int | None,
    drafter,
    draft_tokens: int | None = None,
    eos_ids: set[int] = frozenset(),
    on_token: Callable[[int], None] | None = None,
    on_logits: Callable[[int, np.ndarray], bool] | None = None,
    cached_ids: list[int] = (),
) -> SpeculativeGeneration:
    """``generation.generate``, greedy, with drafted tokens verified ``draft_tokens`` at a time
    (default: the artifact's most): the same tokens, fewer calls. ``on_logits(step, logits)`` sees the logits each new token is
    chosen from, as there. ``cached_ids``: what the program's cache already holds at positions 0..
    (a chat's earlier turns; ``generate``'s ``start`` is their length), before ``prompt_ids``; the
    drafter sees them too."""
    max_cache_len = program.manifest.max_cache_len
    start = len(cached_ids)
    check_fits(start + len(prompt_ids), max_new_tokens, max_cache_len)
    draft_tokens = check_drafter(program, drafter, draft_tokens)
    result = SpeculativeGeneration(list(prompt_ids), speculation=Speculation(draft_tokens))
    stats = result.speculation
    limit = max_new_tokens if max_new_tokens is not None else max_cache_len - start - len(prompt_ids) + 1
    context = [*cached_ids, *prompt_ids]

    def choose(logits: np.ndarray) -> bool:
        """Append the model's token for ``logits``; False where the generation ends with it."""
        if on_logits is not None and on_logits(len(result.new_ids), logits) is False:
            result.stopped_by = "caller"
            return False
        token = int(np.argmax(logits))
        result.new_ids.append(token)
        if on_token is not None:
            on_token(token)
        if token in eos_ids:
            result.stopped_by = "eos"
            return False
        if len(result.new_ids) >= limit:
            result.stopped_by = "max_new_tokens" if max_new_tokens is not None else "max_cache_len"
            return False
        return True

    t0 = time.perf_counter()
    logits = program.forward(list(prompt_ids), start)
    drafter.prefill(context)  # a model drafter's prompt: before the first token, it drafts the second
    result.prefill_seconds = time.perf_counter() - t0
    t0 = time.perf_counter()
    going = choose(logits)
    pos = len(context)  # where the last chosen token goes
    while going:
        # Every drafted token kept adds one, and the call's last row one more: no more than the limit.
        room = min(draft_tokens, limit - len(result.new_ids) - 1)
        drafts = drafter.propose(context + result.new_ids, room) if room > 0 else []
        if not drafts:
            stats.plain_calls += 1
            going = choose(program.forward([result.new_ids[-1]], pos))
            pos += 1
            continue
        rows = program.verify([result.new_ids[-1], *drafts], pos)
        stats.calls += 1
        stats.drafted += len(drafts)
        kept = 0
        for i, row in enumerate(rows):
            going = choose(row)
            if not going or i == len(drafts) or result.new_ids[-1] != drafts[i]:
                break
            kept += 1
        stats.accepted += kept
        pos += kept + 1
    result.decode_seconds = time.perf_counter() - t0
    return result
