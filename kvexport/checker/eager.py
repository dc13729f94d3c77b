"""The reference: eager transformers' own greedy ``generate`` (its DynamicCache, its attention)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from transformers import (
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    StoppingCriteria,
    StoppingCriteriaList,
    SuppressTokensLogitsProcessor,
)

from ..errors import InvalidOptionError


def refuse_without_cuda() -> None:
    """``--device cuda`` (eager on the GPU) where torch sees none, refused in one line."""
    if not torch.cuda.is_available():
        raise InvalidOptionError("--device cuda: no CUDA GPU is available here (torch.cuda.is_available() is False)")


class _Observer(LogitsProcessor):
    """Hands the raw logits of each step to a callback; changes nothing."""

    def __init__(self, callback: Callable[[int, np.ndarray], None]):
        self.callback = callback
        self.step = 0

    def __call__(self, input_ids, scores):
        self.callback(self.step, scores[0].float().cpu().numpy())
        self.step += 1
        return scores


class _StopWhen(StoppingCriteria):
    def __init__(self, predicate: Callable[[], bool]):
        self.predicate = predicate

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), self.predicate(), dtype=torch.bool, device=input_ids.device)


def greedy_generate(
    model,
    prompt_ids: list[int],
    max_new_tokens: int,
    on_logits: Callable[[int, np.ndarray], None] | None = None,
    stop: Callable[[], bool] | None = None,
    suppress: Sequence[int] = (),
) -> list[int]:
    """``max_new_tokens`` greedy tokens from ``model.generate`` (EOS does not stop it); never one of
    ``suppress`` (``on_logits`` still sees their logits).

    The model's own generation config is set aside for the call: a repetition penalty or similar
    processor there would make "greedy" something other than the argmax of the logits.
    """
    device = next(model.parameters()).device
    input_ids = torch.tensor([prompt_ids], dtype=torch.long, device=device)
    processors = LogitsProcessorList([_Observer(on_logits)] if on_logits else [])
    if suppress:  # after the observer, so it sees the raw logits
        processors.append(SuppressTokensLogitsProcessor(list(suppress), device=device))
    saved = model.generation_config
    model.generation_config = GenerationConfig()
    try:
        with torch.no_grad():
            out = model.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
                logits_processor=processors or None,
                stopping_criteria=StoppingCriteriaList([_StopWhen(stop)]) if stop else None,
            )
    finally:
        model.generation_config = saved
    return out[0, len(prompt_ids):].tolist()


@dataclass
class RecordedGeneration:
    """Eager's greedy generation of one prompt kept whole, its tokens and each step's logits, so
    that the model can be let go before the artifact loads."""

    new_ids: list[int]
    logits: list[np.ndarray]

    def replay(self, on_logits: Callable[[int, np.ndarray], None], stop: Callable[[], bool] | None = None) -> list[int]:
        """What ``greedy_generate`` with ``on_logits`` and ``stop`` gave and did, from the record."""
        for step, logits in enumerate(self.logits):
            on_logits(step, logits)
            if stop is not None and stop():
                return self.new_ids[: step + 1]
        return self.new_ids


def record_greedy(model, prompt_ids: list[int], max_new_tokens: int, suppress: Sequence[int] = ()) -> RecordedGeneration:
    """``greedy_generate``'s tokens and every step's logits, kept."""
    logits: list[np.ndarray] = []
    new_ids = greedy_generate(model, prompt_ids, max_new_tokens, lambda step, x: logits.append(x.copy()), suppress=suppress)
    return RecordedGeneration(new_ids, logits)
