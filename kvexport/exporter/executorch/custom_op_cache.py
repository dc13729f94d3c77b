"""Caches for ExecuTorch built on its LLM custom ops (``executorch.extension.llm.custom_ops``).

``llama::update_cache`` writes the new rows into the buffer in place (a plain ``index_copy_``
becomes a functional copy of the whole buffer plus a copy back), and ``llama::custom_sdpa`` is a
fused flash-attention kernel that handles grouped KV heads and, given a start position, reads
only positions ``[0, start + T)``. Decode cost then follows the filled length, not
``max_cache_len``. Buffers are sequence-major ``[1, slots, kv_heads, head_dim]`` as the ops want.
The query rows a call gives the kernel are ``--sdpa-query``'s choice (``causal_sdpa``,
``sdpa_query``).

A sliding-window ring is small and always attended whole, so with one KV head (Gemma 3 270M, 1B)
its attention is plain batched matmuls that XNNPACK runs inside the delegate (``window_attention``);
with more, reading the sequence-major ring per head would copy it first, while ``custom_sdpa``
reads it in place.

A family whose attention needs more than softmax(QK^T·scale + mask)·V (soft-capping, attention
sinks) keeps the same buffers but falls back to its own eager attention on views of them.
"""

from __future__ import annotations

from functools import partial

import executorch.extension.llm.custom_ops.custom_ops  # noqa: F401  (registers torch.ops.llama.*)
import torch
from torch import nn

from ...kernels import MOST_TOKENS, define_ops
from ...models.architecture import RING, STATIC
from ..attention import family_eager_attention, plain_softmax_attention
from ..kv_cache import CacheKinds, CallState, additive_mask, last_positions, ring_key_positions, shared_ring_mask
from .vector_state import clear_vector_state

define_ops()  # torch.ops.kvexport.decode_sdpa


def _to_seq_major(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(1, 2)  # [1, heads, T, D] <-> [1, T, heads, D]


class CustomOpStaticCache(nn.Module):
    """Full attention: slot i holds position i. One slot more than ``max_len``, never written:
    ``custom_sdpa``'s extra query row (``--sdpa-query grouped``) reads it."""

    def __init__(self, batch: int, kv_heads: int, max_len: int, head_dim: int, dtype: torch.dtype, grouped: bool = True,
                 decode_kernel: bool = False):
        super().__init__()
        self.grouped = grouped  # --sdpa-query grouped (else per-head)
        self.decode_kernel = decode_kernel  # --decode-attention kvexport
        shape = (batch, max_len + 1, kv_heads, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype), persistent=False)

    def attend(self, module, query, key, value, mask, call: CallState, scaling=None, **kwargs):
        torch.ops.llama.update_cache(_to_seq_major(key), self.k, call.start)
        torch.ops.llama.update_cache(_to_seq_major(value), self.v, call.start)
        if plain_softmax_attention(kwargs):
            return causal_sdpa(query, self.k, self.v, call.positions[:1], scaling, self.grouped, self.decode_kernel), None
        end = call.start + query.shape[2]
        keys, values = _to_seq_major(self.k[:, :end]), _to_seq_major(self.v[:, :end])
        return family_eager_attention(module)(module, query, keys, values, mask[..., :end], scaling=scaling, **kwargs)

    def key_positions(self, positions: torch.Tensor) -> torch.Tensor:
        return torch.arange(self.k.shape[1], device=positions.device)

    def read(self, module, query, call: CallState, scaling=None, **kwargs):
        """A shared layer's queries, the call's last ``query.shape[2]``, over the buffer this call wrote."""
        end = call.start + call.positions.shape[0]
        if plain_softmax_attention(kwargs):
            first = call.positions[-query.shape[2]:][:1]
            return causal_sdpa(query, self.k, self.v, first, scaling, self.grouped, self.decode_kernel), None
        keys, values = _to_seq_major(self.k[:, :end]), _to_seq_major(self.v[:, :end])
        mask = additive_mask(torch.arange(end), last_positions(call, query), None, query.dtype)
        return family_eager_attention(module)(module, query, keys, values, mask, scaling=scaling, **kwargs)


class CustomOpRingCache(nn.Module):
    """Sliding window W: S = W + spare slots, position p at slot p % S; attends to the ring as it was
    before the call followed by the call's own keys, masked to the window (RingKVCache's semantics)."""

    def __init__(self, batch: int, kv_heads: int, window: int, head_dim: int, dtype: torch.dtype, spare: int = 0,
                 grouped: bool = True):
        super().__init__()
        self.grouped = grouped  # --sdpa-query grouped (else per-head)
        self.window = window
        self.slots = window + spare
        shape = (batch, self.slots, kv_heads, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype), persistent=False)

    def attend(self, module, query, key, value, mask, call: CallState, scaling=None, **kwargs):
        k_new, v_new = _to_seq_major(key), _to_seq_major(value)
        keys = torch.cat([self.k, k_new], dim=1)
        values = torch.cat([self.v, v_new], dim=1)
        result = self._attention(module, query, keys, values, mask, scaling, kwargs)
        call.attended[self] = keys, values  # for layers that share this ring
        newest, slots = call.ring_writes(self.slots)
        torch.ops.llama.update_cache_with_indices(k_new.index_select(1, newest), self.k, 0, slots[None])
        torch.ops.llama.update_cache_with_indices(v_new.index_select(1, newest), self.v, 0, slots[None])
        return result

    def read(self, module, query, call: CallState, scaling=None, **kwargs):
        """A shared layer's queries, the call's last ``query.shape[2]``, over what this layer attended
        to in the call (the ring before its write, then the call's keys)."""
        keys, values = call.attended[self]
        return self._attention(module, query, keys, values, shared_ring_mask(call, query, self.slots, self.window), scaling, kwargs)

    def _attention(self, module, query, keys, values, mask, scaling, kwargs):
        """Attention of ``query`` over sequence-major ``keys``/``values`` under ``mask``."""
        if not plain_softmax_attention(kwargs):
            return family_eager_attention(module)(
                module, query, _to_seq_major(keys), _to_seq_major(values), mask, scaling=scaling, **kwargs
            )
        if self.k.shape[2] == 1:  # one KV head
            # Runs inside the delegate; custom_sdpa is a call out of it (docs/performance.md).
            return window_attention(query, keys, values, mask, scaling), None
        # The kernel takes a float32 mask whatever the activations' dtype (float16 ones fail at run time).
        return masked_sdpa(query, keys, values, mask[0, 0].float(), scaling, self.grouped), None

    def key_positions(self, positions: torch.Tensor) -> torch.Tensor:
        return ring_key_positions(positions, self.slots)


def masked_sdpa(query, keys, values, mask, scaling, grouped: bool = True) -> torch.Tensor:
    """``llama::custom_sdpa`` of ``query [1, H, T, D]`` over sequence-major ``keys``/``values``
    under ``mask [T, K]``. Returns ``[1, T, H, D]``.

    ``grouped``: a one-token call with query-head groups reads each row once, as ``causal_sdpa``'s
    does, the mask's one row given to each row of the group; else one row per query head."""
    query = clear_vector_state(query)
    if not grouped:
        return torch.ops.llama.custom_sdpa(_to_seq_major(query), keys, values, 0, mask, 0.0, False, scaling)
    q, mask = _with_extra_row(query), torch.cat([mask, mask[-1:]])

    def row_by_row(q, keys, values, mask):
        return torch.ops.llama.custom_sdpa(q, keys, values, 0, mask, 0.0, False, scaling)

    def stacked(q, keys, values, mask):
        return last_row_by_group(q, keys, values, scaling, mask_row=mask[-1:])

    return _by_call_length(query, keys, stacked, row_by_row, (q, keys, values, mask))[:, :-1]


def causal_sdpa(query, keys, values, first, scaling, grouped: bool = True, decode_kernel: bool = False) -> torch.Tensor:
    """``llama::custom_sdpa`` of ``query [1, H, T, D]`` over a static buffer's ``keys``/``values``,
    causal from position ``first`` (a one-element tensor; the kernel reads positions
    ``[0, first + T)`` only). Returns ``[1, T, H, D]``.

    The kernel splits its work by query head, so each KV head's rows are read once per query head
    of its group. ``grouped``: a one-token call (a decode step) with groups stacks each group's
    query heads as the rows of one query over its KV head, attending to every filled position (for
    that one token, causal is everything so far): each cached row is read once a step. Longer calls
    (prefill, verification) need the causal mask row by row and stay one query row per head.
    Else (``per-head``) every call is the kernel's own, one row per query head. ``decode_kernel``
    (``--decode-attention kvexport``): a call of up to ``MOST_TOKENS`` (a decode step, a
    verification) is ``kvexport::decode_sdpa`` over positions ``[0, first + T)`` instead
    (``kvexport/kernels``), split over the positions, each row read once per query row.

    Causal, the extra row (``_with_extra_row``) reads one key past the call's end, which is why a
    static buffer has one slot more than the positions it holds.

    The query passes ``clear_vector_state`` first (``custom_sdpa``'s speed on XNNPACK's pool
    threads), except with ``decode_kernel``: kvexport's kernel is compiled for this CPU's vector
    extensions, with no SSE code to slow, and clearing would cost its decode step a wide
    subtraction a layer (``longer``'s ``custom_sdpa`` goes without it: a ``torch.cond`` branch's
    ops stay outside the delegate, where they would clear nothing)."""
    if decode_kernel:
        scale = query.shape[-1] ** -0.5 if scaling is None else scaling

        def short(q, keys, values, first):
            return torch.ops.kvexport.decode_sdpa(q, keys, values, start_position(first) + q.shape[1], scale)

        def longer(q, keys, values, first):
            return torch.ops.llama.custom_sdpa(q, keys, values, start_position(first), None, 0.0, True, scaling)

        operands = (_to_seq_major(query).contiguous(), keys, values, first)
        return by_call_length(query.shape[2], short, longer, operands, most=MOST_TOKENS)
    query = clear_vector_state(query)
    if not grouped:
        start = start_position(first)
        return torch.ops.llama.custom_sdpa(_to_seq_major(query), keys, values, start, None, 0.0, True, scaling)

    def row_by_row(q, keys, values, first):
        return torch.ops.llama.custom_sdpa(q, keys, values, start_position(first), None, 0.0, True, scaling)

    def stacked(q, keys, values, first):
        return last_row_by_group(q, keys, values, scaling, end=start_position(first) + q.shape[1] - 1)

    return _by_call_length(query, keys, stacked, row_by_row, (_with_extra_row(query), keys, values, first))[:, :-1]


def _with_extra_row(query: torch.Tensor) -> torch.Tensor:
    """``query [1, H, T, D]`` sequence-major with one row more, a copy of its last (whose output
    the caller drops): given one query row, the kernel's products go through the BLAS's
    matrix-vector path, several times slower than a two-row product
    (docs/performance.md#attention-in-a-pte). A stacked group is at least two rows already."""
    q = _to_seq_major(query)
    return torch.cat([q, q[:, -1:]], dim=1)


def _by_call_length(query, keys, one_token, longer, operands):
    """``one_token(*operands)`` for a one-token call whose query heads share KV heads, else
    ``longer(*operands)``."""
    if query.shape[1] > keys.shape[2]:
        return by_call_length(query.shape[2], one_token, longer, operands)
    return longer(*operands)


def by_call_length(tokens, short, longer, operands, most: int = 1):
    """``short(*operands)`` for a call of at most ``most`` tokens (by default a one-token call), else
    ``longer(*operands)``. One program serves calls of every length, so where the length is
    symbolic the choice is a ``torch.cond`` on it (a fixed-length method takes its branch)."""
    if isinstance(tokens, torch.SymInt):
        return torch.cond(tokens <= most, short, longer, operands)
    return (short if tokens <= most else longer)(*operands)


def start_position(first: torch.Tensor):
    """The call's first position as the kernel's start, read inside a ``torch.cond`` branch (an
    integer traced from a tensor cannot be an operand of one, nor be closed over)."""
    start = first.item()
    torch._check(start >= 0)
    return start


def last_row_by_group(q, keys, values, scaling, end=None, mask_row=None):
    """Attention of ``q``'s last row (``q`` sequence-major) over positions ``[0, end)``, or under
    ``mask_row [1, K]``, each group of query heads the rows of one query over its KV head,
    non-causal; returned for every row of ``q`` (a one-token call's two rows are the same token)."""
    _, rows, heads, d = q.shape
    kv_heads = keys.shape[2]
    group = heads // kv_heads
    stacked = q[:, -1].reshape(1, kv_heads, group, d).transpose(1, 2)  # [1, group, kv_heads, D]
    if mask_row is None:
        # Non-causal, the kernel reads positions [0, start + group): start may be negative.
        out = torch.ops.llama.custom_sdpa(stacked, keys, values, end - group, None, 0.0, False, scaling)
    else:
        out = torch.ops.llama.custom_sdpa(stacked, keys, values, 0, mask_row.expand(group, -1).contiguous(), 0.0, False, scaling)
    return out.transpose(1, 2).reshape(1, 1, heads, d).expand(1, rows, heads, d).contiguous()


def window_attention(query, keys, values, mask, scaling=None) -> torch.Tensor:
    """softmax(QK^T·scale + mask)·V over a ring's ``W + T`` keys as two batched matmuls and a
    softmax, all of which XNNPACK runs inside the delegate (``llama::custom_sdpa`` is a call out of
    it per layer).

    query ``[1, H, T, D]``; keys, values ``[1, W + T, 1, D]`` (sequence-major, one KV head: already
    the ``[S, D]`` matrices the products take); mask ``[1, 1, T, W + T]``, added by broadcasting
    (taking its ``[T, W + T]`` first would add ops outside the delegate in every layer). The
    query heads are stacked along the rows. Scores come out as ``K·Qᵀ`` and are transposed after: a
    transpose of ``Kᵀ`` would copy the whole window every layer. Returns ``[1, T, H, D]``.
    """
    _, h, t, d = query.shape
    scaling = d**-0.5 if scaling is None else scaling
    q = (query * scaling).reshape(1, h * t, d)
    k, v = keys.reshape(1, -1, d), values.reshape(1, -1, d)
    scores = torch.bmm(k, q.transpose(1, 2)).transpose(1, 2).reshape(h, t, -1) + mask
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.bmm(probs.reshape(1, h * t, -1), v).reshape(1, h, t, d).transpose(1, 2)


def custom_op_caches(grouped: bool = True, decode_kernel: bool = False) -> CacheKinds:
    """The cache kinds, their attention ``--sdpa-query grouped`` or ``per-head``; ``decode_kernel``: a
    full layer's decode step attends with kvexport's kernel (``--decode-attention kvexport``)."""
    return {STATIC: partial(CustomOpStaticCache, grouped=grouped, decode_kernel=decode_kernel),
            RING: partial(CustomOpRingCache, grouped=grouped)}


CUSTOM_OP_CACHES: CacheKinds = custom_op_caches()
