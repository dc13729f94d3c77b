"""The caches and masks against a plain full-history attention with transformers' mask semantics."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.masking_utils import and_masks, causal_mask_function, sliding_window_overlay

from kvexport.exporter.kv_cache import RingKVCache, StaticKVCache, additive_mask, ring_positions

HEADS, DIM = 2, 4


def reference_attention(q, k, v, window):
    """Attention of every query over the whole history, masked with transformers' own mask functions."""
    mask_fn = causal_mask_function if window is None else and_masks(causal_mask_function, sliding_window_overlay(window))
    n = q.shape[2]
    idx = [torch.tensor(i) for i in range(n)]
    visible = torch.tensor([[bool(mask_fn(idx[0], idx[0], qi, ki)) for ki in idx] for qi in idx])
    scores = q @ k.transpose(-1, -2) / DIM**0.5
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def cached_attention(cache, calls, q, k, v, window):
    """The same attention computed call by call through the cache and our masks."""
    outs, start = [], 0
    for n in calls:
        positions = torch.arange(start, start + n)
        keys, values = cache.update(positions, k[:, :, start:start + n], v[:, :, start:start + n])
        mask = additive_mask(cache.key_positions(positions), positions, window, torch.float32)
        scores = q[:, :, start:start + n] @ keys.transpose(-1, -2) / DIM**0.5 + mask
        outs.append(torch.softmax(scores, dim=-1) @ values)
        start += n
    return torch.cat(outs, dim=2)


@settings(max_examples=300, deadline=None)
@given(
    window=st.one_of(st.none(), st.integers(1, 12)),
    max_len=st.integers(1, 40),
    calls=st.lists(st.integers(1, 16), min_size=1, max_size=10),
    seed=st.integers(0, 2**16),
)
def test_cache_attention_equals_full_history(window, max_len, calls, seed):
    # Calls of random lengths (a prefill, then decodes or further chunks) up to the cache size.
    kept, total = [], 0
    for n in calls:
        n = min(n, max_len - total)
        if n <= 0:
            break
        kept.append(n)
        total += n
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, HEADS, total, DIM, generator=gen) for _ in range(3))
    if window is not None and window < max_len:
        cache = RingKVCache(1, HEADS, window, DIM, torch.float32)
    else:  # a window as long as the cache never hides anything: a static layer serves it
        cache = StaticKVCache(1, HEADS, max_len, DIM, torch.float32)
    got = cached_attention(cache, kept, q, k, v, window)
    torch.testing.assert_close(got, reference_attention(q, k, v, window), atol=1e-5, rtol=1e-5)


@given(start=st.integers(0, 200), window=st.integers(1, 20))
def test_ring_positions_are_the_newest_before_start(start, window):
    got = ring_positions(torch.tensor([start]), window).tolist()
    for slot, pos in enumerate(got):
        written = [p for p in range(start) if p % window == slot]
        assert pos == (written[-1] if written else pos), (slot, pos, written)
        assert (pos >= 0) == bool(written)


def test_ring_keeps_newest_tokens_of_a_call_longer_than_the_window():
    ring = RingKVCache(1, 1, 4, 1, torch.float32)
    values = torch.arange(10, dtype=torch.float32).view(1, 1, 10, 1)  # the value is the position
    ring.update(torch.arange(10), values, values)
    assert ring.k.flatten().tolist() == [8.0, 9.0, 6.0, 7.0]  # slot p % 4 holds the newest p
