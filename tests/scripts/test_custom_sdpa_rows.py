"""scripts/custom_sdpa_rows.py: the kernel timed by query rows and cache length (figures are the
machine's: only their presence is checked)."""

from __future__ import annotations

from tests.helpers import load_script


def test_every_length_and_row_count_is_timed(capsys):
    script = load_script("custom_sdpa_rows")
    times = script.sdpa_times(heads=4, kv_heads=2, head_dim=16, keys=[8, 32], rows=[1, 2, 5], repeats=3)
    timed = {(n, t) for n in (8, 32) for t in (1, 2, 5, "grouped")}
    assert set(times) == timed and all(us > 0 for us in times.values())
    script.main(["--heads", "4", "--kv-heads", "2", "--head-dim", "16", "--keys", "8,32", "--rows", "5", "--threads", "1"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "| keys | 1 row µs | 2 rows µs | 5 rows µs | 1 token grouped µs |" and [line.split(" | ")[0] for line in lines[2:4]] == ["| 8", "| 32"]
    assert lines[-1].startswith("A decode step over ") and lines[-1].split("--sdpa-query ")[1].split(" ")[0] in ("grouped", "per-head")
