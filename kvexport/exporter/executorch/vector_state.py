"""A decode step's attention kernel after XNNPACK, on every thread of the pool.

XNNPACK's assembly float32 GEMM kernels for x86-64 return without ``vzeroupper``, leaving the
upper halves of the AVX registers they used dirty on whichever pool thread ran them. The next
kernel on that thread, ``llama::custom_sdpa``, has its softmax compiled as SSE code calling libm's
``expf``; on CPUs that penalise SSE code after dirty AVX state, that part of the attention runs
many times slower on the worker threads than on the calling thread (which passes through other
code first), and the whole call waits for the slowest thread.

A delegated elementwise op wide enough that XNNPACK spreads it over every thread of the pool,
placed between the projections and the kernel, ends on each thread with a compiled AVX kernel's
``vzeroupper``. Its result is an exact zero added to the query, so nothing else changes
(docs/performance.md#the-pool-threads-vector-state).
"""

from __future__ import annotations

import torch

# Elements of the subtraction: enough that XNNPACK gives every thread of a small pool a share.
SPREAD_ELEMENTS = 65536


def clear_vector_state(query: torch.Tensor) -> torch.Tensor:
    """``query [1, H, T, D]`` unchanged, computed after a subtraction of about
    ``SPREAD_ELEMENTS`` values of its first token's rows (their outer difference, whose corner
    ``rows[0] - rows[0]`` is the exact zero added)."""
    rows = query[0, :, 0, :].reshape(-1)
    width = min(rows.shape[0], -(-SPREAD_ELEMENTS // rows.shape[0]))
    spread = rows[:, None] - rows[None, :width]
    return query + spread[:1, :1]
