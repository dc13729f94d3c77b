"""``kvexport check``: the artifact against eager transformers, token by token and logit by logit.

Eager ``generate`` drives; at each of its steps the artifact takes the same step on its own
greedy path, and the two logit vectors are compared. The first step where the two greedy choices
differ is the divergence; eager's margin there (its top logit minus its logit for the artifact's
choice) tells a near-tie from a bug. Both sides then stop.
"""

from __future__ import annotations

import json
import statistics
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from ..errors import InvalidOptionError
from .generation import check_fits
from .programs import load_program
from .tokenizer import ArtifactTokenizer

# A quantized artifact is held to top-1 agreement with float eager over teacher-forced steps. Those
# steps never feed an end-of-sequence token: every runner stops there, and what a model writes
# after one it chose is off its training distribution and dense with near-ties (fed SmolLM2's
# EOS at step 29, its 8da4w `.pte` disagreed at 11 later steps, 1 earlier), which measures nothing
# a user's generation sees. The EOS logit still counts in the max |logit difference|.
MIN_QUANTIZED_AGREEMENT = 0.95
QUANTIZED_STEPS = 256

# Max |logit difference| accepted on steps where the tokens agree, by artifact dtype. A correct fp32
# Gemma 3 export differs from eager by ~0.02 (fp32 reordering over 18 layers and a 262k vocabulary);
# one that drops the sliding window differs by ~25 past it, so 0.05 still tells them apart.
LOGIT_TOLERANCE = {"float32": 5e-2, "float16": 0.5, "bfloat16": 2.0}

_SHORT_PROMPT = "The capital of France is"
_LONG_PARAGRAPH = (
    "Sliding-window attention keeps only the most recent tokens of each layer in view. "
    "A model that mixes such layers with full attention must still attend correctly once "
    "the text grows longer than the window, which is where many exporters go wrong. "
)


@dataclass
class PromptReport:
    prompt: str
    prompt_tokens: int
    new_tokens: int
    match: bool = True
    compared_steps: int = 0
    first_divergence: int | None = None
    eager_token: int | None = None
    artifact_token: int | None = None
    eager_margin: float | None = None  # eager logit of its choice minus its logit of the artifact's choice
    near_tie: bool | None = None
    max_logit_diff: float = 0.0
    suppressed_tokens: list[int] = field(default_factory=list)  # never fed, never counted as a top-1 choice
    agreed_steps: int = 0
    top1_agreement: float = 1.0  # steps where the artifact's top token is eager's, over compared steps
    # Teacher-forced: eager's margin (as eager_margin) at every step where the top tokens differ. Small
    # margins next to max_logit_diff mean near-ties, which any rounding may flip.
    disagreement_margins: list[float] = field(default_factory=list)
    logit_diff_per_step: list[float] = field(default_factory=list)
    eager_ids: list[int] = field(default_factory=list)
    artifact_ids: list[int] = field(default_factory=list)


@dataclass
class CheckReport:
    folder: str
    target: str
    dtype: str
    device: str
    logit_tolerance: float
    prompts: list[PromptReport]
    # "exact": identical tokens, logits within tolerance. "agreement" (quantized artifacts): eager's
    # tokens fed to both, top-1 agreement of at least min_agreement at every prompt.
    mode: str = "exact"
    min_agreement: float = 1.0

    @property
    def ok(self) -> bool:
        if self.mode == "agreement":
            return all(p.top1_agreement >= self.min_agreement for p in self.prompts)
        return all(p.match and p.max_logit_diff <= self.logit_tolerance for p in self.prompts)

    def to_dict(self) -> dict:
        return {**asdict(self), "ok": self.ok}


def smallest_window(manifest: dict) -> int | None:
    windows = [layer["window"] for layer in manifest["layers"] if layer["cache"] == "ring"]
    return min(windows) if windows else None


def default_prompts(manifest: dict, tokenizer: ArtifactTokenizer, new_tokens: int | None = None) -> list[tuple[str, int]]:
    """(prompt, new tokens): a short prompt whose generation runs past the window, and a prompt
    longer than the window (or half the cache, for models without one). ``new_tokens`` sets the
    short prompt's generation length instead (it is still capped by the cache)."""
    max_len = manifest["max_cache_len"]
    window = smallest_window(manifest)
    short_len = len(tokenizer.encode(_SHORT_PROMPT))
    wanted = new_tokens or ((window + 64) if window else 64)
    prompts = [(_SHORT_PROMPT, max(1, min(wanted, max_len - short_len + 1)))]
    target_len = min((window + window // 2) if window else max_len // 2, max_len - 32)
    words = (_LONG_PARAGRAPH * (1 + target_len // 8)).split()
    long_text = ""
    for word in words:  # grow word by word until the prompt has target_len tokens
        if len(tokenizer.encode(long_text)) >= target_len:
            break
        long_text = f"{long_text} {word}" if long_text else word
    if long_text and len(tokenizer.encode(long_text)) <= max_len - 1:
        n = len(tokenizer.encode(long_text))
        prompts.append((long_text, max(1, min(32, max_len - n + 1))))
    return prompts


def load_reference(manifest: dict, model_name: str | None, device: str):
    """The eager transformers model the artifact was exported from (or ``model_name``)."""
    import torch

    from ..models import sources

    if device == "cuda" and not torch.cuda.is_available():
        raise InvalidOptionError("--device cuda: no CUDA GPU is available here (torch.cuda.is_available() is False)")
    source = sources.resolve(model_name or _recorded_source(manifest))
    model, _ = sources.load_model(source, sources.DTYPES[manifest["dtype"]])
    return model.to(device)


def _recorded_source(manifest: dict) -> str:
    recorded = manifest["source"]
    if recorded["kind"] in ("folder", "gguf") and recorded.get("path") and Path(recorded["path"]).exists():
        return recorded["path"]
    return recorded["name"]


def check_prompt(
    program,
    model,
    prompt_ids: list[int],
    max_new_tokens: int,
    tolerance: float,
    teacher_forcing: bool = False,
    suppress: list[int] | None = None,
) -> PromptReport:
    """Step the artifact beside eager ``generate``.

    Free-running (the default), the artifact feeds back its own choices and the comparison stops at
    the first divergence. With ``teacher_forcing`` (quantized artifacts, which are not expected to
    be exact), the artifact is fed eager's tokens at every step, and every step counts towards the
    top-1 agreement. Neither side's top-1 choice is ever one of ``suppress`` (eager never generates
    one); their logits are still compared.
    """
    from .eager import greedy_generate

    check_fits(len(prompt_ids), max_new_tokens, program.manifest["max_cache_len"])
    report = PromptReport(prompt="", prompt_tokens=len(prompt_ids), new_tokens=max_new_tokens,
                          suppressed_tokens=list(suppress or []))

    def top(logits: np.ndarray) -> int:
        if not report.suppressed_tokens:
            return int(np.argmax(logits))
        allowed = logits.copy()
        allowed[report.suppressed_tokens] = -np.inf
        return int(np.argmax(allowed))

    state = {"pos": len(prompt_ids), "previous": None}

    def on_eager_logits(step: int, eager: np.ndarray) -> None:
        if not report.match and not teacher_forcing:
            return
        if step == 0:
            logits = program.forward(list(prompt_ids), 0)
        else:
            logits = program.forward([state["previous"]], state["pos"])
            state["pos"] += 1
        diff = float(np.max(np.abs(logits - eager)))
        report.logit_diff_per_step.append(diff)
        report.compared_steps += 1
        mine, theirs = top(logits), top(eager)
        report.artifact_ids.append(mine)
        report.agreed_steps += mine == theirs
        state["previous"] = theirs if teacher_forcing else mine
        if mine != theirs and teacher_forcing:
            report.disagreement_margins.append(float(eager[theirs] - eager[mine]))
        if mine != theirs and report.match:
            report.match = False
            report.first_divergence = step
            report.eager_token, report.artifact_token = theirs, mine
            report.eager_margin = float(eager[theirs] - eager[mine])
            report.near_tie = report.eager_margin <= 2 * tolerance
        if report.match or teacher_forcing:
            report.max_logit_diff = max(report.max_logit_diff, diff)

    stop = None if teacher_forcing else (lambda: not report.match)
    report.eager_ids = greedy_generate(model, prompt_ids, max_new_tokens, on_eager_logits, stop=stop,
                                       suppress=report.suppressed_tokens)
    report.top1_agreement = report.agreed_steps / max(report.compared_steps, 1)
    return report


def run_check(
    folder: Path,
    prompts: list[tuple[str, int]] | None = None,
    device: str = "cpu",
    model_name: str | None = None,
    on_prompt=None,
) -> CheckReport:
    from ..exporter.artifact import read_manifest

    manifest = read_manifest(folder)
    tokenizer = ArtifactTokenizer(folder)
    quantized = bool(manifest.get("quantization"))
    prompts = prompts or default_prompts(manifest, tokenizer, QUANTIZED_STEPS if quantized else None)
    encoded = [(text, tokenizer.encode(text), n) for text, n in prompts]
    for _, ids, n in encoded:  # refuse before loading anything heavy
        check_fits(len(ids), n, manifest["max_cache_len"])
    # ExecuTorch runs on the CPU whatever --device says; --device places the eager reference (and ONNX).
    program = load_program(folder, manifest, device if manifest["target"] == "onnx" else "cpu")
    model = load_reference(manifest, model_name, device)
    tolerance = LOGIT_TOLERANCE[manifest["dtype"]]
    reports = []
    for text, ids, n in encoded:
        report = check_prompt(program, model, ids, n, tolerance, teacher_forcing=quantized,
                              suppress=manifest.get("eos_token_ids") if quantized else None)
        report.prompt = text
        reports.append(report)
        if on_prompt:
            on_prompt(report)
    mode, min_agreement = ("agreement", MIN_QUANTIZED_AGREEMENT) if quantized else ("exact", 1.0)
    return CheckReport(str(folder), manifest["target"], manifest["dtype"], device, tolerance, reports, mode, min_agreement)


def _scheme(quantization: dict) -> str:
    embedding = quantization.get("embedding", {}).get("weights")
    scheme = quantization.get("scheme") or "float linear layers"
    if quantization.get("lm_head", {}).get("weights") == "int4":
        scheme += ", int4 lm_head"
    return f"{scheme}, {embedding} embedding" if embedding and quantization.get("scheme") != "int4" else scheme


def _summary_line(report: PromptReport, tolerance: float, min_agreement: float | None = None) -> str:
    head = f"{report.prompt[:40]!r}{'...' if len(report.prompt) > 40 else ''} ({report.prompt_tokens} prompt tokens)"
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
        return line
    if report.match:
        status = "ok" if report.max_logit_diff <= tolerance else f"logits off by more than {tolerance}"
        return (
            f"{'✓' if status == 'ok' else '✗'} {head}: {report.new_tokens}/{report.new_tokens} tokens identical, "
            f"max |logit diff| {report.max_logit_diff:.2e} ({status})"
        )
    kind = "near-tie" if report.near_tie else "mismatch"
    return (
        f"✗ {head}: tokens diverge at new token {report.first_divergence} ({kind}): eager {report.eager_token}, "
        f"artifact {report.artifact_token}, eager margin {report.eager_margin:.3g}; "
        f"max |logit diff| before it {report.max_logit_diff:.2e}"
    )


def check_command(folder, prompts, max_new_tokens, device, model_name, as_json) -> bool:
    from ..exporter.artifact import read_manifest

    folder = Path(folder)
    manifest = read_manifest(folder)
    # Checked on the text: "" encodes to a lone BOS for many tokenizers, which is no prompt at all.
    if prompts and not all(prompts):
        raise InvalidOptionError("a --prompt is empty; give some text")
    tokenizer = ArtifactTokenizer(folder)
    quantized = manifest.get("quantization")
    defaults = default_prompts(manifest, tokenizer, QUANTIZED_STEPS if quantized else None)
    if prompts:
        n = defaults[0][1] if max_new_tokens is None else max_new_tokens
        chosen = [(p, n) for p in prompts]
    elif max_new_tokens is not None:
        chosen = [(p, max_new_tokens) for p, _ in defaults]
    else:
        chosen = None
    for text, n in chosen or []:  # before the header line: a request that cannot fit prints one line only
        check_fits(len(tokenizer.encode(text)), n, manifest["max_cache_len"])
    tolerance = LOGIT_TOLERANCE[manifest["dtype"]]
    min_agreement = MIN_QUANTIZED_AGREEMENT if quantized else None
    if not as_json:
        rule = (
            f"quantized ({_scheme(quantized)}, not token-exact): eager's tokens fed to both, "
            f"top-1 agreement with float eager must be >= {MIN_QUANTIZED_AGREEMENT:.0%} (EOS never fed)"
            if quantized
            else f"tokens must be identical, logits within {tolerance} ({manifest['dtype']} tolerance)"
        )
        print(f"checking {folder} ({manifest['target']}, {manifest['dtype']}) against eager transformers on {device}; {rule}", file=sys.stderr)
    report = run_check(
        folder,
        chosen,
        device,
        model_name,
        on_prompt=None if as_json else lambda r: print(_summary_line(r, tolerance, min_agreement)),
    )
    if as_json:
        print(json.dumps(report.to_dict()))
    else:
        print("PASS" if report.ok else "FAIL")
    return report.ok
