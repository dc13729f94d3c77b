"""Step-by-step progress on stderr: what is running, then how long it took."""

from __future__ import annotations

import contextlib
import resource
import sys
import time
from pathlib import Path

from rich.console import Console


def peak_rss_mb() -> float:
    """Peak resident memory of this process so far, in MB.

    Linux's VmHWM belongs to the current program image; getrusage's maxrss survives exec, so after
    a re-exec (kvexport export) or in a subprocess it could report the parent's peak instead."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024  # kB
    except OSError:  # not Linux
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# The status line of the step running on a terminal, and its label (``report`` updates it).
_running = None


def report(detail: str) -> None:
    """How far the running step has got, for code deep inside it (a target's lowering): shown on
    its status line on a terminal, and nowhere else (a log gets the step's start and end only)."""
    if _running is not None:
        status, label = _running
        status.update(f"{label} ... {detail}")


class Progress:
    def __init__(self, quiet: bool = False, console: Console | None = None):
        self.quiet = quiet
        self.console = console or Console(stderr=True, highlight=False, soft_wrap=True)
        self.seconds: dict[str, float] = {}

    def info(self, message: str) -> None:
        if not self.quiet:
            self.console.print(message)

    @contextlib.contextmanager
    def step(self, name: str, detail: str = ""):
        label = f"{name}: {detail}" if detail else name
        start = time.perf_counter()
        if self.quiet:
            yield
        elif self.console.is_terminal:
            global _running
            with self.console.status(f"{label} ...") as status:
                _running = (status, label)
                try:
                    yield
                finally:
                    _running = None
        else:
            self.console.print(f"{label} ...")
            sys.stderr.flush()
            yield
        self.seconds[name] = time.perf_counter() - start
        self.info(f"[green]✓[/green] {name} {self.seconds[name]:.1f}s (peak RSS {peak_rss_mb():.0f} MB)")
