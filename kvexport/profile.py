"""``kvexport export --profile FILE``: where an export spends its time, function by function.

cProfile over the whole export; FILE gets the functions with the most cumulative time (and, beside
it, ``FILE.prof`` with every call, for ``python -m pstats`` or snakeviz). Standard library only.
"""

from __future__ import annotations

import contextlib
import cProfile
import io
import pstats
from pathlib import Path

TOP_FUNCTIONS = 60


@contextlib.contextmanager
def profiled(path: Path | None):
    """Profile the block into ``path`` (nothing when None); written also when the block fails."""
    if path is None:
        yield
        return
    profiler = cProfile.Profile()
    profiler.enable()
    try:
        yield
    finally:
        profiler.disable()
        write_profile(profiler, Path(path))


def write_profile(profiler: cProfile.Profile, path: Path) -> None:
    profiler.dump_stats(str(path) + ".prof")
    for order, title in (("cumulative", "by cumulative time (the function and what it calls)"),
                         ("tottime", "by own time (the function's body alone)")):
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).strip_dirs().sort_stats(order).print_stats(TOP_FUNCTIONS)
        mode = "w" if order == "cumulative" else "a"
        with open(path, mode) as f:
            f.write(f"# top {TOP_FUNCTIONS} functions {title}\n{text.getvalue()}\n")
