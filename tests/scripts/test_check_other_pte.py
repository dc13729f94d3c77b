"""scripts/check_other_pte.py: another exporter's .pte held to kvexport check's teacher-forced steps."""

from __future__ import annotations

import shutil

import pytest

from kvexport.checker.check import run_check

from tests.helpers import TINY_8DA4W, load_script


@TINY_8DA4W
def test_a_pte_measured_as_another_exporters_agrees_as_kvexport_check_finds(artifact, tmp_path):
    """Our own 8da4w .pte, copied out of its artifact and driven as a bare program, gets the
    agreement and logit differences that `kvexport check` reports for it."""
    folder = artifact("tiny-gemma3", "executorch", "8da4w", "int8")
    for name in ("model.pte", "model.ptd"):
        shutil.copy(folder / name, tmp_path / name)
    rows = load_script("check_other_pte").measure(folder, tmp_path / "model.pte")
    reports = run_check(folder).prompts
    assert [r["steps"] for r in rows] == [r.compared_steps for r in reports] and len(rows) == 2
    for row, report in zip(rows, reports):
        assert row["top1_agreement"] == report.top1_agreement
        assert row["max_logit_diff"] == pytest.approx(report.max_logit_diff, abs=1e-5)


def test_a_missing_pte_is_refused(artifact, tmp_path, capsys):
    with pytest.raises(SystemExit):
        load_script("check_other_pte").main([str(artifact("tiny-gemma3")), str(tmp_path / "none.pte")])
    assert "no such file" in capsys.readouterr().err
