"""What ``kvexport bench`` measures: eager transformers, kvexport artifacts, ExecuTorch's own runner
and llama.cpp, in one run (``run_bench(BenchOptions(...))`` returns the report; the command in
``kvexport/cli/bench.py`` prints it).

Paths, each measured in a fresh subprocess per repeat (so peak RSS is that path's alone and no path
warms another's caches), the repeats interleaved round-robin across paths (so a burst of load on a
shared machine spreads over all of them):

- ``eager``: transformers' ``generate`` (greedy, its DynamicCache) on MODEL, as ``kvexport check``
  runs it (``kvexport.checker.eager.greedy_generate``);
- ``run``: each ARTIFACT (any target or dtype) through kvexport's own loop, what ``kvexport run``
  does (``load_program`` + ``generation.generate``); and for each ``--draft`` (prompt lookup, or a
  drafting artifact) and each of ``--draft-tokens``, each ARTIFACT that verifies drafted tokens
  (``--max-draft-tokens``) speculatively, what ``kvexport run --draft`` does
  (``speculation.generate_with_draft``), its acceptance beside its speed;
- ``textllm``: each ``.pte`` ARTIFACT through ExecuTorch's C++ ``TextLLMRunner`` (its pybinding), its
  timing from the ``Stats`` it hands to ``stats_callback``; so is each ``--pte`` file, another
  exporter's program of the same model (optimum-executorch's, say), with the first ARTIFACT's
  tokenizer and BOS (a ``.ptd`` of the same name beside it is its data file);
- ``genai``: each ONNX ARTIFACT in onnxruntime-genai, its own generator (``og.Generator``:
  ``append_tokens`` with the prompt, then ``generate_next_token``), what an app embedding genai
  does; so is each ``--genai-folder``, another exporter's genai folder of the same model
  (onnxruntime-genai's model builder's, say), with the first ARTIFACT's prompt ids; every folder's
  generator has the first ARTIFACT's ``max_cache_len`` as its ``max_length`` (which also sizes
  genai's buffers);
- ``llama``: llama.cpp (``llama-cpp-python``) on MODEL's GGUF file, when ``llama_cpp`` imports in
  ``--llama-python`` (default: this interpreter); otherwise reported as not installed.

Every path gets the same prompt token ids (a fixed English text cut to exactly ``--prompt-tokens``
tokens by the artifact's tokenizer, or ``--prompt-file``'s text as it is) and generates ``--new-tokens`` greedy tokens, EOS ignored (the
TextLLMRunner path cannot ignore EOS; it reports how many it generated). Each subprocess first does
one short warm-up generation, then the measured one. Metrics, all from the measured generation:

- TTFT: from the call with the prompt to the first new token (prefill + first pick);
- prefill tokens/s: prompt tokens / prefill time;
- decode tokens/s: (new tokens - 1) / time from the first new token to the last (each of those
  tokens costs one forward call of one token);
- peak RSS: the subprocess's VmHWM (Linux), loading included.

``--prompt-tokens`` may list several lengths (``128,1024,4096``): every path runs at each, a table
per length, then one of decode tokens/s by length for each path but llama.cpp and the speculative
runs beside its memory-traffic limit there (``kvexport.bench.traffic``: the weights and the cache rows
a step reads, over the bandwidth the path reached at the shortest length) and the share of it reached.

The table also gives each path's decode tokens/s as a multiple of eager's and of llama.cpp's
(medians of the same run), and kvexport run's against TextLLMRunner's on the same ``.pte``: the
ratio of their medians, and the median of each round's own ratio (a round runs every path once,
so the two run back to back).

Other load: before every run the script samples ``/proc/stat`` for half a second while nothing of
its own runs; the header gives the median and largest share of the CPUs busy then, and warns when it
passed 10%. The load average it also prints lags by minutes and counts the previous run. Neither
sees a virtual machine's host: on this project's 2-CPU VM two runs with no other process differed
by up to a quarter per path, so a ratio near 1 needs more than one run.

``--device cuda``: eager in the first artifact's dtype on the GPU, and each float16 or bfloat16 ONNX
ARTIFACT on ONNX Runtime's CUDA provider (``run``) and onnxruntime-genai's CUDA build (``genai``);
the other paths run on the CPU and are refused, and no traffic limit is given (a small model's
step on a GPU waits on kernel launches, not on memory).

Threads: ``torch.set_num_threads(N)`` (eager, and torch ops anywhere); ExecuTorch's threadpool
(XNNPACK and the LLM custom ops, one pool per process shared by kvexport's runner and
TextLLMRunner) is reset to N with ``executorch.extension.pybindings.portable_lib._unsafe_reset_threadpool``;
ONNX Runtime gets ``intra_op_num_threads=N`` (inter-op 1), in onnxruntime-genai through its
config's session options; kvexport's runners take N as a user gives it, through ``KVEXPORT_THREADS``;
llama.cpp ``n_threads = n_threads_batch = N``.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ..artifact.manifest import Manifest
from ..errors import InvalidOptionError
from . import workers
from .machine_load import background_busy
from .summary import finish, ratios, summarize, traffic_by_path

PATHS = ("eager", "run", "textllm", "genai", "llama")
CUDA_PATHS = ("eager", "run", "genai")  # TextLLMRunner and llama.cpp (as installed here) run on the CPU
_FILLER = (
    "The history of computing is a story of people who wanted machines to do arithmetic faster than any "
    "clerk could. Early mechanical calculators added and multiplied with gears; later, electrical relays "
    "and vacuum tubes replaced the gears, and the transistor replaced the tubes. Each step made machines "
    "smaller, cheaper and more reliable, and each one changed what people expected a computer to do. "
)


def prompt_lengths(text: str) -> list[int]:
    """``--prompt-tokens``: one length or several, comma-separated, each once, in increasing order."""
    try:
        lengths = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        lengths = []
    if not lengths:
        raise InvalidOptionError(f"{text!r} is not a length or comma-separated lengths (128,1024,4096)")
    return lengths


@dataclass
class BenchOptions:
    """What one bench run measures; each value is checked here, before anything loads or runs."""

    model: str  # eager and llama.cpp run it; the artifacts come from it
    artifacts: list[Path]
    prompt_tokens: list[int] = field(default_factory=lambda: [128])
    new_tokens: int = 128
    repeats: int = 3
    threads: int = 2
    paths: list[str] = field(default_factory=lambda: list(PATHS))
    llama_python: str = sys.executable
    pte: list[Path] = field(default_factory=list)  # other exporters' programs, run through TextLLMRunner
    genai_folder: list[Path] = field(default_factory=list)  # other exporters' genai folders
    draft: list[str] = field(default_factory=list)  # "ngram" or a drafting artifact's folder
    draft_tokens: list[int] = field(default_factory=lambda: [4])
    prompt_file: Path | None = None  # its text as it is replaces prompt_tokens
    device: str = "cpu"  # cuda: eager in the artifacts' dtype, the ONNX artifacts on onnxruntime-gpu

    def __post_init__(self):
        unknown = set(self.paths) - set(PATHS)
        if unknown:
            raise InvalidOptionError(f"unknown --paths {', '.join(sorted(unknown))}; choose from {', '.join(PATHS)}")
        if self.device not in ("cpu", "cuda"):
            raise InvalidOptionError(f"unknown --device '{self.device}'; choose cpu or cuda")
        if self.device == "cuda" and set(self.paths) - set(CUDA_PATHS):
            raise InvalidOptionError(
                f"--device cuda measures {', '.join(CUDA_PATHS)}; {', '.join(sorted(set(self.paths) - set(CUDA_PATHS)))} "
                "run on the CPU: leave them out of --paths"
            )
        if min(*self.prompt_tokens, self.new_tokens, self.repeats, self.threads) < 1:
            raise InvalidOptionError("--prompt-tokens, --new-tokens, --repeats and --threads must be at least 1")
        if not self.artifacts:
            raise InvalidOptionError("give at least one artifact folder (its tokenizer makes the prompt)")
        for pte in self.pte:
            if not pte.is_file():
                raise InvalidOptionError(f"--pte {pte}: no such file")
        for folder in self.genai_folder:
            if not (folder / "genai_config.json").is_file():
                raise InvalidOptionError(f"--genai-folder {folder}: no genai_config.json there")
        for draft in self.draft:
            if draft != "ngram" and not (Path(draft) / "kvexport.json").is_file():
                raise InvalidOptionError(f"--draft {draft}: give ngram or a kvexport artifact folder")
        if self.prompt_file is not None and not self.prompt_file.is_file():
            raise InvalidOptionError(f"--prompt-file {self.prompt_file}: no such file")


def exact_prompt(tokenizer, n: int) -> tuple[str, list[int]]:
    """A text whose encoding (special tokens included) has exactly ``n`` tokens, and those ids; the
    empty text where the tokenizer's special tokens alone are ``n`` (a BOS-only prompt)."""
    specials = tokenizer.encode("")
    if n <= len(specials):
        if n == len(specials):
            return "", specials
        raise InvalidOptionError(
            f"--prompt-tokens {n}: this tokenizer adds {len(specials)} special tokens to every prompt; ask for at least {len(specials)}"
        )
    words = (_FILLER * (2 + n // 20)).split()
    text = ""
    for word in words:
        longer = f"{text} {word}" if text else word
        size = len(tokenizer.encode(longer))
        if size == n:
            return longer, tokenizer.encode(longer)
        if size > n:  # this word overshoots: a part of it may not
            for k in range(len(word) - 1, -1 if text else 0, -1):  # k = 0: a trailing space
                part = f"{text} {word[:k]}" if text else word[:k]
                if len(tokenizer.encode(part)) == n:
                    return part, tokenizer.encode(part)
            continue
        text = longer
    raise InvalidOptionError(f"--prompt-tokens {n}: no prefix of bench's text encodes to exactly {n} tokens with this tokenizer; try {n + 1}")


def gguf_of(model: str) -> str | None:
    from ..models import sources

    try:
        source = sources.resolve(model)
    except Exception:
        return None
    return str(source.path) if source.kind in ("alias", "gguf") and source.path else None


def llama_available(python: str) -> str | None:
    """llama_cpp's version in ``python``, or None."""
    probe = subprocess.run([python, "-c", "import llama_cpp; print(llama_cpp.__version__)"],
                           capture_output=True, text=True)
    return probe.stdout.strip() if probe.returncode == 0 else None


def describe(manifest: Manifest) -> str:
    quant = manifest.quantization or (manifest.export_options or {}).get("quantize")
    kind = quant if isinstance(quant, str) else (quant.get("scheme") if isinstance(quant, dict) else None)
    if isinstance(quant, dict) and quant.get("grid") == "symmetric":
        kind += " symmetric"
    kv = f" {manifest.kv_cache['dtype']}" if manifest.kv_cache else ""
    return f"{manifest.target} {kind or manifest.dtype}, cache{kv} {manifest.max_cache_len}"


def eager_dtype(options: BenchOptions, manifests: dict[str, Manifest]) -> str:
    """What the eager path runs in: on the GPU the first artifact's dtype (float16 or bfloat16), as
    the ONNX artifacts it runs beside; float32 on the CPU."""
    return next(iter(manifests.values())).dtype if options.device == "cuda" else "float32"


def check_device(options: BenchOptions, manifests: dict[str, Manifest]) -> str | None:
    """Refuse, before anything runs, what ``--device cuda`` cannot measure here; the GPU's name."""
    if options.device != "cuda":
        return None
    import torch

    from ..checker.eager import refuse_without_cuda
    from ..runtime.onnx_artifact import check_runs_on_cuda

    refuse_without_cuda()
    for folder, manifest in manifests.items():
        if manifest.target != "onnx":
            raise InvalidOptionError(f"--device cuda runs ONNX artifacts; {Path(folder).name} is {manifest.target} (run on the CPU)")
        check_runs_on_cuda(manifest)
    if options.genai_folder or options.pte or options.draft:
        raise InvalidOptionError("--device cuda measures kvexport's artifacts: leave out --genai-folder, --pte and --draft")
    return torch.cuda.get_device_name(0)


def plan_jobs(options: BenchOptions, manifests: dict[str, Manifest], gguf: str | None, llama_version: str | None) -> list[dict]:
    jobs = []
    wanted = options.paths
    if "eager" in wanted:
        jobs.append({"path": "eager", "label": f"eager transformers ({options.model}, {eager_dtype(options, manifests)})",
                     "python": sys.executable})
    for folder, manifest in manifests.items():
        name = Path(folder).name
        if "run" in wanted:
            jobs.append({"path": "run", "label": f"kvexport run · {name} ({describe(manifest)})", "artifact": folder,
                         "python": sys.executable})
            for draft in options.draft if manifest.max_draft_tokens else []:
                drafter = draft if draft == "ngram" else Path(draft).name
                for k in (k for k in options.draft_tokens if k <= manifest.max_draft_tokens):
                    jobs.append({"path": "run", "label": f"kvexport run · {name}, drafts {drafter} k={k}", "artifact": folder,
                                 "draft": draft if draft == "ngram" else str(Path(draft).resolve()), "draft_tokens": k,
                                 "python": sys.executable})
        if "textllm" in wanted and manifest.target == "executorch":
            jobs.append({"path": "textllm", "label": f"ExecuTorch TextLLMRunner · {name} ({describe(manifest)})",
                         "artifact": folder, "python": sys.executable})
        if "genai" in wanted and manifest.target == "onnx":
            jobs.append({"path": "genai", "label": f"onnxruntime-genai · {name} ({describe(manifest)})",
                         "artifact": folder, "max_length": manifest.max_cache_len, "python": sys.executable})
    if "genai" in wanted:
        first, manifest = next(iter(manifests.items()))
        for other in options.genai_folder:
            jobs.append({"path": "genai", "label": f"onnxruntime-genai · {other.name} (another exporter's)",
                         "artifact": first, "genai_folder": str(other.resolve()), "max_length": manifest.max_cache_len,
                         "python": sys.executable})
    if "textllm" in wanted:
        tokenizer_of = next(iter(manifests))
        for pte in options.pte:
            jobs.append({"path": "textllm", "label": f"ExecuTorch TextLLMRunner · {pte.parent.name}/{pte.name}",
                         "artifact": tokenizer_of, "pte": str(pte.resolve()), "python": sys.executable})
    if "llama" in wanted:
        label = f"llama.cpp · {Path(gguf).name if gguf else options.model}"
        job = {"path": "llama", "label": label, "gguf": gguf, "python": options.llama_python}
        if gguf is None:
            job["skipped"] = f"{options.model} is no GGUF file or alias of one"
        elif llama_version is None:
            job["skipped"] = f"not installed (no llama_cpp in {options.llama_python})"
        jobs.append(job)
    return jobs


def run_job(job: dict, common: dict, workdir: Path) -> dict:
    spec_path, result_path = workdir / "spec.json", workdir / "result.json"
    result_path.unlink(missing_ok=True)
    spec = {**common, **{k: v for k, v in job.items() if k not in ("label", "python")}, "result": str(result_path)}
    spec_path.write_text(json.dumps(spec))
    t = time.perf_counter()
    proc = subprocess.run([job["python"], workers.__file__, str(spec_path)],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=str(workers.REPO))
    if proc.returncode != 0 or not result_path.is_file():
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return {"error": f"exit {proc.returncode}: " + " | ".join(tail)}
    result = json.loads(result_path.read_text())
    result["wall_s"] = time.perf_counter() - t
    result["prefill_tokens_per_s"] = result["prompt_tokens"] / result["prefill_s"] if result["prefill_s"] else None
    result["decode_tokens_per_s"] = result["decode_steps"] / result["decode_s"] if result["decode_s"] else None
    result["ttft_ms"] = result["ttft_s"] * 1000
    return result


def run_bench(options: BenchOptions, on_run: Callable[[int, dict, int, dict], None] | None = None) -> dict:
    """Measure every path of ``options`` at each prompt length, ``options.repeats`` times, the repeats
    interleaved round-robin; ``on_run(repeat, job, prompt_tokens, result)`` hears of each run as it
    ends. Returns the report (``report.markdown`` writes it as tables)."""
    from ..artifact.manifest import read_manifest
    from ..runtime.cpu import cpu_info
    from ..runtime.generation import check_fits
    from ..runtime.tokenizer import ArtifactTokenizer

    manifests = {str(Path(a).resolve()): read_manifest(Path(a)) for a in options.artifacts}
    gpu = check_device(options, manifests)
    tokenizer = ArtifactTokenizer(Path(next(iter(manifests))))  # the model's: every artifact has the same
    if options.prompt_file is not None:
        text = options.prompt_file.read_text()
        prompts = {len(tokenizer.encode(text)): (text, tokenizer.encode(text))}
    else:
        prompts = {n: exact_prompt(tokenizer, n) for n in options.prompt_tokens}
    lengths = list(prompts)
    for manifest in manifests.values():
        check_fits(max(lengths), options.new_tokens, manifest.max_cache_len)
    gguf = gguf_of(options.model) if "llama" in options.paths else None
    llama_version = llama_available(options.llama_python) if gguf else None
    contexts = {n: plan_jobs(options, manifests, gguf, llama_version) for n in lengths}
    for n, jobs in contexts.items():
        for job in jobs:
            job["prompt_text"], job["prompt_ids"] = prompts[n]
    common = {"model": options.model, "new_tokens": options.new_tokens, "threads": options.threads, "device": options.device,
              "eager_dtype": eager_dtype(options, manifests)}
    load_before = " ".join(f"{x:.2f}" for x in os.getloadavg())
    started = time.strftime("%Y-%m-%d %H:%M %Z")
    with tempfile.TemporaryDirectory(prefix="kvexport-bench-") as tmp:
        for repeat in range(options.repeats):
            for n, jobs in contexts.items():
                for job in jobs:
                    if job.get("skipped"):
                        continue
                    busy = background_busy()
                    result = {**run_job(job, common, Path(tmp)), "background_busy": busy}
                    job.setdefault("runs", []).append(result)
                    if on_run:
                        on_run(repeat, job, n, result)
    for jobs in contexts.values():
        finish(jobs)
    cpu, features = cpu_info()
    every_run = [r for jobs in contexts.values() for job in jobs for r in job.get("runs", [])]
    report = {
        "date": started,
        "machine": {"cpu": cpu, "cpu_features": features, "cpus": os.cpu_count(), "load_before": load_before,
                    "load_after": " ".join(f"{x:.2f}" for x in os.getloadavg()),
                    "background_busy": summarize([r.get("background_busy") for r in every_run]),
                    "python": platform.python_version(), **({"gpu": gpu} if gpu else {})},
        "protocol": {"prompt_tokens": lengths, "new_tokens": options.new_tokens, "repeats": options.repeats,
                     "threads": options.threads, "warmup_new_tokens": workers.WARMUP_NEW_TOKENS, "device": options.device},
        "model": options.model,
        "llama_cpp": llama_version,
        "contexts": [
            {"prompt_tokens": n, "prompt_text": prompts[n][0], "ratios": ratios(jobs),
             "paths": [{k: v for k, v in job.items() if k not in ("python", "prompt_ids", "prompt_text")} for job in jobs]}
            for n, jobs in contexts.items()
        ],
    }
    if len(contexts) > 1 and options.device == "cpu":
        # On a GPU a small model's decode step waits on kernel launches, not on memory: no limit to give.
        report["traffic"] = traffic_by_path(contexts, manifests, options.new_tokens)
    return report
