"""Export-safe KV caches: a static buffer for full-attention layers, a ring for sliding ones, and
none for a layer that shares an earlier layer's (``SharedKVCache``); and the fixed-size states of
layers that do not attend (``ConvState``, ``GatedDeltaState``, ``Mamba2State``). ``build_caches``
gives each layer the kind its ``LayerSpec`` asks for, from a target's ``CacheKinds``.

The first two are plain ``nn.Module``s whose whole state is two tensor buffers. Nothing about the step is
kept in Python: the caller passes the positions of the new tokens as a tensor, so one exported
program serves a prefill of any length and every decode step without guarding on the step.

Position bookkeeping is a pure function of the start position (see ``ring_positions``): slot ``s``
of a ring of ``W`` slots holds the newest position ``p < start`` with ``p % W == s``. That holds
as long as calls are contiguous (each call starts where the last ended), which is how every
runner drives an LLM; it needs no counter.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from ..errors import UnsupportedModelError
from ..models.architecture import CHUNKED, CONV, MAMBA2, NONE, RECURRENT, RING, SHARED, STATIC, LayerSpec
from .attention import family_eager_attention

# A target's cache for each kind of layer that holds one: ``make(batch, kv_heads, slots, head_dim,
# dtype)``, slots being max_cache_len for STATIC and the window for RING. Each kind provides
# ``attend`` (write the call's keys and attend to them) or ``update`` (write them and return the
# keys to attend to), ``key_positions`` and, for layers that share it, ``read``. CONV, RECURRENT and
# MAMBA2 (optional: ``ConvState``, ``GatedDeltaState``, ``Mamba2State`` where absent) are the states';
# CHUNKED (optional: RING's where absent) a chunked-attention layer's ring of the chunk's slots.
CacheKinds = dict[str, Callable[..., object]]


def build_caches(
    specs: list[LayerSpec], max_cache_len: int, dtype: torch.dtype, kinds: CacheKinds, max_tokens_per_call: int,
    spare_slots: int = 0,
) -> list:
    """One cache per layer: ``kinds[STATIC]`` or ``kinds[RING]`` for a layer that holds its own, a
    ``SharedKVCache`` for one that reads another's, an empty module for one that holds nothing,
    else the layer's state (``build_state``). A hybrid layer gets its KV cache here and its state
    from ``build_state``. ``spare_slots``: a ring's slots beyond its window, so that a call may
    start up to that many positions before the previous call's end (speculative verification
    rejecting drafted tokens, ``RingKVCache``)."""
    caches = []
    for spec in specs:
        kind = spec.cache_kind(max_cache_len)
        if kind == NONE:  # a layer that mixes no positions: an empty module where its cache would be
            caches.append(nn.Module())
        elif kind == SHARED:
            caches.append(SharedKVCache(spec.reads))
        elif not spec.has_kv:
            caches.append(build_state(spec, dtype, kinds, max_tokens_per_call))
        else:
            # A chunked layer's ring is a ring of the chunk (the mask adds the chunk's start), unless
            # the target has a kind of its own for it (one whose attention does not take the mask).
            make = kinds.get(CHUNKED, kinds[RING]) if kind == RING and spec.chunk else kinds[kind]
            spare = {"spare": spare_slots} if kind == RING and spare_slots else {}
            caches.append(make(1, spec.kv_heads, spec.cache_slots(max_cache_len), spec.head_dim, dtype, **spare))
    return caches


def build_state(spec: LayerSpec, dtype: torch.dtype, kinds: CacheKinds, max_tokens_per_call: int):
    """A layer's state: a ``ConvState`` for a convolution, a ``Mamba2State`` for a Mamba-2 layer (or
    a hybrid layer's mixer), a ``GatedDeltaState`` for gated-delta linear attention (calls of at
    most ``max_tokens_per_call`` tokens)."""
    if spec.state_kind == CONV:
        return kinds.get(CONV, ConvState)(*spec.conv_state, dtype)
    if spec.rule == MAMBA2:
        return kinds.get(MAMBA2, Mamba2State)(spec.conv_state, spec.recurrent_state, dtype)
    return kinds.get(RECURRENT, GatedDeltaState)(spec.conv_state, spec.recurrent_state, max_tokens_per_call, dtype)


class SharedKVCache(nn.Module):
    """KV sharing: a layer with no cache of its own, whose queries attend to what layer ``reads``
    attended to earlier in the same call (``read``), as transformers hands a sharing layer the
    keys and values its producer's cache returned: a full layer's buffer as the call left it, a
    ring's keys from before the call's write followed by the call's own (``CallState.attended``).
    Gemma 4 runs such a layer on the call's last token only (``_maybe_slice_kv_shared_inputs``),
    Gemma 3n on every token of the call: ``read`` serves the call's last queries, any number."""

    def __init__(self, reads: int):
        super().__init__()
        self.reads = reads

    def attend(self, module, query, key, value, mask, call: CallState, **kwargs):
        # key and value are the producer's new rows (transformers hands them on): already cached.
        return call.layers[self.reads].read(module, query, call, **kwargs)


class ConvState(nn.Module):
    """A short causal convolution's state: its last ``width`` inputs ``[1, channels, width]``, which
    the next call's first outputs look back at. A call at position 0 starts from zeros (a new
    sequence), as eager's convolution pads; no counter, no branch: the state is scaled by 0 or 1."""

    def __init__(self, channels: int, width: int, dtype: torch.dtype):
        super().__init__()
        self.width = width
        self.register_buffer("state", torch.zeros((1, channels, width), dtype=dtype), persistent=False)

    def convolve(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, call: CallState) -> torch.Tensor:
        """Depthwise convolution of ``x [1, channels, T]`` (weight ``[channels, 1, width + 1]``) over the
        state and the call: ``T`` outputs, and the state becomes the last ``width`` inputs."""
        continuing = (call.positions[:1] > 0).to(x.dtype)
        inputs = torch.cat([self.state * continuing, x], dim=-1)
        self.keep(inputs[:, :, inputs.shape[-1] - self.width :])
        return nn.functional.conv1d(inputs, weight, bias, groups=x.shape[1])

    def keep(self, state: torch.Tensor) -> None:
        """The state after the call: written in place (a target whose graph holds no state returns it)."""
        self.state.copy_(state)


class GatedDeltaState(nn.Module):
    """Linear attention with the gated delta rule (Qwen 3.5, Qwen3-Next): the convolution in front of
    it (``conv``) and one float32 ``[key size, value size]`` matrix per value head (``state``), the
    same size at every position.

    A call of ``T`` tokens is one chunk of transformers' chunked form (``torch_chunk_gated_delta_rule``
    with ``chunk_size = T``): a few matmuls, so one program serves a prefill of any length up to
    ``max_tokens`` and a 1-token decode (where it is the recurrent form's arithmetic). The chunk's
    triangular system is solved on a fixed ``chunk x chunk`` matrix (the call's, padded) by blocked
    inversion: a fixed number of matmuls, where forward substitution would loop over ``T`` rows.
    """

    def __init__(self, conv_state: tuple[int, int], recurrent_state: tuple[int, int, int], max_tokens: int, dtype):
        super().__init__()
        self.conv = ConvState(*conv_state, dtype)
        self.chunk = padded_chunk(max_tokens)
        self.register_buffer("state", torch.zeros((1, *recurrent_state), dtype=torch.float32), persistent=False)

    def delta_rule(self, query, key, value, g, beta, call: CallState) -> torch.Tensor:
        """Outputs ``[1, T, value heads, value size]`` for queries and keys ``[1, T, key heads, key
        size]``, values ``[1, T, value heads, value size]``, log decays ``g`` and rates ``beta``
        ``[1, T, value heads]``; the state moves on to the call's end."""
        torch._check(query.shape[1] <= self.chunk)
        dtype = value.dtype
        group = value.shape[2] // key.shape[2]  # value heads per key head
        query, key = query.repeat_interleave(group, dim=2), key.repeat_interleave(group, dim=2)
        query, key, value, g, beta = (x.transpose(1, 2).float() for x in (query, key, value, g, beta))
        query = _l2norm(query) * query.shape[-1] ** -0.5
        key = _l2norm(key)
        decay = g.cumsum(-1)  # log of the decay from the call's start to each token
        n = decay.shape[-1]
        causal = torch.ones((n, n), dtype=torch.bool, device=g.device).tril()
        pairwise = (decay[..., :, None] - decay[..., None, :]).masked_fill(~causal, float("-inf")).exp()
        k_beta = key * beta[..., None]
        solve = _unit_lower_inverse(((k_beta @ key.transpose(-1, -2)) * pairwise).tril(-1), self.chunk)
        new_values = solve @ (value * beta[..., None])
        decayed_k_beta = solve @ (k_beta * decay.exp()[..., None])
        # A call at position 0 starts a new sequence: from a zero state, as eager does.
        state = self.state * (call.positions[:1] > 0).float()
        corrections = new_values - decayed_k_beta @ state
        out = (query * decay.exp()[..., None]) @ state + ((query @ key.transpose(-1, -2)) * pairwise) @ corrections
        last = decay[..., -1:]
        to_end = (key * (last - decay).exp()[..., None]).transpose(-1, -2)
        self.keep(state * last.exp()[..., None] + to_end @ corrections)
        return out.transpose(1, 2).to(dtype)

    def keep(self, state: torch.Tensor) -> None:
        """The recurrent state after the call: written in place (see ``ConvState.keep``)."""
        self.state.copy_(state)


class Mamba2State(nn.Module):
    """A Mamba-2 layer (Granite 4 hybrid, Bamba): the convolution in front of its scan (``conv``) and one
    float32 ``[head size, state size]`` matrix per head (``state``).

    A call is one chunk of transformers' chunked scan (``mamba2_chunk_scan``): the state's decay is
    a scalar per head and step, so the chunk needs no triangular solve and takes any ``T``."""

    def __init__(self, conv_state: tuple[int, int], recurrent_state: tuple[int, int, int], dtype):
        super().__init__()
        self.conv = ConvState(*conv_state, dtype)
        self.register_buffer("state", torch.zeros((1, *recurrent_state), dtype=torch.float32), persistent=False)

    def scan(self, x, dt, a, b, c, d, call: CallState) -> torch.Tensor:
        """Outputs ``[1, T, heads, head size]`` (float32) for inputs ``x`` ``[1, T, heads, head size]``,
        steps ``dt`` ``[1, T, heads]`` (after softplus), ``a`` ``[heads]`` (negative), ``b`` and ``c``
        ``[1, T, groups, state size]`` and the skip ``d`` ``[heads]``; the state moves on to the call's end."""
        heads = x.shape[2]
        x = x.float()
        b, c = (y.float().repeat_interleave(heads // y.shape[2], dim=2).transpose(1, 2) for y in (b, c))
        skip = d[:, None] * x
        xdt = (x * dt[..., None].float()).transpose(1, 2)  # [1, heads, T, head size]
        steps = (a.float() * dt.float()).transpose(1, 2)  # log of each step's decay, [1, heads, T]
        decay = steps.cumsum(-1)
        state = self.state * (call.positions[:1] > 0).float()  # a new sequence starts from zeros
        mixed = (c @ b.transpose(-1, -2)) * _segment_sum(steps).exp()
        out = mixed @ xdt + (c @ state.transpose(-1, -2)) * decay.exp()[..., None]
        last = decay[..., -1:]
        written = (xdt * (last - decay).exp()[..., None]).transpose(-1, -2) @ b
        self.keep(state * last.exp()[..., None] + written)
        return out.transpose(1, 2) + skip

    def keep(self, state: torch.Tensor) -> None:
        """The state after the call: written in place (see ``ConvState.keep``)."""
        self.state.copy_(state)


def _segment_sum(steps: torch.Tensor) -> torch.Tensor:
    """``[..., T, T]``: the sum of ``steps`` over ``(j, i]`` at ``[i, j]`` for ``j <= i``, ``-inf`` above
    (transformers' ``segment_sum``: a masked cumulative sum, not a difference of two)."""
    n = steps.shape[-1]
    causal = torch.ones((n, n), dtype=torch.bool, device=steps.device).tril()
    sums = steps[..., None].expand(*steps.shape, n).masked_fill(~causal.tril(-1), 0).cumsum(dim=-2)
    return sums.masked_fill(~causal, float("-inf"))


def padded_chunk(max_tokens: int) -> int:
    """The size a call's triangular system is padded to: the call's bound, as a power of two."""
    return 1 << max(max_tokens - 1, 0).bit_length()


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    """transformers' ``l2norm`` (that of flash-linear-attention), with its epsilon."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)


def _unit_lower_inverse(lower: torch.Tensor, size: int) -> torch.Tensor:
    """``(I + lower)^-1`` for a strictly lower-triangular ``[1, H, T, T]``, ``T <= size``: padded to
    ``size`` (a power of two) and inverted blockwise, ``[[A, 0], [B, D]]^-1 = [[A^-1, 0], [-D^-1 B A^-1,
    D^-1]]``, the halves' inverses found together, down to 1 x 1."""
    n = lower.shape[-1]
    padded = nn.functional.pad(lower, (0, size - n, 0, size - n))
    return _block_inverse(padded[0])[None, :, :n, :n]


def _block_inverse(lower: torch.Tensor) -> torch.Tensor:
    """``_unit_lower_inverse`` of a batch ``[B, size, size]``; the halves go along the batch, so the
    rank stays 3 (XNNPACK takes at most 6 dimensions)."""
    batch, size = lower.shape[0], lower.shape[-1]
    if size == 1:
        return torch.ones_like(lower)
    h = size // 2
    halves = _block_inverse(torch.cat([lower[:, :h, :h], lower[:, h:, h:]]))
    first, second = halves[:batch], halves[batch:]
    below = -(second @ lower[:, h:, :h] @ first)
    top = torch.cat([first, torch.zeros_like(first)], dim=-1)
    return torch.cat([top, torch.cat([below, second], dim=-1)], dim=-2)


class StaticKVCache(nn.Module):
    """Full attention: slot ``i`` holds position ``i``, for ``max_len`` positions."""

    def __init__(self, batch: int, kv_heads: int, max_len: int, head_dim: int, dtype: torch.dtype):
        super().__init__()
        shape = (batch, kv_heads, max_len, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype), persistent=False)

    @property
    def slots(self) -> int:
        return self.k.shape[2]

    def update(self, positions: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor):
        self.k.index_copy_(2, positions, k_new)
        self.v.index_copy_(2, positions, v_new)
        return self.k, self.v

    def key_positions(self, positions: torch.Tensor) -> torch.Tensor:
        """Position held by each key column that ``update`` (and ``read``) returns."""
        return torch.arange(self.slots, device=positions.device)

    def read(self, module, query, call: CallState, **kwargs):
        """Attention of the call's last ``query.shape[2]`` positions to the buffer this call wrote."""
        mask = additive_mask(self.key_positions(call.positions), last_positions(call, query), None, query.dtype)
        return family_eager_attention(module)(module, query, self.k, self.v, mask, **kwargs)


class RingKVCache(nn.Module):
    """Sliding window ``W``: a ring of ``S = W + spare`` slots, position ``p`` stored at slot ``p % S``.

    ``update`` returns the ring as it was *before* this call followed by the new keys
    (``S + T`` columns), so every query of a multi-token call still sees the ``W - 1`` positions
    before it even when the call itself overwrites them; the mask picks the visible ones.

    ``spare`` slots let a call start up to ``spare`` positions before the previous call's end
    (a verification whose drafted tokens were rejected): the rejected positions' rows sit in slots
    the slot arithmetic then gives positions at least ``W`` before the call, which no query sees,
    and the rows the window still needs were not overwritten, being fewer than ``S`` positions back.
    """

    def __init__(self, batch: int, kv_heads: int, window: int, head_dim: int, dtype: torch.dtype, spare: int = 0):
        super().__init__()
        self.window = window
        self.slots = window + spare
        shape = (batch, kv_heads, self.slots, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype), persistent=False)

    def update(self, positions: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor):
        keys = torch.cat([self.k, k_new], dim=2)
        values = torch.cat([self.v, v_new], dim=2)
        newest, slots = newest_in_slot(positions, self.slots)
        self.k.index_copy_(2, slots, k_new.index_select(2, newest))
        self.v.index_copy_(2, slots, v_new.index_select(2, newest))
        return keys, values

    def key_positions(self, positions: torch.Tensor) -> torch.Tensor:
        return ring_key_positions(positions, self.slots)

    def read(self, module, query, call: CallState, **kwargs):
        """Attention of the call's last ``query.shape[2]`` positions to what this layer attended to in
        the call (the ring before its write, then the call's keys): the ring after the write no
        longer holds what the call's earlier positions see."""
        keys, values = call.attended[self]
        mask = shared_ring_mask(call, query, self.slots, self.window)
        return family_eager_attention(module)(module, query, keys, values, mask, **kwargs)


def last_positions(call: CallState, query: torch.Tensor) -> torch.Tensor:
    """Positions of a shared layer's queries: the call's last ``query.shape[2]``."""
    return call.positions[call.positions.shape[0] - query.shape[2] :]


def shared_ring_mask(call: CallState, query: torch.Tensor, slots: int, window: int) -> torch.Tensor:
    """``[1, 1, t, S + T]`` mask over a ring's ``S`` slots before the call followed by the call's
    keys, for a sharing layer's queries at the call's last ``t`` positions."""
    return additive_mask(ring_key_positions(call.positions, slots), last_positions(call, query), window, query.dtype)


def ring_key_positions(positions: torch.Tensor, slots: int) -> torch.Tensor:
    """Position of each key column a ring returns: the ring's slots, then the call's tokens."""
    return torch.cat([ring_positions(positions[:1], slots), positions])


def newest_in_slot(positions: torch.Tensor, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For each token of a call: the slot it maps to, and which token of the call to write there.

    A call longer than the window maps several tokens to one slot, and a scatter with duplicate
    indices is order-dependent; so every token writes the value of the newest token sharing its
    slot. Duplicates then carry identical data and the result is exact in any order.
    """
    n = positions.shape[0]
    j = torch.arange(n, device=positions.device)
    newest = j + torch.div(n - 1 - j, window, rounding_mode="floor") * window
    return newest, torch.remainder(positions, window)


def ring_positions(start: torch.Tensor, window: int) -> torch.Tensor:
    """Position held by each ring slot before a call at ``start`` (negative: never written)."""
    last = start - 1
    slots = torch.arange(window, device=start.device)
    # `+ window` keeps the dividend non-negative: ExecuTorch's portable remainder kernel
    # truncates toward zero on negative integers (C semantics), unlike torch's floor mod.
    return last - torch.remainder(last - slots + window, window)


def additive_mask(
    key_pos: torch.Tensor, query_pos: torch.Tensor, window: int | None, dtype: torch.dtype, chunk: int | None = None
) -> torch.Tensor:
    """``[1, 1, T, K]`` float mask with eager transformers' semantics.

    A query at ``q`` sees a key at ``k`` iff ``0 <= k <= q`` and, for a sliding layer,
    ``k > q - window`` (transformers' ``sliding_window_overlay``); for a chunked layer, ``k`` is in
    ``q``'s chunk: ``k >= q - q % chunk`` (its ``chunked_overlay``, batch 1 without padding). Masked
    entries get the dtype's minimum rather than ``-inf`` so the mask also suits attention kernels
    that add it.
    """
    k = key_pos[None, :]
    q = query_pos[:, None]
    visible = (k >= 0) & (k <= q)
    if window is not None:
        visible = visible & (k > q - window)
    if chunk is not None:  # q >= 0: the remainder needs no care for its sign
        visible = visible & (k >= q - torch.remainder(q, chunk))
    zero = torch.zeros((), dtype=dtype, device=key_pos.device)
    masked = torch.full((), torch.finfo(dtype).min, dtype=dtype, device=key_pos.device)
    return torch.where(visible, zero, masked)[None, None]


class CallState:
    """What every layer needs to know about the current call: the layers, and where the call starts.

    ``layers`` holds each layer's cache (what its attention uses), ``states`` each layer's state
    (what its convolution or recurrence uses): the same object but in a hybrid layer, which has both.
    ``positions`` is a tensor (one per token); ``start`` is the same start as a traced integer, for
    kernels that take it as a scalar. It is made on first use, so programs that never need it have
    no data-dependent integer in them.
    """

    def __init__(self, layers, positions: torch.Tensor, max_cache_len: int, states=None, specs=None):
        self.layers = layers
        self.specs = specs
        self.states = layers if states is None else states
        self.positions = positions
        self.max_cache_len = max_cache_len
        self._start = None
        self._ring_writes = {}
        # A ring's keys and values as its layer attended to them in this call (the ring before the
        # call's write, then the call's), by cache: layers that share the ring attend to the same.
        self.attended = {}
        # The layers whose attention ran in this call (each must run once).
        self.reached = set()

    def reach(self, module, key: torch.Tensor, value: torch.Tensor) -> None:
        """Note that layer ``module.layer_idx`` attends in this call, and refuse, in one line, a model
        whose attention is not what its config told the cache: keys and values of another shape than
        the config's (a family whose attention reads sizes the config does not name), or a second
        attention call of one layer (differential attention: one cache holds one set of values)."""
        index = module.layer_idx
        name = f"architecture '{getattr(getattr(module, 'config', None), 'model_type', None)}' is not supported"
        if index in self.reached:
            raise UnsupportedModelError(f"{name}: its layer {index} calls attention twice per step, a cache holds one call's keys and values")
        self.reached.add(index)
        spec = self.specs[index] if self.specs is not None else None
        if spec is None or spec.reads is not None:  # a sharing layer is handed its producer's keys
            return
        planned = (spec.kv_heads, spec.head_dim, spec.head_dim)
        actual = (key.shape[1], key.shape[-1], value.shape[-1])
        if actual != planned:
            raise UnsupportedModelError(
                f"{name}: layer {index}'s attention computes {actual[0]} KV heads of keys of size {actual[1]} and "
                f"values of size {actual[2]}, where its config gives {planned[0]} heads of size {planned[1]}"
            )

    def ring_writes(self, window: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``newest_in_slot`` of this call for rings of ``window`` slots, computed once for all of
        them: per layer it would be a run of small integer ops outside the delegate in every
        sliding layer."""
        if window not in self._ring_writes:
            self._ring_writes[window] = newest_in_slot(self.positions, window)
        return self._ring_writes[window]

    @property
    def start(self):
        if self._start is None:
            start = self.positions[0].item()
            torch._check_is_size(start)
            torch._check(start + self.positions.shape[0] <= self.max_cache_len)
            self._start = start
        return self._start


PLAIN_CACHES: CacheKinds = {STATIC: StaticKVCache, RING: RingKVCache}
