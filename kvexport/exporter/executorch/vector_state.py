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
    ``SPREAD_ELEMENTS`` values: the outer difference of its rows' mean over the call's tokens,
    whose corner, ``rows[0] - rows[0]``, is the exact zero added. The mean is XNNPACK's average
    pooling, which takes a dynamic number of tokens, so the subtraction joins the delegate call that
    computes the query (a select of the first token's rows would run outside it, splitting the
    layer's partition in two more calls into the delegate)."""
    heads, tokens, head_dim = query.shape[1:]
    by_value = query.transpose(2, 3).reshape(1, heads * head_dim, tokens, 1)
    rows = by_value.mean(dim=(2, 3), keepdim=True)
    # Reshapes and a slice that is not the whole: XNNPACK takes no unsqueeze and no alias.
    columns = rows.reshape(1, -1)
    width = -(-SPREAD_ELEMENTS // rows.numel())
    if width < rows.numel():
        columns = columns[:, :width]
    spread = rows.reshape(-1, 1) - columns
    return query + spread[:1, :1]
