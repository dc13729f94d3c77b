"""``--sdpa-query auto``: which query rows attention gives ``llama::custom_sdpa``, timed on this machine.

ExecuTorch's kernel computes its products with the BLAS the runtime links. ``grouped`` (a decode
step's query heads stacked per KV head, each cached row read once; ``custom_op_cache.causal_sdpa``)
makes them small matrix products, ``per-head`` (the kernel's own call, one row per query head)
matrix-vector ones. Which is faster depends on that BLAS on that CPU, and somewhat on the shape:
libtorch's MKL, which ExecuTorch's pip wheel calls, favoured grouped on an Intel CPU and per-head
on an AMD one (docs/performance.md#which-query-rows-a-decode-step-gives-the-kernel).

``auto`` times one decode step's calls of both over a few layers' own buffers at the model's shape
and keeps per-head only where it is clearly the faster, since a real step reads its buffers from
memory, where reading each row once counts more than here. Each form's time is its fastest
round: other load on the machine slows a round (grouped's matrix products, threaded by the BLAS,
the most), never speeds one up."""

from __future__ import annotations

import time

from ...choices import SdpaQuery
from ...models.architecture import NONE, RING, SHARED, STATIC

# The cached positions the calls are timed at (or the cache's length, if shorter), the layers
# whose own buffers they read in turn, and the rounds whose fastest is taken.
TIMED_POSITIONS = 1024
TIMED_LAYERS = 8
ROUNDS = 5
# per-head is kept where its step takes less than this share of grouped's.
PER_HEAD_BELOW = 0.9


def timed_shape(text_config, specs: list, max_cache_len: int) -> tuple[int, int, int, int] | None:
    """``(query heads, KV heads, head_dim, positions)`` of the first layer whose attention calls
    ``custom_sdpa`` with query-head groups (a full layer, or a ring of more than one KV head), or
    None where no layer does (the choice changes nothing)."""
    heads = text_config.num_attention_heads
    for spec in specs:
        kind = spec.cache_kind(max_cache_len)
        if kind in (NONE, SHARED) or not spec.has_kv or heads <= spec.kv_heads:
            continue
        if kind == STATIC or (kind == RING and spec.kv_heads > 1):
            return heads, spec.kv_heads, spec.head_dim, min(spec.cache_slots(max_cache_len), TIMED_POSITIONS)
    return None


def step_microseconds(heads: int, kv_heads: int, head_dim: int, positions: int) -> dict[SdpaQuery, float]:
    """µs of one decode step's calls over ``TIMED_LAYERS`` layers' buffers, each form, the fastest
    of ``ROUNDS`` rounds taken in turn."""
    import torch

    from .custom_op_cache import causal_sdpa

    slots = (1, positions + 1, kv_heads, head_dim)
    layers = [(torch.randn(slots), torch.randn(slots)) for _ in range(TIMED_LAYERS)]
    query, first = torch.randn(1, heads, 1, head_dim), torch.tensor([positions - 1])
    forms = {SdpaQuery.GROUPED: True, SdpaQuery.PER_HEAD: False}

    def step(grouped: bool) -> float:
        start = time.perf_counter()
        for k, v in layers:
            causal_sdpa(query, k, v, first, None, grouped)
        return time.perf_counter() - start

    times: dict[SdpaQuery, list[float]] = {form: [] for form in forms}
    for form, grouped in forms.items():
        step(grouped)  # warm-up
    for _ in range(ROUNDS):
        for form, grouped in forms.items():
            times[form].append(step(grouped))
    return {form: min(t) * 1e6 for form, t in times.items()}


def choose(requested: SdpaQuery, text_config, specs: list, max_cache_len: int) -> tuple[SdpaQuery | None, dict | None]:
    """The form to export, and the timings ``auto`` chose it by; ``(None, None)`` for ``auto``
    where no layer's attention depends on it."""
    if requested != SdpaQuery.AUTO:
        return requested, None
    shape = timed_shape(text_config, specs, max_cache_len)
    if shape is None:
        return None, None
    times = step_microseconds(*shape)
    return faster(times), times


def faster(times: dict[SdpaQuery, float]) -> SdpaQuery:
    """per-head where its step takes under ``PER_HEAD_BELOW`` of grouped's, else grouped."""
    return SdpaQuery.PER_HEAD if times[SdpaQuery.PER_HEAD] < PER_HEAD_BELOW * times[SdpaQuery.GROUPED] else SdpaQuery.GROUPED
