"""Step progress: a long step's own progress reaches a terminal's status line and nothing else."""

from __future__ import annotations

import io

from rich.console import Console

from kvexport import progress


def test_a_step_s_progress_updates_a_terminal_s_status_line():
    steps = progress.Progress(console=Console(file=io.StringIO(), force_terminal=True))
    with steps.step("lower", "executorch"):
        progress.report("512 MiB of weights serialized for XNNPACK")
        status, _ = progress._running
        assert status.status == "lower: executorch ... 512 MiB of weights serialized for XNNPACK"
    assert progress._running is None
    progress.report("after the step")  # no step running: nothing to update, no error


def test_a_log_gets_a_step_s_start_and_end_only():
    log = io.StringIO()
    steps = progress.Progress(console=Console(file=log, force_terminal=False))
    with steps.step("quantize", "int4"):
        progress.report("64 of 900 nodes")
    lines = log.getvalue().splitlines()
    assert lines[0] == "quantize: int4 ..." and lines[1].startswith("✓ quantize") and len(lines) == 2
