"""``kvexport check``: the rule the artifact is held to, a line per prompt as it is checked, PASS or
FAIL (or the report as JSON). The check itself is ``kvexport.checker.check``'s."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer

from .options import GENAI_RUNNER_HELP, DraftTokens, JsonFlag, check_runner

if TYPE_CHECKING:
    from ..artifact.manifest import Manifest
    from ..checker.check import PromptReport


def check_command(
    folder: Annotated[Path, typer.Argument(help="artifact folder")],
    prompt: Annotated[Optional[list[str]], typer.Option("--prompt", "-p", help="prompt (repeatable)")] = None,
    max_new_tokens: Annotated[
        Optional[int], typer.Option(help="new tokens per prompt [default: past the sliding window]")
    ] = None,
    device: Annotated[str, typer.Option(help="where eager transformers runs: cpu or cuda")] = "cpu",
    model: Annotated[
        Optional[str], typer.Option("--model", help="eager reference: any export MODEL, a hub id downloaded if not cached [default: the model the artifact came from; a hub model at its recorded commit]")
    ] = None,
    runner: Annotated[str, typer.Option(metavar="kvexport|genai", help=GENAI_RUNNER_HELP)] = "kvexport",
    baseline: Annotated[
        Optional[Path], typer.Option(help="int8 KV cache: the same export with --kv-cache float, fed the same tokens, to tell the cache's error from the weights'")
    ] = None,
    draft: Annotated[
        Optional[str], typer.Option(metavar="ngram|ARTIFACT", help="generate speculatively, drafting with prompt lookup (ngram) or another artifact; the tokens must still be eager's (an artifact exported with --max-draft-tokens)")
    ] = None,
    draft_tokens: DraftTokens = None,
    min_agreement: Annotated[
        Optional[float], typer.Option(metavar="FRACTION", help="a quantized artifact: the top-1 agreement with float eager it must reach at every prompt, e.g. 0.8 for --quantize-grid symmetric [default: 0.95]")
    ] = None,
    as_json: JsonFlag = False,
):
    """Compare the artifact with eager transformers' greedy generation; exit 0 only if all match."""
    check_runner(runner)
    ok = check_and_report(folder, prompt, max_new_tokens, device, model, as_json, runner, baseline, draft, draft_tokens,
                          min_agreement)
    raise typer.Exit(0 if ok else 1)


def check_and_report(folder, prompts, max_new_tokens, device, model_name, as_json, runner: str = "kvexport",
                     baseline: Path | None = None, draft: str | None = None, draft_tokens: int | None = None,
                     min_agreement: float | None = None) -> bool:
    """Run the check, printing what it holds the artifact to and a line per prompt as it goes (or,
    with ``as_json``, the whole report at the end). True if it passed."""
    from ..artifact.manifest import read_manifest
    from ..checker.check import (
        approximate, check_baseline, check_min_agreement, choose_prompts, computes_float16_in_float16,
        logit_tolerance, run_check,
    )
    from ..runtime.tokenizer import ArtifactTokenizer

    folder = Path(folder)
    # The header's facts only: run_check reads both manifests again and verifies every file's sha256
    # (once) before anything loads.
    manifest = read_manifest(folder, verify=False)
    if baseline is not None:  # before anything loads
        check_baseline(manifest, read_manifest(baseline, verify=False), baseline)
    bar = check_min_agreement(manifest, min_agreement)
    tokenizer = ArtifactTokenizer(folder)
    quantized = approximate(manifest)
    chosen = choose_prompts(manifest, tokenizer, prompts, max_new_tokens)
    tolerance = logit_tolerance(manifest)
    if not as_json:
        rule = (
            f"quantized ({scheme_text(manifest)}, not token-exact): eager's tokens fed to both, "
            f"top-1 agreement with float eager must be >= {bar:.0%} (EOS never fed)"
            if quantized
            else f"tokens must be identical, logits within {tolerance} ("
            + ("bfloat16's tolerance: XNNPACK computes float16 in float16 on this CPU" if computes_float16_in_float16(manifest)
               else f"{manifest.dtype} tolerance") + ")"
            + ("; a step beyond it or with another token is judged against float32 eager, net of eager's own rounding"
               if manifest.dtype != "float32" else "")
        )
        ran_by = " in onnxruntime-genai" if runner == "genai" else ""
        if baseline is not None:
            rule += f"; {baseline} (float KV cache) fed the same tokens beside it"
        if draft is not None:
            rule += f"; generating speculatively, drafts from {draft}"
        print(f"checking {folder} ({manifest.target}, {manifest.dtype}){ran_by} against eager transformers on {device}; {rule}", file=sys.stderr)
    report = run_check(
        folder,
        chosen,
        device,
        model_name,
        on_prompt=None if as_json else lambda r: print(summary_line(r, tolerance, bar if quantized else None)),
        runner=runner,
        baseline=baseline,
        draft=draft,
        draft_tokens=draft_tokens,
        min_agreement=min_agreement,
    )
    if as_json:
        print(json.dumps(report.to_dict()))
    else:
        if report.one_at_a_time:
            print("(eager ran first and was let go before the artifact loaded: this machine's memory holds one "
                  "of them at a time)", file=sys.stderr)
        print("PASS" if report.ok else "FAIL")
    return report.ok


def scheme_text(manifest: Manifest) -> str:
    parts = []
    if quantization := manifest.quantization:
        embedding = quantization.get("embedding", {}).get("weights")
        scheme = quantization.get("scheme") or "float linear layers"
        if quantization.get("grid") == "symmetric":
            scheme += ", symmetric int4"
        if quantization.get("lm_head", {}).get("weights") == "int4":
            scheme += ", int4 lm_head"
        parts.append(f"{scheme}, {embedding} embedding" if embedding and quantization.get("scheme") != "int4" else scheme)
    if kv_cache := manifest.kv_cache:
        parts.append(f"{kv_cache['dtype']} KV cache")
    return ", ".join(parts)


def summary_line(report: PromptReport, tolerance: float, min_agreement: float | None = None) -> str:
    head = f"{report.prompt[:40]!r}{'...' if len(report.prompt) > 40 else ''} ({report.prompt_tokens} prompt tokens)"
    if report.float16_eager_overflow_at is not None:
        head += f", against float32 eager (eager float16's logits overflowed at new token {report.float16_eager_overflow_at})"
    if report.eager_not_finite_at is not None:
        return f"✗ {head}: eager's logits are not finite at new token {report.eager_not_finite_at}; nothing to compare with"
    if min_agreement is not None:
        ok = report.top1_agreement >= min_agreement
        line = (
            f"{'✓' if ok else '✗'} {head}: top-1 agreement {report.top1_agreement:.1%} over {report.compared_steps} "
            f"teacher-forced steps (needs {min_agreement:.0%}), max |logit diff| {report.max_logit_diff:.3g}"
        )
        if report.disagreement_margins:
            margins = report.disagreement_margins
            steps = f"{len(margins)} disagreement{'s' if len(margins) > 1 else ''}"
            line += f"; eager's own margin at the {steps}: median {statistics.median(margins):.3g}, max {max(margins):.3g}"
        if report.baseline_top1_agreement is not None:
            line += (f"\n    float-KV baseline: its own agreement with eager {report.baseline_top1_agreement:.1%}; "
                     f"this artifact's with it {report.top1_agreement_with_baseline:.1%}, "
                     f"max |logit diff| {report.max_logit_diff_vs_baseline:.3g}")
        return line
    if report.match:
        ties = report.rounding_ties
        tokens = f"{report.new_tokens}/{report.new_tokens} tokens identical"
        if ties:
            tokens = (f"{report.new_tokens - len(ties)}/{report.new_tokens} tokens identical, {len(ties)} rounding "
                      f"tie{'s' if len(ties) > 1 else ''} (new token {', '.join(map(str, ties))}) fed eager's")
        if report.max_logit_diff <= tolerance:
            status = "ok"
        elif report.logits_ok:
            status = (f"ok: within {tolerance} of float32 eager beyond eager's own rounding at the "
                      f"{report.float32_steps} step{'s' if report.float32_steps > 1 else ''} measured")
        elif report.float32_steps:
            status = (f"{report.max_diff_beyond_rounding:.3g} from float32 eager beyond eager's own rounding, "
                      f"more than {tolerance}")
        else:
            status = f"logits off by more than {tolerance}"
        spec = report.speculation
        drafted = (f"; speculative: {spec['accepted']}/{spec['drafted']} drafted tokens accepted in "
                   f"{spec['verify_calls']} verifications of up to {spec['draft_tokens']}") if spec else ""
        return (
            f"{'✓' if report.logits_ok else '✗'} {head}: {tokens}, "
            f"max |logit diff| {report.max_logit_diff:.2e} ({status}){drafted}"
        )
    kind = "near-tie" if report.near_tie else "mismatch"
    return (
        f"✗ {head}: tokens diverge at new token {report.first_divergence} ({kind}): eager {report.eager_token}, "
        f"artifact {report.artifact_token}, eager margin {report.eager_margin:.3g}; "
        f"max |logit diff| before it {report.max_logit_diff:.2e}"
    )
