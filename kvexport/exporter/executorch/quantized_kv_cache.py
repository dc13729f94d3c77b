"""int8 KV caches for ExecuTorch (``--kv-cache int8``), in ExecuTorch's own scheme.

Keys and values are stored as int8 with one scale (float32) and zero point (int8) per token and KV
head, chosen from that row's min and max when it is written (``quantized_decomposed``'s per-token
asymmetric ops, as ExecuTorch's ``QuantizedKVCache`` does). A one-token call (a decode step) attends
with ``llama::custom_quantized_sdpa``, which reads the int8 rows in place with their scales and
takes the query quantized the same way, or (``--int8-kv-sdpa dequantized``, for CPUs where that
kernel's int8 products are a scalar fallback) as a longer call does; a longer one (prefill, a
verification) reads the rows it attends to dequantized, with ``llama::custom_sdpa``
(``by_length``). The buffers keep the layout of ``custom_op_cache``'s float caches
(sequence-major ``[1, slots, kv_heads, head_dim]``, scales ``[1, slots, kv_heads, 1]``), written by
the same ``llama::update_cache`` ops, and a ring keeps ``window`` slots (and any spare ones,
``RingKVCache``).

Keys and queries are first rotated by one orthonormal Hadamard matrix (``key_rotation``): q·k is
unchanged, and the few channels in which a key is large are spread over all of them, so one scale
per row fits the key closely. Without it the keys' error dominates; SpinQuant's R3 rotation, which
ExecuTorch's ``spin_quant.py`` names for KV cache quantization, is the same (docs/quantization.md).

A family whose attention needs more than softmax(QK^T·scale + mask)·V (gpt-oss's attention sinks)
reads the rows dequantized, unrotated, through its own eager attention. Soft-capped attention
(Gemma 2) is refused before export: that path does not lower for it (see ``rotated``).
"""

from __future__ import annotations

import functools

import executorch.extension.llm.custom_ops.custom_ops  # noqa: F401  (registers torch.ops.llama.*)
import executorch.kernels.quantized  # noqa: F401  (the out variants of quantized_decomposed.*)
import torch
from torch import nn
from torch.ao.quantization.fx._decomposed import quantized_decomposed_lib  # noqa: F401

from ...kernels import MOST_TOKENS, define_ops
from ...models.architecture import RING, STATIC
from ..attention import family_eager_attention, plain_softmax_attention
from ..kv_cache import CacheKinds, CallState, additive_mask, last_positions, ring_key_positions, shared_ring_mask
from .custom_op_cache import by_call_length, start_position
from .vector_state import clear_vector_state

define_ops()  # torch.ops.kvexport.decode_sdpa_int8

INT8 = torch.int8
QMIN, QMAX = torch.iinfo(INT8).min, torch.iinfo(INT8).max


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x [..., D]`` -> int8 values, float32 scales and int8 zero points ``[..., 1]``: one pair per row."""
    x = x if x.dtype == torch.float32 else x.float()
    scales, zero_points = torch.ops.quantized_decomposed.choose_qparams_per_token_asymmetric.default(x, INT8)
    values = torch.ops.quantized_decomposed.quantize_per_token(x, scales, zero_points, QMIN, QMAX, INT8)
    return values, scales.float(), zero_points.to(INT8)


def key_rotation(head_dim: int) -> torch.Tensor:
    """An orthonormal Hadamard matrix ``[D, D]``: Sylvester's, in blocks of the largest power of two
    dividing ``D`` (one block where ``D`` is a power of two)."""
    block = head_dim & -head_dim
    h = torch.ones(1, 1)
    while h.shape[0] < block:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    return torch.block_diag(*[h / block**0.5] * (head_dim // block))


def dequantize_rows(values: torch.Tensor, scales: torch.Tensor, zero_points: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """ExecuTorch's per-token dequantize, as its ``QuantizedKVCache`` reads its rows (float64 scales
    and int64 zero points, as that op takes them)."""
    return torch.ops.quantized_decomposed.dequantize_per_token(
        values, scales.double(), zero_points.long(), QMIN, QMAX, INT8, torch.float32
    ).to(dtype)


def _to_seq_major(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(1, 2)  # [1, heads, T, D] <-> [1, T, heads, D]


def quantized_sdpa(query, rows, start, mask, scaling):
    """``llama::custom_quantized_sdpa`` of ``query [1, H, T, D]`` over int8 ``rows`` (values, scales
    and zero points of K, then of V, sequence-major): causal from ``start`` where ``mask`` is None
    (reading positions ``[0, start + T)`` only), else under ``mask [T, K]``. Returns ``[1, T, H, D]``.
    Its products are torchao's int8 kernels, which take a one-row call in about half a two-row
    call's time: no extra query row, unlike ``custom_op_cache.masked_sdpa``, and no stacked
    query-head groups (slower here too). The query passes ``clear_vector_state`` first."""
    query = clear_vector_state(query)
    return _int8_sdpa(*quantize_rows(_to_seq_major(query)), rows, start, mask, scaling).to(query.dtype)


def _int8_sdpa(q, q_scales, q_zero_points, rows, start, mask, scaling):
    k, k_scales, k_zero_points, v, v_scales, v_zero_points = rows
    return torch.ops.llama.custom_quantized_sdpa(
        q, k, v, start, mask, 0.0, mask is None, scaling,
        q_zero_points, q_scales, k_zero_points, k_scales, v_zero_points, v_scales, False,
    )


def dequantized_sdpa(query, rows, start, mask, scaling):
    """``llama::custom_sdpa`` of a float ``query [1, T, H, D]`` (sequence-major) over int8 ``rows``
    dequantized (``as_float``): causal from ``start`` where ``mask`` is None (dequantizing positions
    ``[0, start + T)`` only), else under ``mask [T, K]``. Returns ``[1, T, H, D]``, in float32 (the
    kernel takes the query in the keys' dtype)."""
    query = query.float()
    if mask is None:
        end = start + query.shape[1]
        torch._check(end <= rows[0].shape[1])
        rows = tuple(r[:, :end] for r in rows)
    keys, values = as_float(*rows[:3]), as_float(*rows[3:])
    return torch.ops.llama.custom_sdpa(query, keys, values, start, mask, 0.0, mask is None, scaling)


def as_float(values: torch.Tensor, scales: torch.Tensor, zero_points: torch.Tensor) -> torch.Tensor:
    """``dequantize_rows`` to float32, bit for bit (``x - z`` is exact in float32 and the product
    is rounded once, as the reference's float64 product then is), in operators that ExecuTorch runs
    quickly: a per-tensor dequantize of scale 1 converts int8 to float in a vectorised kernel (and
    XNNPACK takes it where the shapes are not data-dependent), where ``dequantize_per_token``'s
    portable loop, and the float64 and int64 copies of the scales and zero points it takes, cost
    several times as much (docs/quantization.md#decode-in-the-float-kernel)."""
    x = torch.ops.quantized_decomposed.dequantize_per_tensor(values, 1.0, 0, QMIN, QMAX, INT8)
    z = torch.ops.quantized_decomposed.dequantize_per_tensor(zero_points, 1.0, 0, QMIN, QMAX, INT8)
    return (x - z) * scales


def float_kernel_sdpa(query, rows, start, mask, scaling):
    """``dequantized_sdpa`` of ``query [1, H, T, D]`` (it passes ``clear_vector_state`` first),
    returned in its dtype, ``[1, T, H, D]``."""
    query = clear_vector_state(query)
    return dequantized_sdpa(_to_seq_major(query), rows, start, mask, scaling).to(query.dtype)


def by_length(query, rows, scaling, first=None, mask=None, int8_kernel=True):
    """Attention of ``query [1, H, T, D]`` over int8 ``rows`` (as ``quantized_sdpa``'s), causal from
    position ``first`` (a one-element tensor) or under ``mask [T, K]``. Returns ``[1, T, H, D]``.

    ``int8_kernel``: a one-token call (a decode step) is ``quantized_sdpa``, and a longer call
    (prefill, a verification) attends with the float kernel (``dequantized_sdpa``), the query rounded
    as the int8 kernel rounds it: a verification's rows are then a one-token call's within float
    rounding, and torchao's int8 products, the quicker for one query row on aarch64, take several
    times as long as the float kernel and the dequantization together for many
    (docs/performance.md#decode-by-context-length). Else every call is ``dequantized_sdpa`` with the
    query as it is. The query passes ``clear_vector_state`` first (the kernels' speed on XNNPACK's
    pool threads)."""
    if not int8_kernel:
        return float_kernel_sdpa(query, rows, start_position(first) if mask is None else 0, mask, scaling)
    query = clear_vector_state(query)

    def one_token(q, q_scales, q_zero_points, bound, *rows):
        start = start_position(bound) if mask is None else 0
        return _int8_sdpa(q, q_scales, q_zero_points, rows, start, None if mask is None else bound, scaling)

    def longer(q, q_scales, q_zero_points, bound, *rows):
        start = start_position(bound) if mask is None else 0
        rounded = dequantize_rows(q, q_scales, q_zero_points, torch.float32)
        return dequantized_sdpa(rounded, rows, start, None if mask is None else bound, scaling)

    operands = (*quantize_rows(_to_seq_major(query)), first if mask is None else mask, *rows)
    return by_call_length(query.shape[2], one_token, longer, operands).to(query.dtype)


def decode_kernel_sdpa(query, rows, scaling, first):
    """Attention of ``query [1, H, T, D]`` over int8 ``rows`` (as ``quantized_sdpa``'s), causal from
    position ``first``: a call of up to ``MOST_TOKENS`` (a decode step, a verification) is kvexport's
    ``kvexport::decode_sdpa_int8``, which reads the int8 rows in place with their scales and zero
    points, the work split over the positions (``kvexport/kernels``); a longer one
    ``dequantized_sdpa``. Returns ``[1, T, H, D]``. No ``clear_vector_state`` (as in
    ``causal_sdpa`` with its ``decode_kernel``)."""
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling

    def short(q, first, *rows):
        return torch.ops.kvexport.decode_sdpa_int8(q, *rows, start_position(first) + q.shape[1], scale)

    def longer(q, first, *rows):
        return dequantized_sdpa(q, rows, start_position(first), None, scaling)

    operands = (_to_seq_major(query).float().contiguous(), first, *rows)
    return by_call_length(query.shape[2], short, longer, operands, most=MOST_TOKENS).to(query.dtype)


class _QuantizedRows(nn.Module):
    """int8 K and V rows with their scales and zero points (six buffers)."""

    NAMES = ("k", "k_scales", "k_zero_points", "v", "v_scales", "v_zero_points")

    def __init__(self, batch: int, kv_heads: int, slots: int, head_dim: int, dtype: torch.dtype, rotation: torch.Tensor,
                 int8_kernel: bool = True):
        super().__init__()
        self.dtype = dtype
        self.int8_kernel = int8_kernel  # whether a decode step attends with the int8 kernel (``by_length``)
        # key_rotation(head_dim) as a linear layer's weight: linear(x, W) == x @ rotation.
        self.register_buffer("rotation_weight", rotation.T.contiguous(), persistent=False)
        rows, params = (batch, slots, kv_heads, head_dim), (batch, slots, kv_heads, 1)
        for name in self.NAMES:
            shape = rows if name in ("k", "v") else params
            buffer = torch.ones(shape) if name.endswith("scales") else torch.zeros(shape, dtype=INT8)
            self.register_buffer(name, buffer, persistent=False)

    def rotated(self, query, key, kwargs):
        """Query and key rotated where the fused kernel attends. A family that reads the rows
        dequantized keeps its keys as they are: with the rotation (gpt-oss), as with soft-capping
        (Gemma 2), XNNPACK's partitioner groups the layer into partitions that depend on each
        other, and the lowering fails."""
        if plain_softmax_attention(kwargs):
            return self.rotate(query), self.rotate(key)
        return query, key

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ rotation`` as a linear layer over 2-D rows: XNNPACK takes it with the rotation as its
        constant weight, where a batched product of a 4-D ``x`` expands the rotation to its batch
        outside the delegate and splits the layer's partition."""
        return torch.nn.functional.linear(x.reshape(-1, x.shape[-1]), self.rotation_weight).view(x.shape)

    def buffers_in_order(self) -> tuple[torch.Tensor, ...]:
        return tuple(getattr(self, name) for name in self.NAMES)

    def dequantized(self, rows) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of ``rows`` in the model's dtype, head-major ``[1, kv_heads, S, D]``."""
        k, k_scales, k_zero_points, v, v_scales, v_zero_points = rows
        return (_to_seq_major(dequantize_rows(k, k_scales, k_zero_points, self.dtype)),
                _to_seq_major(dequantize_rows(v, v_scales, v_zero_points, self.dtype)))


class QuantizedStaticCache(_QuantizedRows):
    """Full attention: slot i holds position i."""

    def __init__(self, *args, decode_kernel: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.decode_kernel = decode_kernel  # --decode-attention kvexport

    def attend(self, module, query, key, value, mask, call: CallState, scaling=None, **kwargs):
        query, key = self.rotated(query, key, kwargs)
        new = (*quantize_rows(_to_seq_major(key)), *quantize_rows(_to_seq_major(value)))
        for rows, buffer in zip(new, self.buffers_in_order()):
            torch.ops.llama.update_cache(rows, buffer, call.start)
        if plain_softmax_attention(kwargs):
            rows = self.buffers_in_order()
            if self.decode_kernel:
                return decode_kernel_sdpa(query, rows, scaling, call.positions[:1]), None
            return by_length(query, rows, scaling, first=call.positions[:1], int8_kernel=self.int8_kernel), None
        end = call.start + query.shape[2]
        keys, values = self.dequantized(buffer[:, :end] for buffer in self.buffers_in_order())
        return family_eager_attention(module)(module, query, keys, values, mask[..., :end], scaling=scaling, **kwargs)

    def key_positions(self, positions: torch.Tensor) -> torch.Tensor:
        return torch.arange(self.k.shape[1], device=positions.device)

    def read(self, module, query, call: CallState, scaling=None, **kwargs):
        """A shared layer's queries, the call's last ``query.shape[2]``, over the rows this call wrote."""
        end = call.start + call.positions.shape[0]
        if plain_softmax_attention(kwargs):
            query, rows, start = self.rotate(query), self.buffers_in_order(), end - query.shape[2]
            kernel = quantized_sdpa if self.int8_kernel else float_kernel_sdpa
            return kernel(query, rows, start, None, scaling), None
        keys, values = self.dequantized(buffer[:, :end] for buffer in self.buffers_in_order())
        mask = additive_mask(torch.arange(end), last_positions(call, query), None, query.dtype)
        return family_eager_attention(module)(module, query, keys, values, mask, scaling=scaling, **kwargs)


class QuantizedRingCache(_QuantizedRows):
    """Sliding window W: S = W + spare slots, position p at slot p % S; attends to the ring as it was
    before the call followed by the call's own rows, masked to the window (``RingKVCache``'s semantics)."""

    def __init__(self, batch: int, kv_heads: int, window: int, head_dim: int, dtype: torch.dtype, rotation: torch.Tensor,
                 int8_kernel: bool = True, spare: int = 0):
        super().__init__(batch, kv_heads, window + spare, head_dim, dtype, rotation, int8_kernel)
        self.window = window
        self.slots = window + spare

    def attend(self, module, query, key, value, mask, call: CallState, scaling=None, **kwargs):
        query, key = self.rotated(query, key, kwargs)
        new = (*quantize_rows(_to_seq_major(key)), *quantize_rows(_to_seq_major(value)))
        rows = tuple(torch.cat([buffer, n], dim=1) for buffer, n in zip(self.buffers_in_order(), new))
        call.attended[self] = rows  # for layers that share this ring
        result = self._attention(module, query, rows, mask, scaling, kwargs)
        newest, slots = call.ring_writes(self.slots)
        # The rows written are taken from the rows attended to, not from ``new``: each buffer's read
        # then precedes its in-place write by a data dependency. Lowering orders operators by their
        # data alone, and a read that XNNPACK takes (a float concatenation) may otherwise follow it.
        newest = newest + self.slots
        for r, buffer in zip(rows, self.buffers_in_order()):
            torch.ops.llama.update_cache_with_indices(r.index_select(1, newest), buffer, 0, slots[None])
        return result

    def key_positions(self, positions: torch.Tensor) -> torch.Tensor:
        return ring_key_positions(positions, self.slots)

    def read(self, module, query, call: CallState, scaling=None, **kwargs):
        """A shared layer's queries, the call's last ``query.shape[2]``, over the rows this layer
        attended to in the call (the ring before its write, then the call's rows)."""
        mask = shared_ring_mask(call, query, self.slots, self.window)
        if plain_softmax_attention(kwargs):  # the rows' keys were rotated where the fused kernel attends
            query = self.rotate(query)
        return self._attention(module, query, call.attended[self], mask, scaling, kwargs)

    def _attention(self, module, query, rows, mask, scaling, kwargs):
        """Attention of ``query`` (rotated where the fused kernel attends) over int8 ``rows`` under ``mask``."""
        if plain_softmax_attention(kwargs):
            # The kernel takes a float32 mask whatever the activations' dtype.
            return by_length(query, rows, scaling, mask=mask[0, 0].float(), int8_kernel=self.int8_kernel), None
        keys, values = self.dequantized(rows)
        return family_eager_attention(module)(module, query, keys, values, mask, scaling=scaling, **kwargs)


def _with_rotation(cache_class, int8_kernel: bool, **options):
    """A cache kind whose layers of one head size share one rotation constant."""

    def make(batch: int, kv_heads: int, slots: int, head_dim: int, dtype: torch.dtype, **spare):
        return cache_class(batch, kv_heads, slots, head_dim, dtype, _rotation(head_dim, dtype), int8_kernel, **spare, **options)

    return make


@functools.cache
def _rotation(head_dim: int, dtype: torch.dtype) -> torch.Tensor:
    return key_rotation(head_dim).to(dtype)


def quantized_caches(int8_kernel: bool = True, decode_kernel: bool = False) -> CacheKinds:
    """The cache kinds, a decode step attending with the int8 kernel or, ``int8_kernel`` False, with
    the float one over the rows dequantized (``--int8-kv-sdpa``, ``by_length``); ``decode_kernel``: a
    full layer's decode step with kvexport's (``--decode-attention kvexport``, ``decode_kernel_sdpa``)."""
    return {STATIC: _with_rotation(QuantizedStaticCache, int8_kernel, decode_kernel=decode_kernel),
            RING: _with_rotation(QuantizedRingCache, int8_kernel)}


QUANTIZED_CACHES: CacheKinds = quantized_caches()
