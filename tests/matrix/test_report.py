"""Reports: shard reports merge into one, the markdown says what each row found, and the README's
support table is rewritten from a report (and checked against one)."""

from __future__ import annotations

import json

import pytest

from kvexport.errors import InvalidOptionError
from kvexport.matrix import support_table
from kvexport.matrix.report import FORMAT, FORMAT_VERSION, all_passed, merge_reports, missing_rows, to_markdown

from tests.helpers import assert_one_line_error, run_cli


def row(index, model="tiny-llama", target="executorch", status="pass", **extra) -> dict:
    measured = {
        "family": "llama",
        "failure": None,
        "first_divergence": None,
        "max_logit_diff": 2e-4,
        "export_seconds": 40.0,
        "export_peak_rss_mb": 520.0,
        "artifact_mb": 0.4,
        "decode_tokens_per_s": 900.0,
    }
    if status == "error":
        measured = {"family": "llama", "failure": {"stage": "export", "reason": f"target '{target}' is not built"}}
    return {"index": index, "id": f"{index:03d}-{model}-{target}", "model": model, "target": target,
            "dtype": "float32", "max_cache_len": 64, "tiny_config": None, "status": status, **measured, **extra}


def report(rows, shard="1/1", total=4, sha="abc") -> dict:
    return {
        "format": FORMAT, "format_version": FORMAT_VERSION, "matrix": "matrices/tiny.toml", "matrix_sha256": sha,
        "matrix_rows": total, "shards": [shard], "host": {"cpus": 2, "platform": "linux"},
        "versions": {"kvexport": "0.1.0", "torch": "2.13.0", "transformers": "5.23.0", "executorch": "1.5.1",
                     "onnxruntime": "1.31.0", "python": "3.11"},
        "rows": rows,
    }


def test_shards_merge_into_the_whole_matrix():
    a = report([row(0), row(2, target="onnx", status="error")], "1/2")
    b = report([row(3, target="onnx", status="error"), row(1, model="tiny-qwen3")], "2/2")
    merged = merge_reports([b, a], ["b.json", "a.json"])
    assert [r["index"] for r in merged["rows"]] == [0, 1, 2, 3]
    assert merged["shards"] == ["1/2", "2/2"] and missing_rows(merged) == []
    assert not all_passed(merged, whole_matrix=True)  # the onnx rows failed


def test_a_missing_shard_is_reported_and_fails_the_merge():
    merged = merge_reports([report([row(0), row(2)], "1/2")], ["a.json"])
    assert missing_rows(merged) == [1, 3]
    assert all_passed(merged) and not all_passed(merged, whole_matrix=True)
    assert "Missing rows (no shard reported them): 1, 3" in to_markdown(merged)


def test_merge_refuses_reports_of_other_matrices_and_rows_twice():
    with pytest.raises(InvalidOptionError, match="another matrix file"):
        merge_reports([report([row(0)]), report([row(1)], sha="def")], ["a.json", "b.json"])
    with pytest.raises(InvalidOptionError, match="in two of the reports"):
        merge_reports([report([row(0)]), report([row(0)])], ["a.json", "a.json"])


def test_markdown_has_a_line_per_row_and_the_failures_reasons():
    text = to_markdown(report([row(0), row(1, target="onnx", status="error")], total=2))
    lines = text.splitlines()
    assert "2 rows: 1 pass, 0 fail, 1 error" in text
    assert any(l.startswith("| 0 | tiny-llama | llama | executorch | float32 | 64 | ✓ pass | — | 2.0e-04 |  | 40.0 | 520 | 0.40 | 900.0 |") for l in lines)
    assert any(l.startswith("| 1 | tiny-llama | llama | onnx | float32 | 64 | ✗ error |  |") for l in lines)
    assert "- **#1 tiny-llama × onnx** (export): target 'onnx' is not built" in text


def test_an_onnx_row_shows_its_result_in_onnxruntime_genai():
    """The genai check has a column of its own; its failure is listed, and fails the matrix."""
    passed = row(0, target="onnx", genai={"status": "pass", "failure": None, "max_logit_diff": 1e-5})
    failed = row(1, target="onnx", genai={"status": "fail", "failure": {"stage": "genai check", "reason": "tokens diverge"}})
    lines = to_markdown(report([passed, failed], total=2)).splitlines()
    assert any(l.startswith("| 0 | tiny-llama | llama | onnx | float32 | 64 | ✓ pass | — | 2.0e-04 | ✓ pass |") for l in lines)
    assert any(l.startswith("| 1 | tiny-llama | llama | onnx | float32 | 64 | ✓ pass | — | 2.0e-04 | ✗ fail |") for l in lines)
    assert "- **#1 tiny-llama × onnx** (genai check): tokens diverge" in lines
    assert all_passed(report([passed], total=1)) and not all_passed(report([passed, failed], total=2))


def test_a_quantized_row_shows_its_scheme_and_agreement():
    quantized = row(0, target="onnx", quantize="int4", top1_agreement=0.9727, max_logit_diff=1.59)
    embedding = row(1, quantize="8da4w", quantize_embedding="int8", top1_agreement=0.9, status="fail",
                    failure={"stage": "check", "reason": "top-1 agreement 90.0% at prompt 0 is under 95%"})
    lines = to_markdown(report([quantized, embedding], total=2)).splitlines()
    assert any(l.startswith("| 0 | tiny-llama | llama | onnx | float32 · int4 | 64 | ✓ pass | top-1 agreement 97.3% | 1.6e+00 |") for l in lines)
    assert any(l.startswith("| 1 | tiny-llama | llama | executorch | float32 · 8da4w · embedding int8 | 64 | ✗ fail | top-1 agreement 90.0% |") for l in lines)


def test_a_row_without_a_check_says_so_beside_its_measurements():
    unchecked = row(0, model="llama3.1-8b", target="onnx", check=False, export_seconds=848.0, export_peak_rss_mb=4895.0)
    for key in ("first_divergence", "max_logit_diff"):
        del unchecked[key]  # a row without a check has no check's fields
    (line,) = [l for l in to_markdown(report([unchecked], total=1)).splitlines() if l.startswith("| 0 |")]
    assert line == "| 0 | llama3.1-8b | llama | onnx | float32 | 64 | ✓ pass | – not checked |  |  | 848.0 | 4895 | 0.40 | 900.0 |"


def test_merge_command_writes_both_reports_and_exits_1_on_a_failed_row(tmp_path, capsys):
    (tmp_path / "a.json").write_text(json.dumps(report([row(0), row(2, target="onnx", status="error")], "1/2")))
    (tmp_path / "b.json").write_text(json.dumps(report([row(1), row(3)], "2/2")))
    code, out, err = run_cli(capsys, "matrix", "merge", tmp_path / "a.json", tmp_path / "b.json",
                             "--report", tmp_path / "all.md", "--json", tmp_path / "all.json")
    assert code == 1, err
    merged = json.loads((tmp_path / "all.json").read_text())
    assert [r["index"] for r in merged["rows"]] == [0, 1, 2, 3]
    assert (tmp_path / "all.md").read_text() == out


@pytest.mark.parametrize("content, phrase", [(None, "not found"), ("{", "not a JSON matrix report"), ("{}", "not a kvexport matrix report")])
def test_merge_mistakes_get_one_line(tmp_path, capsys, content, phrase):
    if content is not None:
        (tmp_path / "a.json").write_text(content)
    code, _, err = run_cli(capsys, "matrix", "merge", tmp_path / "a.json")
    assert_one_line_error(code, err, phrase)


def test_support_table_rewrites_only_the_marked_section(tmp_path):
    rows = [
        row(0, family="gemma3_text", model="tiny-gemma3"),
        row(1, family="gemma3_text", model="tiny-gemma3", target="onnx", status="error"),
        row(2, model="tiny-cohere2", family="cohere2", tiny_config={"model_type": "cohere2", "overrides": {}}),
        row(3, model="tiny-cohere2", family="cohere2", target="onnx", status="error"),
    ]
    section = support_table.render(report(rows))
    assert "| family | model | ExecuTorch | ONNX |" in section
    assert "| cohere2 | `tiny-cohere2` (config in the matrix file, no kvexport code) | ✓ | ✗ error in export: target 'onnx' is not built |" in section
    assert "| gemma3_text | `tiny-gemma3` | ✓ | ✗ error in export: target 'onnx' is not built |" in section
    readme = f"# Title\n\nbefore\n{support_table.START}\nold table\n{support_table.END}\nafter\n"
    rewritten = support_table.rewrite(readme, section)
    assert rewritten == f"# Title\n\nbefore\n{support_table.START}\n{section}\n{support_table.END}\nafter\n"
    assert support_table.rewrite(rewritten, section) == rewritten


def test_support_table_has_a_column_per_target_and_dtype_when_the_matrix_has_two_dtypes():
    rows = [row(0), row(1, target="onnx"), row(2, dtype="float16"),
            row(3, target="onnx", dtype="float16", status="fail", failure={"stage": "check", "reason": "tokens diverge"})]
    section = support_table.render(report(rows))
    assert "| family | model | ExecuTorch float32 | ONNX float32 | ExecuTorch float16 | ONNX float16 |" in section
    assert "| llama | `tiny-llama` | ✓ | ✓ | ✓ | ✗ fail in check: tokens diverge |" in section


def test_support_table_has_a_column_for_onnxruntime_genai():
    rows = [row(0), row(1, target="onnx", genai={"status": "pass", "failure": None}),
            row(2, model="tiny-gpt-oss", family="gpt_oss"),
            row(3, model="tiny-gpt-oss", family="gpt_oss", target="onnx",
                genai={"status": "error", "failure": {"stage": "genai", "reason": "genai cannot load it"}})]
    section = support_table.render(report(rows))
    assert "| family | model | ExecuTorch | ONNX | ONNX in genai |" in section
    assert "| llama | `tiny-llama` | ✓ | ✓ | ✓ |" in section
    assert "| gpt_oss | `tiny-gpt-oss` | ✓ | ✓ | ✗ error in genai: genai cannot load it |" in section


def test_support_table_check_fails_when_the_readme_says_otherwise(tmp_path, capsys):
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{support_table.START}\n{support_table.END}\n")
    (tmp_path / "r.json").write_text(json.dumps(report([row(0)], total=1)))
    args = [str(tmp_path / "r.json"), "--readme", str(readme)]
    assert support_table.main([*args, "--check"]) == 1
    assert support_table.main(args) == 0  # rewrite
    assert "| llama | `tiny-llama` | ✓ |" in readme.read_text()
    assert support_table.main([*args, "--check"]) == 0
