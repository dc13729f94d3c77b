"""The caches and masks against a plain full-history attention with transformers' mask semantics.

Three cache families are checked: the plain ones (``kv_cache``), the ones the ExecuTorch target
ships (``custom_op_cache``: ExecuTorch's ``llama::update_cache`` and ``llama::custom_sdpa``, and
a ring's ``window_attention``, run eagerly here) and its int8 ones (``quantized_kv_cache``: the
same, with ``llama::custom_quantized_sdpa`` or, ``--int8-kv-sdpa dequantized``, ``custom_sdpa`` over
the rows dequantized), these against attention over their rows quantized (keys and queries
rotated first, as the cache does). Each example drives a cache through random call
lengths (a prefill, decode steps, chunks, calls longer than the window), after a random earlier
sequence whose leftovers must be invisible: a runner starts a new sequence at position 0 without
clearing anything.
"""

from __future__ import annotations

from functools import partial
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.masking_utils import and_masks, causal_mask_function, chunked_overlay, sliding_window_overlay

from kvexport.exporter.executorch.custom_op_cache import CustomOpRingCache, CustomOpStaticCache
from kvexport.exporter.executorch.quantized_kv_cache import (
    QuantizedRingCache,
    QuantizedStaticCache,
    dequantize_rows,
    key_rotation,
    quantize_rows,
)
from kvexport.exporter.kv_cache import (
    CallState,
    ConvState,
    GatedDeltaState,
    Mamba2State,
    RingKVCache,
    StaticKVCache,
    additive_mask,
    ring_positions,
)
from kvexport.models.architecture import layer_specs

HEADS, DIM = 2, 4
KV_HEADS = 1  # the custom-op caches are tested with grouped queries: two query heads per KV head


def reference_attention(q, k, v, window, chunk=None):
    """Attention of every query over the whole history, masked with transformers' own mask functions."""
    k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))  # transformers' repeat_kv
    mask_fn = causal_mask_function if window is None else and_masks(causal_mask_function, sliding_window_overlay(window))
    if chunk is not None:  # a chunked layer (its window is the chunk's too)
        mask_fn = and_masks(causal_mask_function, chunked_overlay(chunk, torch.zeros(1, dtype=torch.long)))
    n = q.shape[2]
    idx = [torch.tensor(i) for i in range(n)]
    visible = torch.tensor([[bool(mask_fn(idx[0], idx[0], qi, ki)) for ki in idx] for qi in idx])
    scores = q @ k.transpose(-1, -2) / DIM**0.5
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def cached_attention(cache, calls, q, k, v, window, max_len=None, after_call=None, chunk=None):
    """The same attention computed call by call through the cache and our masks, as kvexport's attention
    calls it; ``after_call(call)`` after each call (a layer that shares the cache reading it)."""
    outs, start = [], 0
    for n in calls:
        positions = torch.arange(start, start + n)
        call = CallState(None, positions, max_len)
        keys, values = cache.update(positions, k[:, :, start:start + n], v[:, :, start:start + n])
        call.attended[cache] = keys, values
        mask = additive_mask(cache.key_positions(positions), positions, window, torch.float32, chunk)
        scores = q[:, :, start:start + n] @ keys.transpose(-1, -2) / DIM**0.5 + mask
        outs.append(torch.softmax(scores, dim=-1) @ values)
        if after_call:
            after_call(call)
        start += n
    return torch.cat(outs, dim=2)


def custom_op_attention(cache, calls, q, k, v, window, max_len, after_call=None, chunk=None):
    """The same through a custom-op cache, called as kvexport's attention calls it."""
    outs, start = [], 0
    for n in calls:
        positions = torch.arange(start, start + n)
        mask = additive_mask(cache.key_positions(positions), positions, window, torch.float32, chunk)
        call = CallState(None, positions, max_len)
        part = slice(start, start + n)
        out, _ = cache.attend(None, q[:, :, part], k[:, :, part], v[:, :, part], mask, call, scaling=DIM**-0.5)
        outs.append(out.transpose(1, 2))  # the kernel answers sequence-major, [1, T, heads, D]
        if after_call:
            after_call(call)
        start += n
    return torch.cat(outs, dim=2)


def fit(calls, max_len):
    """The call lengths, cut where the cache is full."""
    kept, total = [], 0
    for n in calls:
        n = min(n, max_len - total)
        if n <= 0:
            break
        kept.append(n)
        total += n
    return kept


def quantized_rows(x):
    """``x`` as an int8 cache holds it: each row (one token of one head) quantized, then dequantized."""
    return dequantize_rows(*quantize_rows(x), torch.float32)


FAMILIES = {
    # name: (ring, static, attention through the cache, KV heads)
    "plain": (RingKVCache, StaticKVCache, cached_attention, HEADS),
    # One KV head: a ring attends through window_attention (XNNPACK's matmuls); more: custom_sdpa.
    "custom_op": (CustomOpRingCache, CustomOpStaticCache, custom_op_attention, KV_HEADS),
    "custom_op_kv_heads_2": (CustomOpRingCache, CustomOpStaticCache, custom_op_attention, HEADS),
    # --sdpa-query per-head: custom_sdpa's own call, one row per query head.
    "custom_op_per_head": (partial(CustomOpRingCache, grouped=False), partial(CustomOpStaticCache, grouped=False),
                           custom_op_attention, KV_HEADS),
    "custom_op_per_head_kv_heads_2": (partial(CustomOpRingCache, grouped=False), partial(CustomOpStaticCache, grouped=False),
                                      custom_op_attention, HEADS),
    # int8 rows: the reference attends over the query, keys and values quantized row by row.
    "int8": (partial(QuantizedRingCache, rotation=key_rotation(DIM)), partial(QuantizedStaticCache, rotation=key_rotation(DIM)),
             custom_op_attention, KV_HEADS),
    "int8_kv_heads_2": (partial(QuantizedRingCache, rotation=key_rotation(DIM)),
                        partial(QuantizedStaticCache, rotation=key_rotation(DIM)), custom_op_attention, HEADS),
    # --int8-kv-sdpa dequantized: every call custom_sdpa over the rows dequantized, the query as it is.
    "int8_dequantized": (partial(QuantizedRingCache, rotation=key_rotation(DIM), int8_kernel=False),
                         partial(QuantizedStaticCache, rotation=key_rotation(DIM), int8_kernel=False),
                         custom_op_attention, KV_HEADS),
    "int8_dequantized_kv_heads_2": (partial(QuantizedRingCache, rotation=key_rotation(DIM), int8_kernel=False),
                                    partial(QuantizedStaticCache, rotation=key_rotation(DIM), int8_kernel=False),
                                    custom_op_attention, HEADS),
}


def as_the_cache_sees(family, q, k, v):
    """What an int8 family attends over: queries and keys rotated (q·k as it was), the rows
    quantized as written, and the query too where the int8 kernel rounds it; the rest as they are."""
    if not family.startswith("int8"):
        return q, k, v
    rotation = key_rotation(DIM)
    q = q @ rotation if "dequantized" in family else quantized_rows(q @ rotation)
    return q, quantized_rows(k @ rotation), quantized_rows(v)


# A layer's window (None: full attention), the cache's length, a sequence's call lengths.
WINDOWS = st.one_of(st.none(), st.integers(1, 12))
CACHE_LENS = st.integers(1, 40)
CALLS = st.lists(st.integers(1, 16), min_size=1, max_size=10)
SEEDS = st.integers(0, 2**16)


@pytest.mark.parametrize("family", list(FAMILIES))
@settings(max_examples=300, deadline=None)
@given(window=WINDOWS, max_len=CACHE_LENS, calls=CALLS, earlier_calls=st.lists(st.integers(1, 16), max_size=4), seed=SEEDS)
def test_cache_attention_equals_full_history(family, window, max_len, calls, earlier_calls, seed):
    # Calls of random lengths (a prefill, then decodes or further chunks) up to the cache size.
    ring, static, attention, kv_heads = FAMILIES[family]
    if window is not None and window < max_len:
        cache = ring(1, kv_heads, window, DIM, torch.float32)
    else:  # a window as long as the cache never hides anything: a static layer serves it
        cache = static(1, kv_heads, max_len, DIM, torch.float32)
    gen = torch.Generator().manual_seed(seed)

    def sequence(calls):
        total = sum(calls)
        return torch.randn(1, HEADS, total, DIM, generator=gen), *(
            torch.randn(1, kv_heads, total, DIM, generator=gen) for _ in range(2)
        )

    earlier = fit(earlier_calls, max_len)
    if earlier:  # leaves its keys in the cache; the sequence below starts again at position 0
        attention(cache, earlier, *sequence(earlier), window, max_len)
    kept = fit(calls, max_len)
    q, k, v = sequence(kept)
    got = attention(cache, kept, q, k, v, window, max_len)
    q, k, v = as_the_cache_sees(family, q, k, v)
    torch.testing.assert_close(got, reference_attention(q, k, v, window), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", [f for f in FAMILIES if not f.startswith("int8")])
@settings(max_examples=150, deadline=None)
@given(chunk=st.integers(1, 12), max_len=CACHE_LENS, calls=CALLS, seed=SEEDS)
def test_chunked_attention_through_a_ring_of_the_chunk_equals_full_history(family, chunk, max_len, calls, seed):
    """Llama 4's chunked attention: a ring of the chunk's slots (a static buffer where the chunk is
    as long as the cache) and the mask's chunk start, against transformers' own chunk mask, over
    calls that cross chunk boundaries and calls longer than a chunk."""
    ring, static, attention, kv_heads = FAMILIES[family]
    cache = ring(1, kv_heads, chunk, DIM, torch.float32) if chunk < max_len else static(1, kv_heads, max_len, DIM, torch.float32)
    gen = torch.Generator().manual_seed(seed)
    kept = fit(calls, max_len)
    total = sum(kept)
    q = torch.randn(1, HEADS, total, DIM, generator=gen)
    k, v = (torch.randn(1, kv_heads, total, DIM, generator=gen) for _ in range(2))
    got = attention(cache, kept, q, k, v, chunk, max_len, chunk=chunk)
    torch.testing.assert_close(got, reference_attention(q, k, v, chunk, chunk), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", list(FAMILIES))
@settings(max_examples=150, deadline=None)
@given(window=WINDOWS, max_len=CACHE_LENS, calls=CALLS, readers=st.integers(1, 16), seed=SEEDS)
def test_a_layer_sharing_the_cache_reads_what_each_call_left(family, window, max_len, calls, readers, seed):
    """KV sharing: after every call, a layer that holds no cache attends with queries at the call's
    last positions (up to the whole call, as Gemma 3n's sharing layers do) to what the cache's layer
    attended to in the call, and sees what full-history attention sees there: a ring's earlier
    queries too, though the call has overwritten what they see."""
    ring, static, attention, kv_heads = FAMILIES[family]
    is_ring = window is not None and window < max_len
    cache = ring(1, kv_heads, window, DIM, torch.float32) if is_ring else static(1, kv_heads, max_len, DIM, torch.float32)
    gen = torch.Generator().manual_seed(seed)
    kept = fit(calls, max_len)
    total = sum(kept)
    q, reader_q = (torch.randn(1, HEADS, total, DIM, generator=gen) for _ in range(2))
    k, v = (torch.randn(1, kv_heads, total, DIM, generator=gen) for _ in range(2))
    seen_q, seen_k, seen_v = as_the_cache_sees(family, reader_q, k, v)  # what the reader sees
    expected = reference_attention(seen_q, seen_k, seen_v, window)
    # The plain caches read through the family's eager attention, which repeats KV heads for the module.
    module = SimpleNamespace(num_key_value_groups=HEADS // kv_heads, training=False)
    checked = []

    def read(call):
        positions = call.positions
        n = min(readers, positions.shape[0])
        last = slice(int(positions[-1]) + 1 - n, int(positions[-1]) + 1)
        out, _ = cache.read(module, reader_q[:, :, last], call, scaling=DIM**-0.5)
        torch.testing.assert_close(out.transpose(1, 2), expected[:, :, last], atol=1e-5, rtol=1e-5)
        checked.append(n)

    attention(cache, kept, q, k, v, window, max_len, after_call=read)
    assert len(checked) == len(kept)


@pytest.mark.parametrize("head_dim", [16, 64, 96, 256])
def test_the_key_rotation_is_orthonormal_and_spreads_a_channel_over_all_of_them(head_dim):
    rotation = key_rotation(head_dim)
    torch.testing.assert_close(rotation @ rotation.T, torch.eye(head_dim), atol=1e-6, rtol=0)
    block = head_dim & -head_dim  # 96: three blocks of 32
    spike = torch.zeros(head_dim)
    spike[0] = 1.0
    assert (spike @ rotation).abs().gt(0).sum() == block


@settings(max_examples=200, deadline=None)
@given(rows=st.integers(1, 8), dim=st.integers(1, 64), spread=st.floats(1e-3, 1e3), seed=st.integers(0, 2**16))
def test_an_int8_row_is_within_half_a_step_of_the_float_row(rows, dim, spread, seed):
    """The int8 cache's own error: each row comes back within half of its quantization step,
    (max - min) / 255, of what was written (the range always holds 0, as the scheme's zero point
    must be an integer level)."""
    x = torch.randn(1, 2, rows, dim, generator=torch.Generator().manual_seed(seed)) * spread
    step = (x.amax(-1, keepdim=True).clamp(min=0) - x.amin(-1, keepdim=True).clamp(max=0)) / 255
    error = (quantized_rows(x) - x).abs()
    assert (error <= step / 2 * (1 + 1e-4) + 1e-7).all(), (error / step).max()


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


def test_ring_writes_are_worked_out_once_per_call_for_all_sliding_layers():
    """Which token each ring slot takes (``newest_in_slot``) depends on the call only: the program
    computes it once, not in each sliding layer (Gemma 3 270M: 8 small integer ops a layer, left
    outside XNNPACK's delegate, 120 a decode step). Both of tiny-mistral's layers slide."""
    from kvexport.exporter.executorch import target as executorch
    from kvexport.models.presets import build_preset

    model, _ = build_preset("tiny-mistral")
    sliding = sum(spec.window is not None for spec in layer_specs(model.config))
    program = executorch.export(model, 32, 8)
    floor_divisions = [n for n in program.graph.nodes if n.target == torch.ops.aten.div.Tensor_mode]
    assert sliding > 1 and len(floor_divisions) == 1


@settings(max_examples=200, deadline=None)
@given(
    taps=st.integers(2, 5),
    calls=st.lists(st.integers(1, 9), min_size=1, max_size=8),
    earlier_calls=st.lists(st.integers(1, 9), max_size=3),
    seed=SEEDS,
)
def test_a_convolution_state_gives_the_whole_sequence_s_convolution(taps, calls, earlier_calls, seed):
    """LFM2's short convolution call by call through its state (prefills, decode steps, calls
    shorter than the state) against transformers' own convolution of the whole sequence; a new
    sequence at position 0 starts from zeros whatever an earlier one left."""
    from transformers.models.lfm2.modeling_lfm2 import causal_conv1d_fn

    channels = 3
    gen = torch.Generator().manual_seed(seed)
    weight, bias = torch.randn(channels, 1, taps, generator=gen), torch.randn(channels, generator=gen)
    state = ConvState(channels, taps - 1, torch.float32)

    def run(calls):
        x = torch.randn(1, channels, sum(calls), generator=gen)
        outs, start = [], 0
        for n in calls:
            call = CallState(None, torch.arange(start, start + n), 64)
            outs.append(state.convolve(x[:, :, start:start + n], weight, bias, call))
            start += n
        return x, torch.cat(outs, dim=-1)

    if earlier_calls:
        run(earlier_calls)
    x, got = run(calls)
    torch.testing.assert_close(got, causal_conv1d_fn(x, weight.squeeze(1), bias), atol=1e-6, rtol=1e-6)


@settings(max_examples=150, deadline=None)
@given(
    max_tokens=st.integers(1, 20),
    group=st.sampled_from([1, 2]),
    calls=st.lists(st.integers(1, 20), min_size=1, max_size=6),
    earlier_calls=st.lists(st.integers(1, 20), max_size=2),
    seed=SEEDS,
)
def test_a_gated_delta_state_gives_the_token_by_token_recurrence(max_tokens, group, calls, earlier_calls, seed):
    """Qwen 3.5's linear attention call by call, each call one chunk of any length up to the bound,
    against transformers' own recurrent form over the whole sequence, one token at a time; a new
    sequence at position 0 starts from a zero state whatever an earlier one left."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_recurrent_gated_delta_rule

    key_heads, key_dim, value_dim = 2, 4, 3
    value_heads = key_heads * group
    calls = [min(n, max_tokens) for n in calls]
    earlier_calls = [min(n, max_tokens) for n in earlier_calls]
    gen = torch.Generator().manual_seed(seed)
    state = GatedDeltaState((1, 1), (value_heads, key_dim, value_dim), max_tokens, torch.float32)

    def run(calls):
        n = sum(calls)
        q, k = (torch.randn(1, n, key_heads, key_dim, generator=gen) for _ in range(2))
        v = torch.randn(1, n, value_heads, value_dim, generator=gen)
        # Decays as transformers makes them (-exp(A_log) * softplus), some steep; rates in (0, 1).
        g = -torch.rand(value_heads, generator=gen) * 8 * torch.nn.functional.softplus(torch.randn(1, n, value_heads, generator=gen))
        beta = torch.rand(1, n, value_heads, generator=gen)
        outs, start = [], 0
        for size in calls:
            piece = slice(start, start + size)
            call = CallState(None, torch.arange(start, start + size), 64)
            outs.append(state.delta_rule(q[:, piece], k[:, piece], v[:, piece], g[:, piece], beta[:, piece], call))
            start += size
        expected, _ = torch_recurrent_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
        return torch.cat(outs, dim=1), expected

    if earlier_calls:
        run(earlier_calls)
    got, expected = run(calls)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@settings(max_examples=150, deadline=None)
@given(
    groups=st.sampled_from([1, 2]),
    calls=st.lists(st.integers(1, 20), min_size=1, max_size=6),
    earlier_calls=st.lists(st.integers(1, 20), max_size=2),
    seed=SEEDS,
)
def test_a_mamba2_state_gives_the_token_by_token_recurrence(groups, calls, earlier_calls, seed):
    """Granite 4's Mamba-2 scan call by call, each call one chunk of any length, against
    transformers' own 1-token state update over the whole sequence; a new sequence at position 0
    starts from a zero state whatever an earlier one left."""
    from transformers.models.granitemoehybrid.modeling_granitemoehybrid import mamba2_selective_state_update

    heads, head_dim, state_size = 4, 3, 5
    gen = torch.Generator().manual_seed(seed)
    a = -torch.rand(heads, generator=gen) * 8  # some steep decays
    d = torch.randn(heads, generator=gen)
    state = Mamba2State((1, 1), (heads, head_dim, state_size), torch.float32)

    def run(calls):
        n = sum(calls)
        x = torch.randn(1, n, heads, head_dim, generator=gen)
        dt = torch.nn.functional.softplus(torch.randn(1, n, heads, generator=gen))
        b, c = (torch.randn(1, n, groups, state_size, generator=gen) for _ in range(2))
        outs, start = [], 0
        for size in calls:
            piece = slice(start, start + size)
            call = CallState(None, torch.arange(start, start + size), 64)
            outs.append(state.scan(x[:, piece], dt[:, piece], a, b[:, piece], c[:, piece], d, call))
            start += size
        reference, expected = torch.zeros(1, heads, head_dim, state_size), []
        for t in range(n):  # what transformers does at each decode step
            expected.append(mamba2_selective_state_update(
                reference, x[:, t], dt[:, t, :, None].expand(-1, -1, head_dim), a[:, None, None].expand(-1, head_dim, state_size),
                b[:, t], c[:, t], d[:, None].expand(-1, head_dim),
            ))  # fmt: skip
        return torch.cat(outs, dim=1), torch.stack(expected, dim=1)

    if earlier_calls:
        run(earlier_calls)
    got, expected = run(calls)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def _one_call(family, cache, start, q, k, v, window, max_len):
    """One call of ``q``/``k``/``v`` (``[1, heads, n, D]``) from ``start`` through ``cache``, as
    ``cached_attention`` or ``custom_op_attention`` makes each of theirs; its output ``[1, heads, n, D]``."""
    n = q.shape[2]
    positions = torch.arange(start, start + n)
    mask = additive_mask(cache.key_positions(positions), positions, window, torch.float32)
    call = CallState(None, positions, max_len)
    if FAMILIES[family][2] is cached_attention:
        keys, values = cache.update(positions, k, v)
        return torch.softmax(q @ keys.transpose(-1, -2) / DIM**0.5 + mask, dim=-1) @ values
    return cache.attend(None, q, k, v, mask, call, scaling=DIM**-0.5)[0].transpose(1, 2)


@pytest.mark.parametrize("family", list(FAMILIES))
@settings(max_examples=200, deadline=None)
@given(window=st.integers(1, 12), spare=st.integers(1, 6), max_len=st.integers(2, 48), data=st.data(), seed=SEEDS)
def test_a_call_may_start_again_after_rejected_drafted_tokens(family, window, spare, max_len, data, seed):
    """Speculative decoding: each call verifies up to ``spare + 1`` tokens, of which the first
    ``accepted`` (at least one) are kept and the rest, random keys and values, rejected; the next call
    starts after the accepted ones. With ``spare`` slots beyond a ring's window (a static buffer
    simply overwrites), every kept position's attention is the full-history attention over the kept
    sequence alone."""
    ring, static, _, kv_heads = FAMILIES[family]
    is_ring = window < max_len
    cache = ring(1, kv_heads, window, DIM, torch.float32, spare=spare) if is_ring else static(1, kv_heads, max_len, DIM, torch.float32)
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, HEADS, max_len, DIM, generator=gen)
    k, v = (torch.randn(1, kv_heads, max_len, DIM, generator=gen) for _ in range(2))
    outs, start = [], 0
    while start < max_len:
        n = data.draw(st.integers(1, min(spare + 1, max_len - start)), label="call")
        accepted = data.draw(st.integers(1, n), label="accepted")
        junk = [torch.randn(1, h, n - accepted, DIM, generator=gen) for h in (HEADS, kv_heads, kv_heads)]
        call = [torch.cat([x[:, :, start : start + accepted], j], dim=2) for x, j in zip((q, k, v), junk)]
        outs.append(_one_call(family, cache, start, *call, window, max_len)[:, :, :accepted])
        start += accepted
    got = torch.cat(outs, dim=2)
    q, k, v = as_the_cache_sees(family, q, k, v)
    torch.testing.assert_close(got, reference_attention(q, k, v, window if is_ring else None), atol=1e-5, rtol=1e-5)
