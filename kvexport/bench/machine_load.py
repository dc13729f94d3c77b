"""Other processes' load on the machine, sampled between bench's runs (Linux ``/proc/stat``)."""

from __future__ import annotations

import time
from pathlib import Path

# A share of the machine's CPUs busy between runs above this means another process shared it.
BUSY_WARNING = 0.10


def cpu_times() -> tuple[int, int] | None:
    """(busy, total) jiffies over all CPUs since boot, from /proc/stat's first line (Linux)."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields[:8]) - idle, sum(fields[:8])  # guest time is already in user


def background_busy(seconds: float = 0.5) -> float | None:
    """Share of the machine's CPU time spent busy over ``seconds`` while no path runs: another
    process's load, which slows whichever path it overlaps (the load average lags by minutes and
    counts the previous run)."""
    before = cpu_times()
    time.sleep(seconds)
    after = cpu_times()
    if before is None or after is None or after[1] <= before[1]:
        return None
    return (after[0] - before[0]) / (after[1] - before[1])
