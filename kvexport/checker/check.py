"""``kvexport check``: the artifact against eager transformers, token by token and logit by logit.

Eager ``generate`` drives; at each of its steps the artifact takes the same step on its own
greedy path, and the two logit vectors are compared. The first step where the two greedy choices
differ is the divergence; eager's margin there (its top logit minus its logit for the artifact's
choice) tells a near-tie from a bug. Both sides then stop.

With a drafter (``--draft``), the artifact's steps are those of its speculative generation
(``SpeculativeSteps``): each new token and the logits it was chosen from, compared the same way.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from ..artifact.manifest import Manifest
from ..errors import InvalidOptionError, PromptTooLongError
from ..models.architecture import text_config
from ..runtime.cpu import xnnpack_sums_float16_in_float16
from ..runtime.generation import check_fits
from ..runtime.programs import load_program
from ..runtime.tokenizer import ArtifactTokenizer

# A quantized artifact is held to top-1 agreement with float eager over teacher-forced steps that
# never feed an end-of-sequence token: every runner stops there, and what a model writes after one
# is off its training distribution and dense with near-ties no user's generation sees
# (docs/check.md). The EOS logit still counts in the max |logit difference|.
MIN_QUANTIZED_AGREEMENT = 0.95
QUANTIZED_STEPS = 256

# Max |logit difference| accepted on steps where the tokens agree, by artifact dtype: above float
# reordering noise, far below what an export that drops the sliding window gives (docs/check.md).
LOGIT_TOLERANCE = {"float32": 5e-2, "float16": 0.5, "bfloat16": 2.0}

# Half precision: eager float16 is itself off float32 eager, so a step whose logits are beyond the
# tolerance or whose token differs is judged against float32 eager (the same tokens). It passes if
# the artifact is within the tolerance of float32 eager beyond eager's own error there; a token
# difference is a rounding tie if float32 eager's margin between the two tokens is within that
# bound, and eager's token is then fed to both (docs/check.md).

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
    logits_ok: bool = True  # every compared step within the tolerance, or (half precision) within eager's own rounding
    # Half precision: steps judged against float32 eager, the most any of them was beyond eager's own
    # error there (|artifact - fp32| - |eager - fp32|), and the steps where a rounding tie was taken.
    float32_steps: int = 0
    max_diff_beyond_rounding: float = 0.0
    rounding_ties: list[int] = field(default_factory=list)
    # The step where eager's logits were not finite (nothing to compare with), and for a float16
    # artifact, the step where eager float16's were (Gemma 3's residual stream passes 65,504), after
    # which the prompt was compared with float32 eager instead.
    eager_not_finite_at: int | None = None
    float16_eager_overflow_at: int | None = None
    suppressed_tokens: list[int] = field(default_factory=list)  # never fed, never counted as a top-1 choice
    agreed_steps: int = 0
    top1_agreement: float = 1.0  # steps where the artifact's top token is eager's, over compared steps
    # Teacher-forced: eager's margin (as eager_margin) at every step where the top tokens differ. Small
    # margins next to max_logit_diff mean near-ties, which any rounding may flip.
    disagreement_margins: list[float] = field(default_factory=list)
    # --baseline (teacher-forced): the same export with a float KV cache, fed the same tokens. Its own
    # agreement with eager is the weights' share of the error; the artifact's agreement with it and
    # their max |logit difference| are the KV cache's.
    baseline_top1_agreement: float | None = None
    top1_agreement_with_baseline: float | None = None
    max_logit_diff_vs_baseline: float | None = None
    logit_diff_per_step: list[float] = field(default_factory=list)
    eager_ids: list[int] = field(default_factory=list)
    artifact_ids: list[int] = field(default_factory=list)
    speculation: dict | None = None  # --draft: the speculative generation's verifications (speculation.Speculation)


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
    runner: str = "kvexport"  # what ran the artifact: kvexport's runner, or onnxruntime-genai ("genai")
    # Eager ran first and was let go before the artifact loaded: the machine could not hold both.
    one_at_a_time: bool = False

    @property
    def passed(self) -> bool:
        return self.ok

    @property
    def ok(self) -> bool:
        if self.mode == "agreement":
            return all(p.eager_not_finite_at is None and p.top1_agreement >= self.min_agreement for p in self.prompts)
        return all(p.match and p.logits_ok for p in self.prompts)

    def to_dict(self) -> dict:
        return {**asdict(self), "ok": self.ok}


def smallest_window(manifest: Manifest) -> int | None:
    windows = [layer.window for layer in manifest.layers if layer.cache == "ring"]
    return min(windows) if windows else None


def default_prompts(manifest: Manifest, tokenizer: ArtifactTokenizer, new_tokens: int | None = None) -> list[tuple[str, int]]:
    """(prompt, new tokens): a short prompt whose generation runs past the window, and a prompt
    longer than the window (or half the cache, for models without one). ``new_tokens`` sets the
    short prompt's generation length instead (it is still capped by the cache)."""
    max_len = manifest.max_cache_len
    window = smallest_window(manifest)
    short = _short_prompt(tokenizer, max_len)
    short_len = len(tokenizer.encode(short))
    wanted = new_tokens or ((window + 64) if window else 64)
    prompts = [(short, max(1, min(wanted, max_len - short_len + 1)))]
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


def _short_prompt(tokenizer: ArtifactTokenizer, max_len: int) -> str:
    """The short prompt, or in a cache too short for it, its longest beginning that fills at most
    half the cache (room to generate), else the shortest that fits; where none fits, refused as
    ``run`` refuses a prompt longer than the cache."""
    if len(tokenizer.encode(_SHORT_PROMPT)) <= max_len:
        return _SHORT_PROMPT
    beginnings = [(_SHORT_PROMPT[:n], len(tokenizer.encode(_SHORT_PROMPT[:n]))) for n in range(1, len(_SHORT_PROMPT))]
    fitting = [text for text, n in beginnings if n <= max(1, max_len // 2)]
    if fitting:
        return fitting[-1]
    text, n = beginnings[0]
    if n <= max_len:
        return text
    raise PromptTooLongError(
        f"the artifact's max_cache_len {max_len} holds none of check's prompts: even {text!r} is {n} tokens; "
        "give a --prompt that fits, or re-export with a larger --max-cache-len"
    )


def load_reference(manifest: Manifest, model_name: str | None, device: str, dtype: str | None = None):
    """The eager transformers model the artifact was exported from (or ``model_name``), in the
    artifact's dtype or ``dtype``."""
    from ..models import sources
    from .eager import refuse_without_cuda

    if device == "cuda":
        refuse_without_cuda()
    source = sources.resolve(model_name) if model_name else sources.resolve_recorded(manifest.source)
    vocab_size = text_config(sources.load_config(source)).vocab_size
    if vocab_size != manifest.vocab_size:  # the logits could not be compared (before the weights load)
        raise InvalidOptionError(
            f"{source.name} has a vocabulary of {vocab_size} tokens and the artifact one of {manifest.vocab_size}: "
            "check compares an artifact with the model it was exported from; give that model (or leave out --model)"
        )
    model, _ = sources.load_model(source, dtype or manifest.dtype)
    return model.to(device)


def holds_both(folder: Path, manifest: Manifest, model_name: str | None) -> bool:
    """Whether this machine holds the eager model (its parameters in the artifact's dtype) and the
    artifact's files beside the libraries at once (``memory_plan``'s estimate of them)."""
    from ..exporter.memory_plan import BASE_BYTES, count_parameters, total_memory_bytes
    from ..models import sources

    memory = total_memory_bytes()
    if memory is None:
        return True
    source = sources.resolve(model_name) if model_name else sources.resolve_recorded(manifest.source)
    eager = count_parameters(sources.load_config(source)).total * manifest.dtype.bytes
    artifact = manifest.files_bytes
    return BASE_BYTES[manifest.target] + eager + artifact <= memory


class Float32Logits:
    """Float32 eager's last logits for a token sequence, the model loaded on first use: the yardstick
    for a half-precision artifact's doubtful steps (no cache: there are few such steps)."""

    def __init__(self, load):
        self._load = load
        self._model = None

    @property
    def model(self):
        if self._model is None:
            self._model = self._load()
        return self._model

    def __call__(self, ids: list[int]) -> np.ndarray:
        import torch

        device = next(self.model.parameters()).device
        with torch.no_grad():
            out = self.model(input_ids=torch.tensor([ids], device=device), use_cache=False, logits_to_keep=1)
        return out.logits[0, -1].float().cpu().numpy()


def check_prompt(
    program,
    model,
    prompt_ids: list[int],
    max_new_tokens: int,
    tolerance: float,
    teacher_forcing: bool = False,
    suppress: list[int] | None = None,
    float32_logits=None,
    baseline=None,
) -> PromptReport:
    """Step the artifact beside eager ``generate`` (``model``, or its ``RecordedGeneration`` of this
    prompt, of ``max_new_tokens`` with the same ``suppress``).

    Free-running (the default), the artifact feeds back its own choices and the comparison stops at
    the first divergence. With ``teacher_forcing`` (quantized artifacts, which are not expected to
    be exact), the artifact is fed eager's tokens at every step, and every step counts towards the
    top-1 agreement. Neither side's top-1 choice is ever one of ``suppress`` (eager never generates
    one); their logits are still compared. ``float32_logits`` (ids -> logits), given for a
    half-precision artifact, judges the steps beyond the tolerance or with another token against
    float32 eager (see the comment at ``LOGIT_TOLERANCE``). ``baseline`` (teacher-forced only), a
    program fed the same tokens, is compared with eager and with the artifact as well.
    """
    from .eager import RecordedGeneration, greedy_generate

    check_fits(len(prompt_ids), max_new_tokens, program.manifest.max_cache_len)
    report = PromptReport(prompt="", prompt_tokens=len(prompt_ids), new_tokens=max_new_tokens,
                          suppressed_tokens=list(suppress or []))

    def top(logits: np.ndarray) -> int:
        if not report.suppressed_tokens:
            return int(np.argmax(logits))
        allowed = logits.copy()
        allowed[report.suppressed_tokens] = -np.inf
        return int(np.argmax(allowed))

    fed = list(prompt_ids)  # what both sides have seen when the step's logits come
    baseline_agreed = agreed_with_baseline = 0

    def on_eager_logits(step: int, eager: np.ndarray) -> None:
        if (not report.match and not teacher_forcing) or report.eager_not_finite_at is not None:
            return
        if not np.isfinite(eager).all():  # no reference left to compare with
            report.eager_not_finite_at, report.match = step, False
            return
        tokens, start = (list(prompt_ids), 0) if step == 0 else (fed[-1:], len(fed) - 1)
        logits = program.forward(tokens, start)
        if baseline is not None:
            nonlocal baseline_agreed, agreed_with_baseline
            base = baseline.forward(tokens, start)
            baseline_agreed += top(base) == top(eager)
            agreed_with_baseline += top(base) == top(logits)
            report.max_logit_diff_vs_baseline = max(report.max_logit_diff_vs_baseline or 0.0, float(np.max(np.abs(logits - base))))
        diff = float(np.max(np.abs(logits - eager)))
        report.logit_diff_per_step.append(diff)
        report.compared_steps += 1
        mine, theirs = top(logits), top(eager)
        report.artifact_ids.append(mine)
        report.agreed_steps += mine == theirs
        within, tie = diff <= tolerance, False
        if float32_logits is not None and (not within or mine != theirs):
            exact = float32_logits(fed)
            own = float(np.max(np.abs(eager - exact)))  # eager's own rounding error at this step
            beyond = float(np.max(np.abs(logits - exact))) - own
            report.float32_steps += 1
            report.max_diff_beyond_rounding = max(report.max_diff_beyond_rounding, beyond)
            within = within or beyond <= tolerance
            tie = mine != theirs and float(exact[theirs] - exact[mine]) <= tolerance + own
            if tie:
                report.rounding_ties.append(step)
        fed.append(theirs if teacher_forcing or tie else mine)
        if mine != theirs and teacher_forcing:
            report.disagreement_margins.append(float(eager[theirs] - eager[mine]))
        if mine != theirs and report.match and not tie:
            report.match = False
            report.first_divergence = step
            report.eager_token, report.artifact_token = theirs, mine
            report.eager_margin = float(eager[theirs] - eager[mine])
            # A near-tie only where the logits were right until then and are at this step too: a
            # small margin after logits already beyond the tolerance is the same mismatch showing.
            report.near_tie = report.eager_margin <= 2 * tolerance and report.logits_ok and within
        if report.match or teacher_forcing:
            report.max_logit_diff = max(report.max_logit_diff, diff)
            report.logits_ok = report.logits_ok and within

    stop = (lambda: report.eager_not_finite_at is not None) if teacher_forcing else (lambda: not report.match)
    if isinstance(model, RecordedGeneration):  # eager ran before the artifact loaded
        report.eager_ids = model.replay(on_eager_logits, stop)
    else:
        report.eager_ids = greedy_generate(model, prompt_ids, max_new_tokens, on_eager_logits, stop=stop,
                                           suppress=report.suppressed_tokens)
    report.top1_agreement = report.agreed_steps / max(report.compared_steps, 1)
    if baseline is not None:
        report.baseline_top1_agreement = baseline_agreed / max(report.compared_steps, 1)
        report.top1_agreement_with_baseline = agreed_with_baseline / max(report.compared_steps, 1)
    return report


class SpeculativeSteps:
    """An artifact's speculative generation, served as a program's ``forward`` serves its steps to
    ``check_prompt``: the prompt's call gives the logits the first new token was chosen from, each
    later call (of the token chosen before) the next new token's. Where the check feeds another
    token than the generation chose (a float16 rounding tie, where eager's is fed), the program
    goes on without drafts from that context, prefilled again."""

    def __init__(self, program, drafter, draft_tokens: int, prompt_ids: list[int], max_new_tokens: int):
        from ..runtime.speculation import generate_with_draft

        self.program, self.manifest = program, program.manifest
        self.rows: list[np.ndarray] = []  # row i: the logits new token i was chosen from

        def keep(step: int, logits: np.ndarray) -> bool:
            self.rows.append(logits)
            return True

        run = generate_with_draft(program, prompt_ids, max_new_tokens, drafter, draft_tokens, on_logits=keep)
        self.prompt_len = len(prompt_ids)
        self.tokens = list(prompt_ids) + run.new_ids
        self.speculation = run.speculation.summary()
        self._fed: list[int] = []
        self._replaying = True

    def forward(self, tokens: list[int], start: int) -> np.ndarray:
        self._fed[start:] = tokens
        if self._replaying and self._fed == self.tokens[: len(self._fed)]:
            return self.rows[len(self._fed) - self.prompt_len]
        if self._replaying:  # off the generation's path: the artifact alone, from the context so far
            self._replaying = False
            return self.program.forward(self._fed, 0)
        return self.program.forward(tokens, start)


def check_half_precision_prompt(program, model, float32_logits: Float32Logits, prompt_ids: list[int],
                                max_new_tokens: int, tolerance: float) -> PromptReport:
    """A float16 artifact's prompt: against eager float16 (``model``), float32 eager judging the
    doubtful steps; against float32 eager alone where eager float16 overflows. That is the model
    eager float16 stands for, and its own rounding being ~0, a token difference there is a rounding
    tie if float32 eager's margin is within the tolerance."""
    report = check_prompt(program, model, prompt_ids, max_new_tokens, tolerance, float32_logits=float32_logits)
    if report.eager_not_finite_at is not None:
        overflow = report.eager_not_finite_at
        report = check_prompt(program, float32_logits.model, prompt_ids, max_new_tokens, tolerance, float32_logits=float32_logits)
        report.float16_eager_overflow_at = overflow
    return report


def run_check(
    folder: Path,
    prompts: list[tuple[str, int]] | None = None,
    device: str = "cpu",
    model_name: str | None = None,
    on_prompt=None,
    runner: str = "kvexport",
    baseline: Path | None = None,
    draft: str | None = None,
    draft_tokens: int | None = None,
    min_agreement: float | None = None,
) -> CheckReport:
    """``draft`` (``--draft``): the artifact generates speculatively with that drafter,
    ``draft_tokens`` at a time (default: its max_draft_tokens), and its tokens must still be eager's.
    ``min_agreement`` (``--min-agreement``): a quantized artifact's bar [default: MIN_QUANTIZED_AGREEMENT]."""
    import contextlib
    import gc

    from ..allocator import return_freed_memory
    from ..artifact.manifest import read_manifest
    from ..runtime.speculation import check_drafter, load_drafter
    from .eager import record_greedy

    manifest = read_manifest(folder)
    if draft is not None and (approximate(manifest) or runner != "kvexport" or baseline is not None):
        raise InvalidOptionError("--draft checks an exact (unquantized) artifact with kvexport's runner, without --baseline")
    if baseline is not None:
        check_baseline(manifest, read_manifest(baseline), baseline)
    min_agreement = check_min_agreement(manifest, min_agreement)
    tokenizer = ArtifactTokenizer(folder)
    quantized = approximate(manifest)
    prompts = prompts or default_prompts(manifest, tokenizer, QUANTIZED_STEPS if quantized else None)
    encoded = [(text, tokenizer.encode(text), n) for text, n in prompts]
    for _, ids, n in encoded:  # refuse before loading anything heavy
        check_fits(len(ids), n, manifest.max_cache_len)
    tolerance = logit_tolerance(manifest)
    half = manifest.dtype != "float32" and not quantized
    suppress = list(manifest.eos_token_ids) if quantized else None
    # A half-precision artifact's doubtful steps need the float32 model beside it: never one at a time.
    one_at_a_time = not half and device == "cpu" and not holds_both(folder, manifest, model_name)
    if one_at_a_time:  # eager's generations kept, the model let go, then the artifact loads
        model = load_reference(manifest, model_name, device)
        references = [record_greedy(model, ids, n, suppress or ()) for _, ids, n in encoded]
        del model
        gc.collect()
        return_freed_memory()
    # ExecuTorch runs on the CPU whatever --device says; --device places the eager reference (and ONNX).
    program = load_program(folder, manifest, device if manifest.target == "onnx" else "cpu", runner)
    if not one_at_a_time:
        model = load_reference(manifest, model_name, device)
        references = [model] * len(encoded)
    base = None if baseline is None else load_program(baseline, None, device if manifest.target == "onnx" else "cpu", runner)
    float32_logits = Float32Logits(lambda: load_reference(manifest, model_name, device, "float32")) if half else None
    reports = []
    with contextlib.ExitStack() as stack:
        drafter = load_drafter(draft, stack, device if manifest.target == "onnx" else "cpu") if draft else None
        k = check_drafter(program, drafter, draft_tokens) if drafter is not None else None
        for (text, ids, n), reference in zip(encoded, references):
            steps = program if drafter is None else SpeculativeSteps(program, drafter, k, ids, n)
            if half:
                report = check_half_precision_prompt(steps, reference, float32_logits, ids, n, tolerance)
            else:
                report = check_prompt(steps, reference, ids, n, tolerance, teacher_forcing=quantized, suppress=suppress,
                                      baseline=base)
            report.prompt = text
            report.speculation = getattr(steps, "speculation", None)
            reports.append(report)
            if on_prompt:
                on_prompt(report)
    mode, min_agreement = ("agreement", min_agreement) if quantized else ("exact", 1.0)
    return CheckReport(str(folder), manifest.target, manifest.dtype, device, tolerance, reports, mode, min_agreement,
                       runner, one_at_a_time)


def check_min_agreement(manifest: Manifest, min_agreement: float | None) -> float:
    """The top-1 agreement a quantized artifact must reach: ``--min-agreement`` (a fraction in (0, 1])
    or the default; refused for an artifact held to identical tokens."""
    if min_agreement is None:
        return MIN_QUANTIZED_AGREEMENT
    if not approximate(manifest):
        raise InvalidOptionError("--min-agreement is for a quantized artifact (quantized weights or KV cache); "
                                 "this one is held to identical tokens, leave it out")
    if not 0 < min_agreement <= 1:
        raise InvalidOptionError(f"--min-agreement is a fraction of the steps, above 0 and at most 1 (0.9 for 90%); got {min_agreement}")
    return min_agreement


def computes_float16_in_float16(manifest: Manifest) -> bool:
    """A float16 .pte on a CPU where XNNPACK sums float16 products in float16, not in float32 as eager
    float16 does: it keeps about bfloat16's precision there, and is held to bfloat16's tolerance
    (docs/check.md#float16)."""
    return manifest.dtype == "float16" and manifest.target == "executorch" and xnnpack_sums_float16_in_float16()


def logit_tolerance(manifest: Manifest) -> float:
    return LOGIT_TOLERANCE["bfloat16" if computes_float16_in_float16(manifest) else manifest.dtype]


def check_baseline(manifest: Manifest, baseline: Manifest, path) -> None:
    """``--baseline``: the artifact has an int8 KV cache, and ``path`` is the same model, target,
    dtype and weights with a float one, so that their difference is the cache's alone."""
    if not manifest.kv_cache:
        raise InvalidOptionError("--baseline compares an artifact with an int8 KV cache to the same export with a float one; "
                                 "this artifact's KV cache is float")
    same = {key: (getattr(manifest, key), getattr(baseline, key)) for key in ("source", "target", "dtype", "quantization")}
    differs = [key for key, (mine, theirs) in same.items() if mine != theirs]
    if baseline.kv_cache or differs:
        why = "its KV cache is int8 too" if baseline.kv_cache else f"its {differs[0]} differs"
        raise InvalidOptionError(f"--baseline {path} is not this export with a float KV cache: {why}; "
                                 "export it again with --kv-cache float and the same model, --target, --dtype and --quantize")


def approximate(manifest: Manifest) -> bool:
    """Quantized weights or a quantized KV cache: held to top-1 agreement with float eager, not to
    identical tokens."""
    return bool(manifest.quantization) or bool(manifest.kv_cache)


def choose_prompts(manifest: Manifest, tokenizer: ArtifactTokenizer, prompts: list[str] | None,
                   max_new_tokens: int | None) -> list[tuple[str, int]] | None:
    """``(prompt, new tokens)`` pairs for the prompts and length asked for, each checked to fit the
    cache; None where the defaults are wanted as they are."""
    # Checked on the text: "" encodes to a lone BOS for many tokenizers, which is no prompt at all.
    if prompts and not all(prompts):
        raise InvalidOptionError("a --prompt is empty; give some text")
    quantized = approximate(manifest)
    defaults = default_prompts(manifest, tokenizer, QUANTIZED_STEPS if quantized else None)
    if prompts:
        n = defaults[0][1] if max_new_tokens is None else max_new_tokens
        chosen = [(p, n) for p in prompts]
    elif max_new_tokens is not None:
        chosen = [(p, max_new_tokens) for p, _ in defaults]
    else:
        return None
    for text, n in chosen:
        check_fits(len(tokenizer.encode(text)), n, manifest.max_cache_len)
    return chosen
