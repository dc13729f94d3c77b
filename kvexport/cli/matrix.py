"""``kvexport matrix MATRIX.toml [--shard I/N] [--ray ADDRESS]`` and ``kvexport matrix merge REPORT.json ...``:
the options, a line per row as it starts and ends, the reports written. The rows run in
``kvexport.matrix``."""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path
from typing import Annotated, Optional

import typer

from ..errors import InvalidOptionError
from ..matrix import report as reports
from ..matrix.cluster import run_rows_on_ray
from ..matrix.runner import run_rows
from ..matrix.spec import load_matrix, parse_shard, shard_rows
from ..outputs import check_writable, write_text

MERGE = "merge"


def matrix_command(
    paths: Annotated[
        list[str],
        typer.Argument(metavar="MATRIX.toml | merge REPORT.json...", show_default=False,
                       help="a matrix file to run, or merge and the JSON reports of its shards"),
    ],
    shard: Annotated[Optional[str], typer.Option(help="run shard I of N only (rows I-1, I-1+N, ...), e.g. 2/4")] = None,
    report: Annotated[Optional[Path], typer.Option("--report", help="write the markdown report here")] = None,
    json_report: Annotated[Optional[Path], typer.Option("--json", help="write the JSON report here (merge reads these)")] = None,
    work_dir: Annotated[
        Optional[str],
        typer.Option(help="keep each row's log here (default: a temporary folder, removed); with --ray, a folder every "
                          "node sees or an fsspec URL such as s3://bucket/runs"),
    ] = None,
    keep_artifacts: Annotated[bool, typer.Option("--keep-artifacts", help="keep each row's artifact folder")] = False,
    model: Annotated[
        Optional[list[str]], typer.Option("--model", help="run only this model's rows (repeat for several)")
    ] = None,
    ray: Annotated[
        Optional[str],
        typer.Option(metavar="ADDRESS", help="run the rows as tasks on a Ray cluster: local (one started for the run), "
                                             "auto (the one this machine belongs to) or HOST:PORT; needs kvexport[ray]"),
    ] = None,
):
    """Export and check each row of a matrix file in its own process, or merge shard reports; exit 0 only if all pass."""
    ok = run_or_merge(paths, shard, report, json_report, work_dir, keep_artifacts, ray, model)
    raise typer.Exit(0 if ok else 1)


def run_or_merge(
    paths: list[str],
    shard: str | None,
    markdown: Path | None,
    json_path: Path | None,
    work_dir: str | None,
    keep_artifacts: bool,
    ray: str | None = None,
    models: list[str] | None = None,
) -> bool:
    """Run (or merge) and write the reports; True when every row passed. ``ray``: run the rows on
    that Ray cluster (``matrix/cluster.py``) rather than one after another here; ``models``: only these
    models' rows."""
    if not paths:
        raise InvalidOptionError("give a matrix file (kvexport matrix MATRIX.toml) or `merge REPORT.json ...`")
    if paths[0] == MERGE:
        if shard or work_dir or keep_artifacts or ray or models:
            raise InvalidOptionError("merge takes only report files, --report and --json")
        return _merge(paths[1:], markdown, json_path)
    if len(paths) > 1:
        raise InvalidOptionError(f"one matrix file at a time, got {len(paths)}: {' '.join(paths)}")
    return _run(Path(paths[0]), shard, markdown, json_path, work_dir, keep_artifacts, ray, models)


def _run(path: Path, shard, markdown, json_path, work_dir, keep_artifacts, ray, models) -> bool:
    matrix = load_matrix(path)
    index, count = parse_shard(shard) if shard else (1, 1)
    rows = shard_rows(matrix.rows, index, count)
    if models:
        unknown = [m for m in models if m not in {row.model for row in matrix.rows}]
        if unknown:
            raise InvalidOptionError(f"--model {unknown[0]}: {path} has no row of that model; its models: "
                                     f"{', '.join(dict.fromkeys(row.model for row in matrix.rows))}")
        rows = [row for row in rows if row.model in models]
    _check_writable(markdown, json_path)
    url = work_dir is not None and "://" in str(work_dir)
    if url and not ray:
        raise InvalidOptionError(f"--work-dir {work_dir}: a URL is for --ray runs; a local run takes a folder")
    if ray:
        from ..matrix.cluster import import_ray

        import_ray()  # refused in one line before any row, where Ray is not installed
    if work_dir is not None and not url:
        check_writable(Path(work_dir), "--work-dir", kind="in")
    temporary = work_dir is None
    work_dir = str(work_dir) if url else Path(tempfile.mkdtemp(prefix="kvexport-matrix-")) if temporary else Path(work_dir)
    if not url:
        work_dir.mkdir(parents=True, exist_ok=True)
    where = f" on the Ray cluster at {ray}" if ray else ""
    only = f", models {', '.join(models)}" if models else ""
    _say(f"{path}: {len(rows)} of {len(matrix.rows)} rows (shard {index}/{count}{only}){where}; row logs in {work_dir}")
    started, done = set(), []

    def on_start(row, node=None):  # node: where a Ray run's row started (again, after its node died)
        started.add(row.index)
        on = f" on {reports.node_label(node)}" + (f" (attempt {node['attempts']})" if node["attempts"] > 1 else "") if node else ""
        _say(f"[{len(started)}/{len(rows)}] {_row_name(row.to_dict())}{on} ...")

    def on_done(result):
        done.append(result)
        _say(f"    {_row_name(result) + ': ' if ray else ''}{_row_line(result)}")
        if json_path:  # the report so far: a run that dies keeps its finished rows (merge lists the rest)
            reports.write_json(reports.new_report(matrix, (index, count), sorted(done, key=lambda r: r["index"])), json_path)

    try:
        if ray:
            results = run_rows_on_ray(rows, str(work_dir), keep_artifacts, ray, on_start, on_done, _say)
        else:
            results = run_rows(rows, work_dir, keep_artifacts, on_start, on_done)
    finally:
        if temporary and not keep_artifacts:
            shutil.rmtree(work_dir, ignore_errors=True)
    report = reports.new_report(matrix, (index, count), results)
    _write(report, markdown, json_path)
    return reports.all_passed(report)


def _merge(names: list[str], markdown, json_path) -> bool:
    if not names:
        raise InvalidOptionError("merge needs report files: kvexport matrix merge a.json b.json [--report all.md]")
    _check_writable(markdown, json_path)
    report = reports.merge_reports([reports.read_report(n) for n in names], names)
    _write(report, markdown, json_path)
    return reports.all_passed(report, whole_matrix=True)


def _write(report: dict, markdown, json_path) -> None:
    text = reports.to_markdown(report)
    if json_path:
        reports.write_json(report, json_path)
    if markdown:
        write_text(markdown, text, "--report")
    print(text, end="")
    _say(reports.summary(report))


def _check_writable(markdown, json_path) -> None:
    """Refuse before hours of work, not after, a report that cannot be written."""
    for path, option in ((markdown, "--report"), (json_path, "--json")):
        if path is not None:
            check_writable(path, option)


def _row_name(row: dict) -> str:
    return f"#{row['index']} {row['model']} × {row['target']} {row['dtype']} {row['max_cache_len'] or 'default'}"


def _row_line(result: dict) -> str:
    if result["status"] == "pass":
        checked = f"max |logit diff| {result['max_logit_diff']:.1e}" if result.get("check", True) else "not checked"
        return (
            f"✓ pass: export {result['export_seconds']:.1f}s (peak RSS {result['export_peak_rss_mb']:.0f} MB, "
            f"{result['artifact_mb']:.2f} MB), {checked}, decode {result['decode_tokens_per_s']:.1f} tok/s"
        )
    failure = result["failure"] or {}
    return f"✗ {result['status']} ({failure.get('stage')}): {failure.get('reason')}"


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
