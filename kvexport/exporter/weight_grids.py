"""The grids a quantized source's weights lie on, found in the weights themselves and kept.

A GGUF model reaches transformers dequantized to float, but every weight still lies on its type's
grid: per run of 16 or 32 values along K, a uniform grid of 16 levels (Q4_0, Q4_1, Q4_K) or more
(Q5_0, Q6_K, Q8_0). Quantizing such a weight onto a grid of our own rounds it a second time; both
targets' quantizers (``onnx.quantize`` for ONNX's int4, ``executorch.quantize`` for ExecuTorch's
8da4w) find the source's grid with ``grid_steps`` and keep it. A float weight (no grid) gets
min..max blocks.
"""

from __future__ import annotations

import numpy as np

BLOCK = 32  # weights per scale, along K (a MatMul's input dim, an embedding's hidden dim)
FINE_BLOCK = 16  # weights per scale of an 8-bit projection: GGUF's Q6_K scales runs of 16


def int4_blocks(weight_nk: np.ndarray, steps: np.ndarray | None = None,
                rows_per_call: int = 16384) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``weight_nk`` [N, K] as (q [N, K/32, 32] in 0..15, scale [N, K/32], offset [N, K/32]) with
    ``weight ~= scale * (q - 8) + offset`` per block. A block on a grid of at most 16 levels keeps
    its grid's step, so it comes out exactly even where it does not reach its grid's lowest and
    highest level (GGUF's Q4_K); any other block spans its min..max in 15 steps (exact for Q4_1).
    ``steps``: the weight's ``grid_steps`` over blocks of 32, where the caller has them already.
    Taken ``rows_per_call`` rows at a time: an int4 lm_head of a 262k vocabulary would otherwise
    hold several float32 copies of itself at once."""
    n, k = weight_nk.shape
    if n > rows_per_call:
        step_rows = None if steps is None else steps.reshape(n, -1)
        return _in_row_pieces(lambda rows, i: int4_blocks(rows, None if step_rows is None else step_rows[i : i + len(rows)]),
                              weight_nk, rows_per_call)
    blocks = weight_nk.reshape(n, k // BLOCK, BLOCK).astype(np.float32)
    lo, hi = blocks.min(-1), blocks.max(-1)
    scale = (hi - lo) / np.float32(15)
    step = (grid_steps(weight_nk, BLOCK) if steps is None else steps).reshape(n, k // BLOCK)
    with np.errstate(invalid="ignore", divide="ignore"):  # nan (no grid): the min..max rule
        scale = np.where((step > 0) & (np.rint((hi - lo) / step) <= 15), step, scale)
    safe = np.where(scale == 0, np.float32(1), scale)
    q = np.clip(np.rint((blocks - lo[..., None]) / safe[..., None]), 0, 15).astype(np.uint8)
    return q, scale.astype(np.float32), (lo + 8 * scale).astype(np.float32)


def int4_zero_point_blocks(weight_nk: np.ndarray, rows_per_call: int = 16384) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``weight_nk`` [N, K] as (q [N, K/32, 32] in 0..15, step [N, K/32], zero [N, K/32] in 0..15)
    with ``weight ~= step * (q - zero)`` per block, ``zero`` a whole level: of the 16, the one whose
    smallest step still reaches the block's min and max (with zero, always a level) without
    clipping either, so every weight is within half a step. For a weight rounded anyway (ONNX's
    int4 lm_head), which a kernel with whole zero points reads without offsets."""
    n, k = weight_nk.shape
    if n > rows_per_call:
        return _in_row_pieces(lambda rows, _: int4_zero_point_blocks(rows, rows_per_call), weight_nk, rows_per_call)
    blocks = weight_nk.reshape(n, k // BLOCK, BLOCK).astype(np.float32)
    lo = np.minimum(blocks.min(-1), 0)
    hi = np.maximum(blocks.max(-1), 0)
    zero = np.arange(16, dtype=np.float32)[:, None, None]  # candidates, broadcast over [N, K/32]
    with np.errstate(divide="ignore", invalid="ignore"):
        steps = np.maximum(np.where(lo < 0, -lo / zero, 0), np.where(hi > 0, hi / (15 - zero), 0))
    best = np.argmin(steps, axis=0)
    step = np.take_along_axis(steps, best[None], 0)[0].astype(np.float32)
    step = np.where(step == 0, np.float32(1), step)  # a block of zeros: any step, every weight at the zero point
    q = np.clip(np.rint(blocks / step[..., None]) + best[..., None], 0, 15).astype(np.uint8)
    return q, step, best.astype(np.uint8)


def _in_row_pieces(quantize, weight_nk: np.ndarray, rows_per_call: int) -> tuple[np.ndarray, ...]:
    """``quantize(rows, first_row)`` over ``weight_nk`` ``rows_per_call`` rows at a time, its arrays
    joined along the rows: a 262k-row lm_head would otherwise hold several float32 copies of
    itself at once."""
    parts = [quantize(weight_nk[i : i + rows_per_call], i) for i in range(0, weight_nk.shape[0], rows_per_call)]
    return tuple(np.concatenate(arrays) for arrays in zip(*parts))


def int8_blocks(weight: np.ndarray, block: int = BLOCK, steps: np.ndarray | None = None,
                rows_per_call: int = 16384) -> tuple[np.ndarray, np.ndarray]:
    """``weight`` [R, C] as (q [R, C] as uint8 with zero point 128, scale [R, C/block]), symmetric:
    ``scale = max |block| / 127`` (GGUF's Q8_0 rule, so a Q8_0 table comes out unchanged). Given
    ``steps`` (the weight's ``grid_steps`` over runs of ``block``), a block on a grid through 0 of
    at most 127 steps each way keeps its grid's step (exact for GGUF's Q5_0 and Q6_K too).
    Taken ``rows_per_call`` rows at a time, as ``int4_blocks`` is: a large embedding table taken
    whole would hold several float32 copies of itself at the export's peak."""
    r, c = weight.shape
    if r > rows_per_call:
        step_rows = None if steps is None else steps.reshape(r, -1)
        return _in_row_pieces(
            lambda rows, i: int8_blocks(rows, block, None if step_rows is None else step_rows[i : i + len(rows)]),
            weight, rows_per_call,
        )
    blocks = weight.reshape(r, c // block, block).astype(np.float32)
    absmax = np.abs(blocks).max(-1)
    scale = absmax / np.float32(127)
    if steps is not None:
        step = steps.reshape(r, c // block)
        with np.errstate(invalid="ignore", divide="ignore"):
            zero_level = blocks[..., 0] / step  # the grid passes through 0: an integer
            through_zero = np.abs(zero_level - np.rint(zero_level)) < 1e-3
            scale = np.where((step > 0) & through_zero & (np.rint(absmax / step) <= 127), step, scale)
    safe = np.where(scale == 0, np.float32(1), scale)
    q = np.clip(np.rint(blocks / safe[..., None]), -127, 127).astype(np.int16) + 128
    return q.astype(np.uint8).reshape(r, c), scale.astype(np.float32)


def on_levels(weight: np.ndarray, q: np.ndarray, scale: np.ndarray, block: int) -> bool:
    """Whether ``int8_blocks``' ``(q, scale)`` of ``weight`` [R, C] hold it exactly: every weight
    on its block's level (to the 1e-3 of a step ``grid_steps`` allows)."""
    r, c = weight.shape
    safe = np.where(scale == 0, np.float32(1), scale)[..., None]
    levels = weight.reshape(r, c // block, block).astype(np.float32) / safe
    return bool(np.abs(levels - (q.reshape(r, c // block, block).astype(np.float32) - 128)).max() < 1e-3)


def finer_than_4_bits(weight_nk: np.ndarray, fine: np.ndarray | None = None, coarse: np.ndarray | None = None) -> bool:
    """Whether ``weight_nk`` [N, K] comes from a quantized source finer than 4 bits (GGUF's Q5_0,
    Q6_K, Q8_0, ...): every run of 16 weights along K lies on a uniform grid of at most 256 levels,
    and some block of 32 spans more than 16 of them. Int4 would round such a weight again; a
    float weight (no grid) or one already on a 4-bit grid is not finer. ``fine``, ``coarse``: its
    ``grid_steps`` over runs of 16 and blocks of 32, where the caller has them already."""
    fine = grid_steps(weight_nk, FINE_BLOCK) if fine is None else fine
    if np.isnan(fine).any() or (_spans(weight_nk, FINE_BLOCK) > 255 * fine).any():
        return False
    coarse = grid_steps(weight_nk, BLOCK) if coarse is None else coarse
    with np.errstate(invalid="ignore", divide="ignore"):
        return bool(np.isnan(coarse).any() or (np.rint(_spans(weight_nk, BLOCK) / coarse) > 15).any())


def _spans(weight_nk: np.ndarray, size: int) -> np.ndarray:
    runs = weight_nk.reshape(-1, size)
    return runs.max(-1) - runs.min(-1)


def grid_steps(weight_nk: np.ndarray, size: int) -> np.ndarray:
    """Per run of ``size`` weights along K (row-major): the step of the uniform grid the run's
    values lie on, 0 for a constant run, nan for a run on no grid; all nan for a float weight (its
    first runs lie on no grid: not worth scanning the rest), one nan read for every run (a
    read-only view that takes no memory: a quantizer keeps every weight's steps at once)."""
    runs = weight_nk.reshape(-1, size)
    if np.isnan(_run_grid_steps(runs[:4096])).any():
        return np.broadcast_to(np.float32(np.nan), (len(runs),))
    return _run_grid_steps(runs)


def _run_grid_steps(runs: np.ndarray) -> np.ndarray:
    """The coarsest step whose grid holds each run's values, tried at 1/1 .. 1/64 of the closest
    gap between them (a run need not use neighbouring levels: 16 of Q8_0's 255 may lie far apart)."""
    runs = np.sort(runs.astype(np.float32), axis=-1)
    gaps = np.diff(runs, axis=-1)
    closest = np.where(gaps > 0, gaps, np.inf).min(axis=-1)
    steps = np.where(np.isfinite(closest), np.nan, 0).astype(np.float32)
    todo = np.flatnonzero(np.isfinite(closest))
    for divisor in range(1, 65):
        step = closest[todo] / divisor
        top = np.rint((runs[todo, -1] - runs[todo, 0]) / step)
        # The closest gap is a difference of two rounded floats; the whole span, over its number of
        # steps, gives the step to 1e-7, which a 255-level grid needs.
        step = (runs[todo, -1] - runs[todo, 0]) / np.maximum(top, 1)
        levels = (runs[todo] - runs[todo, :1]) / step[:, None]
        on_grid = np.abs(levels - np.rint(levels)).max(axis=-1) < 1e-3
        steps[todo[on_grid]] = step[on_grid]
        todo = todo[~on_grid]
        if not len(todo):
            break
    return steps
