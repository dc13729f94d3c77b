"""How ExecuTorch's ``llama::custom_sdpa`` times by query rows on this machine: one call, causal,
over a cache filled to each length, for 1, 2 and ``--rows`` query rows, and a one-token call as
kvexport makes it where query heads share a KV head (each group stacked as one head's rows).

    python scripts/custom_sdpa_rows.py [--heads 9] [--kv-heads 3] [--head-dim 64] [--keys 128,1024,4096]
        [--rows 9] [--threads 2] [--blas-threads mkl|one]

kvexport's `.pte` gives the kernel one query row more than a call has
(``exporter/executorch/custom_op_cache``): with ExecuTorch's pip wheel (its products
through libtorch's MKL) a one-row call takes several times as long as a two-row one. Another
build links another BLAS; this prints whether that still holds there (the same C++ kernel, called
through its PyTorch op). Microseconds per call, the median of repeated calls. ``--blas-threads``:
MKL's own thread count (``mkl``, as ExecuTorch's pip runtime runs a one-token call), or one MKL
thread on the calling thread (``one``, as kvexport's runtime runs a call of several tokens:
``runtime/blas_threads``). The decode-step line at the end times with MKL's own count, as
``--sdpa-query auto`` does.

The kernel splits its work by query head, reading a KV head's rows once per query head of its
group; the stacked call reads them once (``custom_op_cache.causal_sdpa``). Its column is a decode
step's call with ``--sdpa-query grouped``, the 1-row one with ``per-head``; the last line times a
step of each over several layers' buffers, as ``--sdpa-query auto`` does, and names the faster.
"""

from __future__ import annotations

import argparse
import statistics
import time


def time_call(call, repeats: int) -> float:
    """Median microseconds of ``call()`` after a few warm-up calls."""
    for _ in range(5):
        call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def sdpa_times(heads: int, kv_heads: int, head_dim: int, keys: list[int], rows: list[int], repeats: int = 50) -> dict:
    """``{(keys, rows): µs}``: one causal call whose last row attends to ``keys`` positions."""
    import executorch.extension.llm.custom_ops.custom_ops  # noqa: F401  (registers torch.ops.llama.*)
    import torch

    from kvexport.exporter.executorch.custom_op_cache import last_row_by_group

    cache = max(keys) + max(rows)
    k, v = torch.randn(1, cache, kv_heads, head_dim), torch.randn(1, cache, kv_heads, head_dim)
    times = {}
    for n in keys:
        for t in rows:
            q = torch.randn(1, t, heads, head_dim)
            times[n, t] = time_call(lambda: torch.ops.llama.custom_sdpa(q, k, v, n - t, None, 0.0, True, None), repeats)
        if heads > kv_heads:
            q = torch.randn(1, 2, heads, head_dim)  # a one-token call and its extra row
            times[n, "grouped"] = time_call(lambda: last_row_by_group(q, k, v, None, end=n), repeats)
    return times


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--keys", default="128,1024,4096")
    parser.add_argument("--rows", type=int, default=9, help="the most query rows timed (a verification of K drafts: K + 1)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--blas-threads", choices=["mkl", "one"], default="mkl",
                        help="one: one MKL thread on the calling thread, as kvexport's runtime runs a call of several tokens; mkl: MKL's own count")
    args = parser.parse_args(argv)
    import contextlib

    import torch

    from kvexport.runtime.blas_threads import one_blas_thread

    torch.set_num_threads(args.threads)
    keys = [int(n) for n in args.keys.split(",")]
    rows = sorted({1, 2, args.rows})
    with one_blas_thread() if args.blas_threads == "one" else contextlib.nullcontext():
        times = sdpa_times(args.heads, args.kv_heads, args.head_dim, keys, rows)
    columns = rows + (["grouped"] if (keys[0], "grouped") in times else [])
    print("| keys | " + " | ".join(f"{t} row{'s' if t > 1 else ''} µs" if t != "grouped" else "1 token grouped µs" for t in columns) + " |")
    print("|---:|" + "---:|" * len(columns))
    for n in keys:
        print(f"| {n:,} | " + " | ".join(f"{times[n, t]:.0f}" for t in columns) + " |")
    if args.heads > args.kv_heads:
        from kvexport.exporter.executorch import sdpa_query

        positions = min(max(keys), sdpa_query.TIMED_POSITIONS)
        step = sdpa_query.step_microseconds(args.heads, args.kv_heads, args.head_dim, positions)
        print(f"\nA decode step over {sdpa_query.TIMED_LAYERS} layers' buffers of {positions:,} positions: "
              + ", ".join(f"{form} {us:,.0f} µs" for form, us in step.items())
              + f". Export for this machine with --sdpa-query {sdpa_query.faster(step)} (what auto chooses here).")


if __name__ == "__main__":
    main()
