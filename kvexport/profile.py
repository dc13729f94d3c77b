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

from .errors import InvalidOptionError
from .outputs import check_writable, write_file, write_text

TOP_FUNCTIONS = 60


@contextlib.contextmanager
def profiled(path: Path | None):
    """Profile the block into ``path`` (nothing when None); written also when the block fails. Both
    files are checked writable before the block runs, not after it."""
    if path is None:
        yield
        return
    path = Path(path)
    check_writable(path, "--profile")
    check_writable(_stats_path(path), "--profile")
    profiler = cProfile.Profile()
    profiler.enable()
    failed = True
    try:
        yield
        failed = False
    finally:
        profiler.disable()
        try:
            write_profile(profiler, path)
        except InvalidOptionError:
            if not failed:  # the block's own error, if any, is the one to tell
                raise


def _stats_path(path: Path) -> Path:
    return Path(str(path) + ".prof")


def write_profile(profiler: cProfile.Profile, path: Path) -> None:
    write_file(_stats_path(path), "--profile", lambda tmp: profiler.dump_stats(str(tmp)))
    text = ""
    for order, title in (("cumulative", "by cumulative time (the function and what it calls)"),
                         ("tottime", "by own time (the function's body alone)")):
        table = io.StringIO()
        pstats.Stats(profiler, stream=table).strip_dirs().sort_stats(order).print_stats(TOP_FUNCTIONS)
        text += f"# top {TOP_FUNCTIONS} functions {title}\n{table.getvalue()}\n"
    write_text(path, text, "--profile")
