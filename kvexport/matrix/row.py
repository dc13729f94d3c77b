"""One matrix row, in a child process of its own: export, check against eager transformers, and a
short run for the decode speed; an ONNX row is checked in onnxruntime-genai too (``genai``).

A process per row gives each row its own peak memory (the export's peak is this process's peak
when the export ends: it has done nothing else yet), and a crash, a hang or an out-of-memory kill
takes down that row only. Run as ``python -m kvexport.matrix.row ROW_DIR``: it reads
``ROW_DIR/row.json`` and writes ``ROW_DIR/result.json``; progress goes to stderr (the row's log).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

from ..artifact.manifest import read_manifest
from ..errors import KvexportError
from .spec import Row

ROW_FILE = "row.json"
RESULT_FILE = "result.json"
ARTIFACT_DIR = "artifact"
RUN_PROMPT = "The capital of France is"
PARENT_ENV = "KVEXPORT_MATRIX_PARENT"  # the id of the process that started the row
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def run_row(row: Row, row_dir: Path) -> dict:
    """The row's measurements and verdict; never raises for a failure of the row itself."""
    result: dict = {"status": "error", "failure": None, "family": None}
    stage = "model"
    try:
        model = _model_argument(row, row_dir)
        result["family"] = _family(model)
        stage = "export"
        result.update(_export(row, model, row_dir / ARTIFACT_DIR))
        check = {"check_ok": True}
        if row.check:
            stage = "check"
            check = _check(row, row_dir / ARTIFACT_DIR)
            result.update(check)
        stage = "run"
        result.update(_decode_speed(row, row_dir / ARTIFACT_DIR))
        if row.target == "onnx" and row.check:
            result["genai"] = _genai_check(row, row_dir / ARTIFACT_DIR)
        result["status"] = "pass" if check["check_ok"] else "fail"
        if not check["check_ok"]:
            result["failure"] = {"stage": "check", "reason": check.pop("check_reason")}
    except KvexportError as e:  # the row's own problem, said in one line
        result["failure"] = {"stage": stage, "reason": str(e)}
    except Exception as e:  # a bug or a limitation underneath: the traceback goes to the row's log
        traceback.print_exc()
        lines = str(e).strip().splitlines()
        result["failure"] = {"stage": stage, "reason": f"{type(e).__name__}: {lines[0] if lines else ''}".rstrip(": ")}
    result.pop("check_ok", None)
    result.pop("check_reason", None)
    return result


def _model_argument(row: Row, row_dir: Path) -> str:
    """What ``kvexport export`` takes for this row: the name, or the folder a ``[models.NAME]``
    model is built into (a real-shape one by a process of its own, so that the export's peak memory
    is the export's alone)."""
    folder = row_dir / "model"
    if row.shape_config is not None:
        _build_real_shape(row.shape_config, folder)
        return str(folder)
    if row.tiny_config is None:
        return row.model
    from ..models import presets

    config = presets.tiny_config(row.tiny_config["model_type"], row.tiny_config["overrides"])
    model, tokenizer = presets.build_tiny(config)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def _build_real_shape(shape_config: dict, folder: Path) -> None:
    from ..models import real_shapes

    command = [sys.executable, "-m", real_shapes.__name__, shape_config["shape"], str(folder), "--streamed",
               "--overrides", json.dumps(shape_config["overrides"])]
    print(f"building {shape_config['shape']} at random weights: {' '.join(command[1:])}", file=sys.stderr, flush=True)
    built = subprocess.run(command, stdin=subprocess.DEVNULL, stdout=sys.stderr, stderr=sys.stderr)
    if built.returncode != 0:
        raise KvexportError(f"building {shape_config['shape']} at random weights failed (status {built.returncode}; "
                            "the row's log has its output)")


def _family(model: str) -> str | None:
    from ..models import architecture, sources

    return architecture.text_config(sources.load_config(sources.resolve(model))).model_type


def _export(row: Row, model: str, folder: Path) -> dict:
    from ..exporter.pipeline import ExportOptions, export_model
    from ..progress import Progress

    start = time.perf_counter()
    options = ExportOptions(model=model, out=folder, force=True, **row.export_options())
    exported = export_model(options, Progress())
    files = [p for p in folder.iterdir() if p.is_file()]
    return {
        "max_cache_len": exported.manifest.max_cache_len,
        "family": exported.manifest.model_type,
        "export_seconds": round(time.perf_counter() - start, 2),
        "export_steps": {step: round(s, 2) for step, s in exported.seconds.items()},
        "export_peak_rss_mb": round(exported.peak_rss_mb, 1),
        "artifact_mb": round(sum(p.stat().st_size for p in files) / 2**20, 3),
        "kv_cache_mb": round(exported.manifest.kv_cache_bytes / 2**20, 3),
    }


def _check(row: Row, folder: Path, runner: str = "kvexport") -> dict:
    from ..checker.check import default_prompts, run_check
    from ..runtime.tokenizer import ArtifactTokenizer

    prompts = None
    if row.check_new_tokens:
        defaults = default_prompts(read_manifest(folder, verify=False), ArtifactTokenizer(folder))
        prompts = [(text, row.check_new_tokens) for text, _ in defaults]
    return check_summary(run_check(folder, prompts, device=row.device, runner=runner))


def _genai_check(row: Row, folder: Path) -> dict:
    """The same check with onnxruntime-genai running the artifact: ``status`` pass or fail (with
    the reason), error where genai could not run it, or unsupported where the export said it cannot."""
    reason = read_manifest(folder, verify=False).genai_unsupported
    if reason:
        return {"status": "unsupported", "failure": {"stage": "genai", "reason": reason}}
    try:
        check = _check(row, folder, runner="genai")
    except Exception as e:  # genai's own refusal or crash: the reason is the column's cell
        lines = str(e).strip().splitlines()
        return {"status": "error", "failure": {"stage": "genai", "reason": lines[0] if lines else type(e).__name__}}
    failure = None if check["check_ok"] else {"stage": "genai check", "reason": check["check_reason"]}
    return {"status": "pass" if check["check_ok"] else "fail", "failure": failure, "max_logit_diff": check["max_logit_diff"]}


def check_summary(report) -> dict:
    """A row's check fields from a ``CheckReport``: the verdict, a one-line reason, the figures."""
    divergence = next(
        (
            {
                "prompt": i,
                "prompt_tokens": p.prompt_tokens,
                "step": p.first_divergence,
                "eager_token": p.eager_token,
                "artifact_token": p.artifact_token,
                "eager_margin": p.eager_margin,
                "near_tie": p.near_tie,
            }
            for i, p in enumerate(report.prompts)
            if not p.match
        ),
        None,
    )
    max_diff = max((p.max_logit_diff for p in report.prompts), default=0.0)
    not_finite = next(((i, p.eager_not_finite_at) for i, p in enumerate(report.prompts) if p.eager_not_finite_at is not None), None)
    if not_finite:
        reason = f"eager's logits are not finite at new token {not_finite[1]} of prompt {not_finite[0]}: nothing to compare with"
        divergence = None
    elif report.mode == "agreement":  # quantized: its tokens may differ; how often its top-1 is eager's counts
        worst = min(range(len(report.prompts)), key=lambda i: report.prompts[i].top1_agreement)
        reason = f"top-1 agreement {report.prompts[worst].top1_agreement:.1%} at prompt {worst} is under {report.min_agreement:.0%}"
        divergence = None
    elif divergence:
        kind = "near-tie" if divergence["near_tie"] else "mismatch"
        reason = (
            f"tokens diverge at new token {divergence['step']} of prompt {divergence['prompt']} ({kind}: eager "
            f"{divergence['eager_token']}, artifact {divergence['artifact_token']}, eager margin {divergence['eager_margin']:.3g})"
        )
    elif any(p.float32_steps for p in report.prompts):  # half precision: judged net of eager's own rounding
        beyond = max(p.max_diff_beyond_rounding for p in report.prompts)
        reason = (f"logits {beyond:.3g} from float32 eager beyond eager {report.dtype}'s own rounding, more than "
                  f"the tolerance {report.logit_tolerance}")
    else:
        reason = f"max |logit diff| {max_diff:.3g} exceeds the {report.dtype} tolerance {report.logit_tolerance}"
    return {
        "check_ok": report.ok,
        "check_reason": reason,
        "first_divergence": divergence,
        "max_logit_diff": max_diff,
        "logit_tolerance": report.logit_tolerance,
        **({"top1_agreement": min(p.top1_agreement for p in report.prompts)} if report.mode == "agreement" else {}),
        "check_prompts": [
            {"prompt_tokens": p.prompt_tokens, "new_tokens": p.new_tokens, "compared_steps": p.compared_steps, "match": p.match,
             "rounding_ties": p.rounding_ties}
            for p in report.prompts
        ],
    }


def _decode_speed(row: Row, folder: Path) -> dict:
    from ..artifact.manifest import read_manifest
    from ..runtime.generation import generate
    from ..runtime.programs import load_program
    from ..runtime.tokenizer import ArtifactTokenizer

    manifest = read_manifest(folder, verify=False)
    prompt_ids = ArtifactTokenizer(folder).encode(RUN_PROMPT)
    new_tokens = max(1, min(row.run_new_tokens, manifest.max_cache_len - len(prompt_ids) + 1))
    result = generate(load_program(folder, manifest, row.device), prompt_ids, new_tokens)  # EOS does not stop it
    return {
        "run_new_tokens": len(result.new_ids),
        "prefill_tokens_per_s": round(result.prefill_tokens_per_s, 1),
        "decode_tokens_per_s": round(result.decode_tokens_per_s, 1),
    }


def die_with_parent() -> None:
    """Have the kernel kill this process when the one that started it dies (Linux's
    ``PR_SET_PDEATHSIG``), so that an interrupted matrix run, or a Ray worker whose node died, leaves
    no row exporting on its own; and exit now if that process is already gone. A no-op elsewhere."""
    parent = os.environ.get(PARENT_ENV)
    if not sys.platform.startswith("linux") or not parent:
        return
    import ctypes
    import signal

    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != int(parent):  # it died before the line above
        sys.exit(1)


def main(argv: list[str] | None = None) -> int:
    from .. import logs

    die_with_parent()
    argv = sys.argv[1:] if argv is None else argv
    row_dir = Path(argv[0])
    logs.quiet()
    row = Row.from_dict(json.loads((row_dir / ROW_FILE).read_text()))
    result = run_row(row, row_dir)
    tmp = row_dir / f".{RESULT_FILE}.tmp"
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    os.replace(tmp, row_dir / RESULT_FILE)  # the parent never reads half a result
    return 0


if __name__ == "__main__":
    sys.exit(main())
