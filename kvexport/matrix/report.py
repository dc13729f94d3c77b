"""The matrix report: JSON (what tools read, what shards merge) and markdown (what people read).

A report names its matrix file and that file's sha256, how many rows the whole matrix has and
which shards it covers, so a merge refuses reports of different matrices and says which rows no
shard reported.
"""

from __future__ import annotations

import json
import os
import platform
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from ..errors import InvalidOptionError
from ..outputs import write_text
from ..version import __version__
from .spec import Matrix

FORMAT = "kvexport-matrix-report"
FORMAT_VERSION = 1
STATUS_MARK = {"pass": "✓ pass", "fail": "✗ fail", "error": "✗ error"}
# A row's check in onnxruntime-genai may also not apply: the export said genai cannot run the folder.
GENAI_MARK = {**STATUS_MARK, "unsupported": "– unsupported"}


def new_report(matrix: Matrix, shard: tuple[int, int], rows: list[dict]) -> dict:
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "matrix": str(matrix.path),
        "matrix_sha256": matrix.sha256,
        "matrix_rows": len(matrix.rows),
        "shards": [f"{shard[0]}/{shard[1]}"],
        "versions": _versions(),
        "host": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "rows": rows,
    }


def _versions() -> dict:
    versions = {"kvexport": __version__, "python": platform.python_version()}
    for name in ("torch", "transformers", "executorch", "onnxruntime"):
        try:
            versions[name] = version(name)
        except PackageNotFoundError:
            versions[name] = None
    return versions


def missing_rows(report: dict) -> list[int]:
    """Indices of the matrix's rows that no shard in this report ran."""
    present = {row["index"] for row in report["rows"]}
    return [i for i in range(report["matrix_rows"]) if i not in present]


def _genai_passed(row: dict) -> bool:
    """The row's check in onnxruntime-genai passed, or there was none (not an ONNX row, or one that
    genai cannot run, as its export said)."""
    return row.get("genai", {}).get("status", "pass") in ("pass", "unsupported")


def all_passed(report: dict, whole_matrix: bool = False) -> bool:
    """Every row passed, in onnxruntime-genai too where it ran there (and, for ``whole_matrix``,
    every row of the matrix is there)."""
    passed = all(row["status"] == "pass" and _genai_passed(row) for row in report["rows"])
    return passed and not (whole_matrix and missing_rows(report))


def read_report(path: Path | str) -> dict:
    path = Path(path)
    try:
        report = json.loads(path.read_text())
    except FileNotFoundError:
        raise InvalidOptionError(f"report {path} not found")
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InvalidOptionError(f"{path} is not a JSON matrix report ({e})")
    if not isinstance(report, dict) or report.get("format") != FORMAT:
        raise InvalidOptionError(f"{path} is not a kvexport matrix report (written by `kvexport matrix --json`)")
    if report.get("format_version") != FORMAT_VERSION:
        raise InvalidOptionError(f"{path} has report format {report.get('format_version')}, this kvexport reads {FORMAT_VERSION}")
    return report


def merge_reports(reports: list[dict], names: list[str]) -> dict:
    """One report from shard reports of the same matrix file; a row reported twice is refused."""
    if not reports:
        raise InvalidOptionError("merge needs at least one report")
    first = reports[0]
    rows: dict[int, dict] = {}
    for report, name in zip(reports, names):
        if report["matrix_sha256"] != first["matrix_sha256"]:
            raise InvalidOptionError(f"{name} comes from another matrix file than {names[0]} (sha256 differs)")
        for row in report["rows"]:
            if row["index"] in rows:
                raise InvalidOptionError(f"row {row['id']} is in two of the reports (the same shard twice?)")
            rows[row["index"]] = row
    shards = sorted({s for r in reports for s in r["shards"]}, key=lambda s: tuple(int(x) for x in s.split("/")))
    return {**first, "shards": shards, "rows": [rows[i] for i in sorted(rows)]}


def write_json(report: dict, path: Path) -> None:
    write_text(path, json.dumps(report, indent=2) + "\n", "--json")


def summary(report: dict) -> str:
    counts = {status: sum(r["status"] == status for r in report["rows"]) for status in STATUS_MARK}
    text = f"{len(report['rows'])} rows: " + ", ".join(f"{n} {status}" for status, n in counts.items())
    missing = missing_rows(report)
    return text + (f"; {len(missing)} of the matrix's {report['matrix_rows']} rows missing" if missing else "")


def to_markdown(report: dict) -> str:
    v = report["versions"]
    lines = [
        f"# kvexport matrix: `{report['matrix']}`",
        "",
        f"{summary(report)} (shards {', '.join(report['shards'])}). kvexport {v['kvexport']}, torch {v['torch']}, "
        f"transformers {v['transformers']}, executorch {v['executorch']}, onnxruntime {v['onnxruntime']}; "
        f"{report['host']['cpus']} CPUs.",
        "",
        "| # | model | family | target | dtype | max_cache_len | status | tokens vs eager | max \\|logit diff\\| "
        "| in genai | export s | export peak RSS MB | artifact MB | decode tok/s |",
        "|---:|---|---|---|---|---:|---|---|---:|---|---:|---:|---:|---:|",
    ]
    for row in report["rows"]:
        cells = [
            row["index"],
            row["model"],
            row.get("family") or "",
            row["target"],
            " · ".join(q for q in (row["dtype"], row.get("quantize"), row.get("quantize_embedding") and f"embedding {row['quantize_embedding']}",
                                   row.get("quantize_lm_head") and f"lm_head {row['quantize_lm_head']}",
                                   row.get("quantize_grid") and f"{row['quantize_grid']} grid",
                                   row.get("kv_cache") and f"KV {row['kv_cache']}") if q),
            row.get("max_cache_len") or "default",
            STATUS_MARK[row["status"]],
            # Blank where the check never ran (the row failed before it); a quantized row's agreement.
            "– not checked" if row.get("check") is False else _agreement_or_divergence(row) if "max_logit_diff" in row else "",
            _number(row.get("max_logit_diff"), ".1e") if "max_logit_diff" in row else "",
            GENAI_MARK[row["genai"]["status"]] if "genai" in row else "",
            _number(row.get("export_seconds"), ".1f"),
            _number(row.get("export_peak_rss_mb"), ".0f"),
            _number(row.get("artifact_mb"), ".2f"),
            _number(row.get("decode_tokens_per_s"), ".1f"),
        ]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    failures = [(row, row["failure"]) for row in report["rows"] if row["status"] != "pass"]
    failures += [(row, row["genai"]["failure"]) for row in report["rows"] if not _genai_passed(row)]
    if failures:
        lines += ["", "## Failures", ""]
        for row, failure in failures:
            failure = failure or {}
            lines.append(f"- **#{row['index']} {row['model']} × {row['target']}** ({failure.get('stage')}): {failure.get('reason')}")
    missing = missing_rows(report)
    if missing:
        lines += ["", f"Missing rows (no shard reported them): {', '.join(str(i) for i in missing)}"]
    lines += _where_rows_ran(report["rows"])
    return "\n".join(lines) + "\n"


def _where_rows_ran(rows: list[dict]) -> list[str]:
    """For rows run on a Ray cluster: each node's rows (a row that took several attempts says so)."""
    nodes: dict[str, list[str]] = {}
    for row in rows:
        node = row.get("ran_on")
        if node:
            again = f" (attempt {node['attempts']})" if node["attempts"] > 1 else ""
            nodes.setdefault(node_label(node), []).append(f"#{row['index']}{again}")
    if not nodes:
        return []
    return ["", "## Where rows ran", "", *(f"- {node}: {', '.join(indices)}" for node, indices in sorted(nodes.items()))]


def node_label(node: dict) -> str:
    """A Ray node as people read it: its host and the start of its node id (nodes may share a host)."""
    return f"{node['host']} ({node['node_id'][:8]})"


def _agreement_or_divergence(row: dict) -> str:
    if "top1_agreement" in row:
        return f"top-1 agreement {row['top1_agreement']:.1%}"
    return _divergence(row.get("first_divergence"))


def _divergence(d: dict | None) -> str:
    if not d:
        return "—"
    kind = "near-tie" if d["near_tie"] else "mismatch"
    return f"prompt {d['prompt']}, token {d['step']} ({kind})"


def _number(value, spec: str) -> str:
    return "" if value is None else format(value, spec)
