"""``kvexport bench``: eager transformers, kvexport artifacts, ExecuTorch's own runner and llama.cpp
measured in one run.

    kvexport bench MODEL ARTIFACT [ARTIFACT ...] [--prompt-tokens 128[,1024,...]] [--new-tokens 128]
        [--repeats 3] [--threads 2] [--json OUT.json] [--markdown OUT.md] [--paths eager,run,textllm,genai,llama]
        [--llama-python PYTHON] [--pte OTHER.pte ...] [--genai-folder OTHER_DIR ...]
        [--draft ngram|DRAFT_ARTIFACT ...] [--draft-tokens 2,4,8] [--prompt-file FILE]

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
per length, then one of decode tokens/s by length for each path of a kvexport artifact beside its
memory-traffic limit there (``kvexport.bench.traffic``: the weights and the cache rows a step reads,
over the bandwidth the path reached at the shortest length) and the share of it reached.

The table also gives each path's decode tokens/s as a multiple of eager's and of llama.cpp's
(medians of the same run), and kvexport run's against TextLLMRunner's on the same ``.pte``: the
ratio of their medians, and the median of each round's own ratio (a round runs every path once,
so the two run back to back).

Other load: before every run the script samples ``/proc/stat`` for half a second while nothing of
its own runs; the header gives the median and largest share of the CPUs busy then, and warns when it
passed 10%. The load average it also prints lags by minutes and counts the previous run. Neither
sees a virtual machine's host: on this project's 2-CPU VM two runs with no other process differed
by up to a quarter per path, so a ratio near 1 needs more than one run.

Threads: ``torch.set_num_threads(N)`` (eager, and torch ops anywhere); ExecuTorch's threadpool
(XNNPACK and the LLM custom ops, one pool per process shared by kvexport's runner and
TextLLMRunner) is reset to N with ``executorch.extension.pybindings.portable_lib._unsafe_reset_threadpool``;
ONNX Runtime gets ``intra_op_num_threads=N`` (inter-op 1), in onnxruntime-genai through its
config's session options; kvexport's runners take N as a user gives it, through ``KVEXPORT_THREADS``;
llama.cpp ``n_threads = n_threads_batch = N``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if (REPO / "kvexport").is_dir() and str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # this checkout's kvexport, not another installed one

PATHS = ("eager", "run", "textllm", "genai", "llama")
WARMUP_NEW_TOKENS = 4
_FILLER = (
    "The history of computing is a story of people who wanted machines to do arithmetic faster than any "
    "clerk could. Early mechanical calculators added and multiplied with gears; later, electrical relays "
    "and vacuum tubes replaced the gears, and the transistor replaced the tubes. Each step made machines "
    "smaller, cheaper and more reliable, and each one changed what people expected a computer to do. "
)
METRICS = (  # key, column title, digits
    ("ttft_ms", "TTFT ms", 0),
    ("prefill_tokens_per_s", "prefill tok/s", 0),
    ("decode_tokens_per_s", "decode tok/s", 1),
    ("peak_rss_mb", "peak RSS MB", 0),
)


# ---------------------------------------------------------------- workers (one subprocess each)


def peak_rss_mb() -> float:
    """This process's peak resident memory: VmHWM (per address space, so not inherited across exec).
    kvexport.progress has the same function; this copy stays because the llama.cpp worker runs in
    another interpreter (--llama-python), where kvexport and rich need not be installed."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _set_torch_threads(threads: int) -> None:
    import torch

    torch.set_num_threads(threads)


def _timed(prompt_ids: list[int], new_tokens: int, t0: float, first: float, end: float, n_new: int) -> dict:
    return {
        "prompt_tokens": len(prompt_ids),
        "new_tokens": n_new,
        "ttft_s": first - t0,
        "decode_s": end - first,
        "decode_steps": n_new - 1,
    }


def _warm_then_measure(generate, ids: list[int], n: int, load_s: float) -> dict:
    """``generate(count, stamps)`` (a stamp per new token) once short to warm up, then measured."""
    generate(WARMUP_NEW_TOKENS, [])
    stamps: list[float] = []
    t0 = time.perf_counter()
    new_ids = generate(n, stamps)
    end = time.perf_counter()
    return {**_timed(ids, n, t0, stamps[0], end, len(new_ids)), "prefill_s": stamps[0] - t0, "load_s": load_s,
            "new_ids": new_ids}


def work_eager(spec: dict) -> dict:
    from kvexport.checker.eager import greedy_generate
    from kvexport.models import sources

    _set_torch_threads(spec["threads"])
    t = time.perf_counter()
    model, _ = sources.load_model(sources.resolve(spec["model"]))
    load_s = time.perf_counter() - t
    ids, n = spec["prompt_ids"], spec["new_tokens"]
    greedy_generate(model, ids, WARMUP_NEW_TOKENS)
    stamps: list[float] = []
    t0 = time.perf_counter()
    new_ids = greedy_generate(model, ids, n, on_logits=lambda step, _: stamps.append(time.perf_counter()))
    end = time.perf_counter()
    return {**_timed(ids, n, t0, stamps[0], end, len(new_ids)), "prefill_s": stamps[0] - t0, "load_s": load_s,
            "new_ids": new_ids}


def work_run(spec: dict) -> dict:
    from kvexport.artifact.manifest import read_manifest
    from kvexport.runtime.cpu import THREADS_ENV
    from kvexport.runtime.generation import generate
    from kvexport.runtime.programs import load_program

    folder = Path(spec["artifact"])
    manifest = read_manifest(folder)
    os.environ[THREADS_ENV] = str(spec["threads"])  # the runners size their runtime's threads from it
    if manifest["target"] != "onnx":  # the ONNX runner imports no torch: its peak RSS stays its own
        _set_torch_threads(spec["threads"])
    t = time.perf_counter()
    program = load_program(folder, manifest)
    load_s = time.perf_counter() - t
    ids, n = spec["prompt_ids"], spec["new_tokens"]
    if spec.get("draft"):
        return _speculative_run(program, spec, load_s)
    generate(program, ids, WARMUP_NEW_TOKENS)
    program.reset()
    stamps: list[float] = []
    t0 = time.perf_counter()
    result = generate(program, ids, n, on_token=lambda _: stamps.append(time.perf_counter()))
    end = time.perf_counter()
    return {**_timed(ids, n, t0, stamps[0], end, len(result.new_ids)), "prefill_s": result.prefill_seconds,
            "load_s": load_s, "new_ids": result.new_ids}


def _speculative_run(program, spec: dict, load_s: float) -> dict:
    """``work_run`` with a drafter: warmed up (the drafter too, on its own short generation), then measured."""
    import contextlib

    from kvexport.runtime.speculation import generate_with_draft, load_drafter

    ids, n = spec["prompt_ids"], spec["new_tokens"]
    with contextlib.ExitStack() as stack:
        drafter = load_drafter(spec["draft"], stack)
        generate_with_draft(program, ids, WARMUP_NEW_TOKENS, drafter, spec["draft_tokens"])
        stamps: list[float] = []
        t0 = time.perf_counter()
        result = generate_with_draft(program, ids, n, drafter, spec["draft_tokens"],
                                     on_token=lambda _: stamps.append(time.perf_counter()))
        end = time.perf_counter()
    return {**_timed(ids, n, t0, stamps[0], end, len(result.new_ids)), "prefill_s": result.prefill_seconds,
            "load_s": load_s, "new_ids": result.new_ids, "speculation": result.speculation.summary()}


def work_textllm(spec: dict) -> dict:
    from kvexport.artifact.manifest import read_manifest
    from kvexport.runtime.executorch_program import register_kernels, set_executorch_threads

    folder = Path(spec["artifact"])  # with --pte, the kvexport artifact whose tokenizer it borrows
    manifest = read_manifest(folder)
    _set_torch_threads(spec["threads"])
    set_executorch_threads(spec["threads"])
    register_kernels()
    from executorch.extension.llm.runner import GenerationConfig, TextLLMRunner

    if spec.get("pte"):
        program, data = Path(spec["pte"]), Path(spec["pte"]).with_suffix(".ptd")
        weights = str(data) if data.is_file() else None
    else:
        program = folder / manifest["program"]
        weights = str(folder / manifest["weights"]) if manifest.get("weights") else None
    bos = 1 if manifest.get("tokenizer_adds_bos") else 0  # its tokenizer adds none: the runner prepends them
    t = time.perf_counter()
    runner = TextLLMRunner(str(program), str(folder / "tokenizer.json"), weights)
    load_s = time.perf_counter() - t  # plus the load inside the first generate, from its stats below

    def config(n: int, warming: bool):
        return GenerationConfig(max_new_tokens=n, temperature=0.0, echo=False, num_bos=bos, num_eos=0, warming=warming)

    # It prints each token on stdout itself: keep stdout for this worker's result only.
    saved = os.dup(1)
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
    try:
        stats: list = []
        runner.generate(spec["prompt_text"], config(WARMUP_NEW_TOKENS, True), stats_callback=stats.append)
        if stats:
            load_s += (stats[-1].model_load_end_ms - stats[-1].model_load_start_ms) / stats[-1].SCALING_FACTOR_UNITS_PER_SECOND
        runner.reset()
        pieces: list[str] = []
        runner.generate(spec["prompt_text"], config(spec["new_tokens"], False), token_callback=pieces.append,
                        stats_callback=stats.append)
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
    s = stats[-1]
    ms = s.SCALING_FACTOR_UNITS_PER_SECOND
    # Its own accounting, in whole milliseconds (a tiny model's prefill can take 0 ms: no rate then).
    # The prefill's token is not in num_generated_tokens; each counted one is a decode step.
    return {
        "prompt_tokens": s.num_prompt_tokens,
        "new_tokens": s.num_generated_tokens + 1,
        "ttft_s": (s.first_token_ms - s.inference_start_ms) / ms,
        "prefill_s": (s.prompt_eval_end_ms - s.inference_start_ms) / ms,
        "decode_s": (s.inference_end_ms - s.prompt_eval_end_ms) / ms,
        "decode_steps": s.num_generated_tokens,
        "load_s": load_s,
        "text": "".join(pieces),
    }


def work_genai(spec: dict) -> dict:
    import numpy as np
    import onnxruntime_genai as og

    from kvexport.runtime.genai_program import set_genai_threads

    t = time.perf_counter()
    config = og.Config(spec.get("genai_folder") or spec["artifact"])
    config.clear_providers()  # the CPU
    set_genai_threads(config, spec["threads"])
    model = og.Model(config)
    load_s = time.perf_counter() - t
    ids, n = spec["prompt_ids"], spec["new_tokens"]

    def generate(count: int, stamps: list[float]) -> list[int]:
        params = og.GeneratorParams(model)
        # max_length also sizes genai's sliding buffers (below the window, the kernel refuses them):
        # the cache's length, the same for every folder. EOS is masked until min_length.
        params.set_search_options(max_length=spec["max_length"], min_length=len(ids) + count, do_sample=False)
        generator = og.Generator(model, params)
        generator.append_tokens(np.array(ids, dtype=np.int32))
        out: list[int] = []
        while len(out) < count:
            generator.generate_next_token()
            out.append(int(generator.get_next_tokens()[0]))
            stamps.append(time.perf_counter())
        return out

    return _warm_then_measure(generate, ids, n, load_s)


def work_llama(spec: dict) -> dict:
    """llama.cpp on the GGUF; runs in --llama-python, which need not have kvexport's dependencies."""
    import numpy as np
    from llama_cpp import Llama, __version__

    ids, n, threads = spec["prompt_ids"], spec["new_tokens"], spec["threads"]
    t = time.perf_counter()
    llm = Llama(model_path=spec["gguf"], n_ctx=len(ids) + n + 16, n_batch=len(ids), n_ubatch=len(ids),
                n_threads=threads, n_threads_batch=threads, logits_all=False, verbose=False)
    load_s = time.perf_counter() - t
    vocab = llm.n_vocab()

    def generate(count: int, stamps: list[float]) -> list[int]:
        llm.reset()
        llm.eval(ids)
        out: list[int] = []
        while True:
            # Without logits_all, llama-cpp-python 0.3 no longer copies logits into llm.scores:
            # read the last evaluated token's row from the context.
            logits = np.ctypeslib.as_array(llm._ctx.get_logits_ith(-1), shape=(vocab,))
            out.append(int(np.argmax(logits)))
            stamps.append(time.perf_counter())
            if len(out) == count:
                return out
            llm.eval([out[-1]])

    return {**_warm_then_measure(generate, ids, n, load_s), "llama_cpp_version": __version__}


WORKERS = {"eager": work_eager, "run": work_run, "textllm": work_textllm, "genai": work_genai, "llama": work_llama}


def worker_main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    result = WORKERS[spec["path"]](spec)
    result["peak_rss_mb"] = peak_rss_mb()
    Path(spec["result"]).write_text(json.dumps(result))
    return 0


# ---------------------------------------------------------------- orchestration


def exact_prompt(tokenizer, n: int) -> tuple[str, list[int]]:
    """A text whose encoding (special tokens included) has exactly ``n`` tokens, and those ids; the
    empty text where the tokenizer's special tokens alone are ``n`` (a BOS-only prompt)."""
    from kvexport.errors import InvalidOptionError

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
    from kvexport.models import sources

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


def describe(manifest: dict) -> str:
    quant = manifest.get("quantization") or manifest.get("export_options", {}).get("quantize")
    kind = quant if isinstance(quant, str) else (quant.get("scheme") if isinstance(quant, dict) else None)
    if isinstance(quant, dict) and quant.get("grid") == "symmetric":
        kind += " symmetric"
    kv = f" {manifest['kv_cache']['dtype']}" if manifest.get("kv_cache") else ""
    return f"{manifest['target']} {kind or manifest['dtype']}, cache{kv} {manifest['max_cache_len']}"


def plan_jobs(args, manifests: dict[str, dict], gguf: str | None, llama_version: str | None) -> list[dict]:
    jobs = []
    wanted = args.paths
    if "eager" in wanted:
        jobs.append({"path": "eager", "label": f"eager transformers ({args.model}, float32)", "python": sys.executable})
    for folder, manifest in manifests.items():
        name = Path(folder).name
        if "run" in wanted:
            jobs.append({"path": "run", "label": f"kvexport run · {name} ({describe(manifest)})", "artifact": folder,
                         "python": sys.executable})
            for draft in args.draft if manifest.get("max_draft_tokens") else []:
                drafter = draft if draft == "ngram" else Path(draft).name
                for k in (k for k in args.draft_tokens if k <= manifest["max_draft_tokens"]):
                    jobs.append({"path": "run", "label": f"kvexport run · {name}, drafts {drafter} k={k}",
                                 "artifact": folder, "draft": draft, "draft_tokens": k, "python": sys.executable})
        if "textllm" in wanted and manifest["target"] == "executorch":
            jobs.append({"path": "textllm", "label": f"ExecuTorch TextLLMRunner · {name} ({describe(manifest)})",
                         "artifact": folder, "python": sys.executable})
        if "genai" in wanted and manifest["target"] == "onnx":
            jobs.append({"path": "genai", "label": f"onnxruntime-genai · {name} ({describe(manifest)})",
                         "artifact": folder, "max_length": manifest["max_cache_len"], "python": sys.executable})
    if "genai" in wanted:
        first, manifest = next(iter(manifests.items()))
        for other in args.genai_folder:
            jobs.append({"path": "genai", "label": f"onnxruntime-genai · {other.name} (another exporter's)",
                         "artifact": first, "genai_folder": str(other.resolve()), "max_length": manifest["max_cache_len"],
                         "python": sys.executable})
    if "textllm" in wanted:
        tokenizer_of = next(iter(manifests))
        for pte in args.pte:
            jobs.append({"path": "textllm", "label": f"ExecuTorch TextLLMRunner · {pte.parent.name}/{pte.name}",
                         "artifact": tokenizer_of, "pte": str(pte.resolve()), "python": sys.executable})
    if "llama" in wanted:
        label = f"llama.cpp · {Path(gguf).name if gguf else args.model}"
        job = {"path": "llama", "label": label, "gguf": gguf, "python": args.llama_python}
        if gguf is None:
            job["skipped"] = f"{args.model} is no GGUF file or alias of one"
        elif llama_version is None:
            job["skipped"] = f"not installed (no llama_cpp in {args.llama_python})"
        jobs.append(job)
    return jobs


# A share of the machine's CPUs busy between runs above this means another process shared it.
BUSY_WARNING = 0.10


def cpu_times() -> tuple[int, int] | None:
    """(busy, total) jiffies over all CPUs since boot, from /proc/stat's first line (Linux)."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields[:8]) - idle, sum(fields[:8])  # guest time is already in user


def background_busy(seconds: float = 0.5) -> float | None:
    """Share of the machine's CPU time spent busy over ``seconds`` while no path runs: another
    process's load, which slows whichever path it overlaps (the load average lags by minutes and
    counts the previous run)."""
    before = cpu_times()
    time.sleep(seconds)
    after = cpu_times()
    if before is None or after is None or after[1] <= before[1]:
        return None
    return (after[0] - before[0]) / (after[1] - before[1])


def run_job(job: dict, common: dict, workdir: Path) -> dict:
    spec_path, result_path = workdir / "spec.json", workdir / "result.json"
    result_path.unlink(missing_ok=True)
    spec = {**common, **{k: v for k, v in job.items() if k not in ("label", "python")}, "result": str(result_path)}
    spec_path.write_text(json.dumps(spec))
    t = time.perf_counter()
    proc = subprocess.run([job["python"], str(Path(__file__).resolve()), "--worker", str(spec_path)],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=str(REPO))
    if proc.returncode != 0 or not result_path.is_file():
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return {"error": f"exit {proc.returncode}: " + " | ".join(tail)}
    result = json.loads(result_path.read_text())
    result["wall_s"] = time.perf_counter() - t
    result["prefill_tokens_per_s"] = result["prompt_tokens"] / result["prefill_s"] if result["prefill_s"] else None
    result["decode_tokens_per_s"] = result["decode_steps"] / result["decode_s"] if result["decode_s"] else None
    result["ttft_ms"] = result["ttft_s"] * 1000
    return result


def summarize(values: list[float]) -> dict | None:
    values = [v for v in values if v is not None]
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def finish(jobs: list[dict]) -> None:
    """Per job of one prompt length: the metrics' median and spread, and what it generated compared
    with eager / kvexport run."""
    eager = next((j for j in jobs if j["path"] == "eager" and j.get("runs")), None)
    runs_by_artifact = {j["artifact"]: j for j in jobs if j["path"] == "run" and j.get("runs")}
    for job in jobs:
        ok = [r for r in job.get("runs", []) if "error" not in r]
        job["summary"] = {key: summarize([r.get(key) for r in ok]) for key, *_ in METRICS}
        job["summary"]["load_s"] = summarize([r.get("load_s") for r in ok])
        if not ok:
            continue
        first = ok[0]
        if "speculation" in first:  # the same every run: the drafts depend on the tokens only
            job["speculation"] = first["speculation"]
        eager_ok = [r for r in (eager or {}).get("runs", []) if "error" not in r]
        if "new_ids" in first and eager_ok:
            job["same_tokens_as_eager"] = common_prefix(first["new_ids"], eager_ok[0]["new_ids"])
        if job["path"] == "textllm" and not job.get("pte") and job["artifact"] in runs_by_artifact:
            mine = [r for r in runs_by_artifact[job["artifact"]]["runs"] if "error" not in r]
            if mine:
                from kvexport.runtime.tokenizer import ArtifactTokenizer

                # TextLLMRunner prints special tokens too, so compare with them kept.
                tok = ArtifactTokenizer(Path(job["artifact"]))._tok
                text = tok.decode(mine[0]["new_ids"][: first["new_tokens"]], skip_special_tokens=False)
                job["same_text_as_run"] = first["text"].strip() == text.strip()


def ratios(jobs: list[dict]) -> dict:
    """decode tokens/s medians: every path against eager and against llama.cpp, TextLLMRunner against
    kvexport run on the same .pte."""
    def med(job, key="decode_tokens_per_s"):
        s = job.get("summary", {}).get(key)
        return s["median"] if s else None

    out: dict = {"decode_vs_eager": {}, "decode_vs_llama": {}, "run_vs_textllm": {}, "run_vs_textllm_by_round": {}}
    for key, path in (("decode_vs_eager", "eager"), ("decode_vs_llama", "llama")):
        base = next((j for j in jobs if j["path"] == path), None)
        if base and med(base):
            for job in jobs:
                if job is not base and med(job):
                    out[key][job["label"]] = med(job) / med(base)
    for job in jobs:
        if job["path"] == "textllm" and not job.get("pte") and med(job):
            run = next((j for j in jobs if j["path"] == "run" and j.get("artifact") == job["artifact"]), None)
            if run and med(run):
                out["run_vs_textllm"][job["artifact"]] = med(run) / med(job)
                paired = _by_round(run, job)
                if paired:
                    out["run_vs_textllm_by_round"][job["artifact"]] = paired
    return out


def _by_round(run: dict, textllm: dict) -> float | None:
    """The median of each round's own ratio, run / TextLLMRunner decode tokens/s: a round runs the two
    back to back, so a spell of the host's slower speed, which can catch one path's runs more than
    the other's, mostly cancels (the ratio of medians above does not pair them)."""
    pairs = [(a.get("decode_tokens_per_s"), b.get("decode_tokens_per_s"))
             for a, b in zip(run.get("runs", []), textllm.get("runs", []))]
    ratios = [a / b for a, b in pairs if a and b]
    return statistics.median(ratios) if ratios else None


def cell(summary: dict | None, digits: int) -> str:
    if not summary:
        return "–"
    fmt = f"{{:.{digits}f}}"
    if summary["n"] == 1:
        return fmt.format(summary["median"])
    return f"{fmt.format(summary['median'])} ({fmt.format(summary['min'])}–{fmt.format(summary['max'])})"


def markdown(report: dict) -> str:
    m = report["machine"]
    p = report["protocol"]
    features = " ".join(m.get("cpu_features", []))
    machine = f"{m['cpu']} ({m['cpus']} CPUs{'; ' + features if features else ''})"
    lengths = " / ".join(str(n) for n in p["prompt_tokens"])
    lines = [
        f"{report['date']}, {machine}, load average {m['load_before']} before / "
        f"{m['load_after']} after; {p['threads']} threads, {lengths}-token prompt, "
        f"{p['new_tokens']} new tokens, {p['repeats']} runs per path (median (min–max)).",
        *busy_lines(m.get("background_busy")),
    ]
    for context in report["contexts"]:
        if len(report["contexts"]) > 1:
            lines += ["", f"{context['prompt_tokens']}-token prompt:"]
        lines += ["", *context_table(context, p["new_tokens"])]
    if report.get("traffic"):
        lines += ["", *traffic_table(report["traffic"], p["prompt_tokens"])]
    return "\n".join(lines) + "\n"


def context_table(context: dict, new_tokens: int) -> list[str]:
    """One prompt length's table: every path's metrics, its decode against eager's and llama.cpp's."""
    lines = [
        "| path | " + " | ".join(title for _, title, _ in METRICS)
        + " | decode × eager | decode × llama.cpp | tokens = eager |",
        "|---|" + "---:|" * (len(METRICS) + 3),
    ]
    for job in context["paths"]:
        if job.get("skipped"):
            lines.append(f"| {job['label']} | " + " | ".join(["–"] * (len(METRICS) + 3)) + f" |  ← {job['skipped']}")
            continue
        errors = [r["error"] for r in job.get("runs", []) if "error" in r]
        cells = [cell(job["summary"].get(key), digits) for key, _, digits in METRICS]
        for key in ("decode_vs_eager", "decode_vs_llama"):
            ratio = context["ratios"][key].get(job["label"])
            cells.append(f"{ratio:.2f}×" if ratio else "–")
        same = job.get("same_tokens_as_eager")
        if same is not None:
            same = f"{same}/{new_tokens}"
        elif job.get("same_text_as_run") is not None:
            same = "text = run" if job["same_text_as_run"] else "text ≠ run"
        spec = job.get("speculation")
        label = job["label"] + (f", {spec['acceptance']:.0%} of drafts accepted" if spec else "")
        row = f"| {label} | " + " | ".join(cells) + f" | {same or '–'} |"
        if errors:
            row += f"  ← {len(errors)} failed: {errors[0][:200]}"
        lines.append(row)
    by_round = context["ratios"].get("run_vs_textllm_by_round", {})
    for artifact, r in context["ratios"]["run_vs_textllm"].items():
        paired = f" (median of the rounds' own ratios: {by_round[artifact]:.3f})" if artifact in by_round else ""
        lines.append(f"\nkvexport run / TextLLMRunner decode tok/s on {Path(artifact).name}: {r:.3f}{paired}")
    return lines


def traffic_table(traffic: dict, lengths: list[int]) -> list[str]:
    """Decode tokens/s by prompt length, each beside its memory-traffic limit and the share reached."""
    lines = [
        "decode tok/s by prompt length / the memory-traffic limit there (the bytes a step reads over the "
        "bandwidth reached at the shortest) (share of it):",
        "",
        "| path | " + " | ".join(f"{n} tokens" for n in lengths) + " |",
        "|---|" + "---:|" * len(lengths),
    ]
    for label, by_length in traffic.items():
        cells = []
        for n in lengths:
            t = by_length.get(n)
            cells.append(f"{t['decode_tokens_per_s']:.1f} / {t['limit_tokens_per_s']:.1f} ({t['share_of_limit']:.0%})"
                         if t else "–")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines


def busy_lines(busy: dict | None) -> list[str]:
    """The header's line on other load, sampled for half a second before every run."""
    if not busy:
        return []
    line = (f"CPUs busy between runs (other processes): median {busy['median']:.0%}, "
            f"max {busy['max']:.0%}.")
    if busy["max"] > BUSY_WARNING:
        line += (" **Warning: the machine was not idle; another process shared the CPUs during some runs, "
                 "so these figures are not comparable with an idle run.**")
    return ["", line]


def _lengths(text: str) -> list[int]:
    """``--prompt-tokens``: one length or several, comma-separated, each once, in increasing order."""
    try:
        lengths = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        lengths = []
    if not lengths:
        raise argparse.ArgumentTypeError(f"{text!r} is not a length or comma-separated lengths (128,1024,4096)")
    return lengths


def parse_args(argv):
    from kvexport.runtime.options import OneLineParser  # here: the workers run this file without kvexport

    parser = OneLineParser(prog="kvexport bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="the model the artifacts come from (alias, preset, folder, .gguf): eager and llama.cpp run it")
    parser.add_argument("artifacts", nargs="+", type=Path, help="kvexport artifact folders (any target, dtype)")
    parser.add_argument("--prompt-tokens", type=_lengths, default=[128],
                        help="prompt length, or several comma-separated (128,1024,4096) [default: 128]")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--paths", default=",".join(PATHS), help=f"comma-separated subset of {','.join(PATHS)}")
    parser.add_argument("--llama-python", default=sys.executable, help="interpreter that has llama_cpp [default: this one]")
    parser.add_argument("--pte", type=Path, action="append", default=[],
                        help="another exporter's .pte of MODEL, run through TextLLMRunner (repeatable)")
    parser.add_argument("--genai-folder", type=Path, action="append", default=[],
                        help="another exporter's onnxruntime-genai folder of MODEL, run through genai (repeatable)")
    parser.add_argument("--draft", action="append", default=[], metavar="ngram|ARTIFACT",
                        help="speculative kvexport run of each artifact exported with --max-draft-tokens: drafts from "
                        "prompt lookup (ngram) or this artifact (repeatable)")
    parser.add_argument("--draft-tokens", type=_lengths, default=[4], metavar="K[,K...]",
                        help="with --draft: tokens drafted per verification, or several [default: 4]")
    parser.add_argument("--prompt-file", type=Path,
                        help="the prompt: this file's text as it is (its length replaces --prompt-tokens)")
    parser.add_argument("--json", type=Path, help="write the full report here")
    parser.add_argument("--markdown", type=Path, help="write the table here too")
    args = parser.parse_args(argv)
    args.paths = [p.strip() for p in args.paths.split(",") if p.strip()]
    unknown = set(args.paths) - set(PATHS)
    if unknown:
        parser.error(f"unknown --paths {', '.join(sorted(unknown))}; choose from {', '.join(PATHS)}")
    if min(*args.prompt_tokens, args.new_tokens, args.repeats, args.threads) < 1:
        parser.error("--prompt-tokens, --new-tokens, --repeats and --threads must be at least 1")
    if not args.artifacts:
        parser.error("give at least one artifact folder (its tokenizer makes the prompt)")
    for pte in args.pte:
        if not pte.is_file():
            parser.error(f"--pte {pte}: no such file")
    for folder in args.genai_folder:
        if not (folder / "genai_config.json").is_file():
            parser.error(f"--genai-folder {folder}: no genai_config.json there")
    for draft in args.draft:
        if draft != "ngram" and not (Path(draft) / "kvexport.json").is_file():
            parser.error(f"--draft {draft}: give ngram or a kvexport artifact folder")
    if args.prompt_file is not None and not args.prompt_file.is_file():
        parser.error(f"--prompt-file {args.prompt_file}: no such file")
    return args


def main(argv=None) -> int:
    if argv is None and len(sys.argv) == 3 and sys.argv[1] == "--worker":
        return worker_main(sys.argv[2])
    args = parse_args(argv)
    from kvexport.artifact.manifest import read_manifest
    from kvexport.outputs import check_writable, write_text
    from kvexport.runtime.generation import check_fits
    from kvexport.runtime.tokenizer import ArtifactTokenizer

    for path, option in ((args.json, "--json"), (args.markdown, "--markdown")):  # before the runs, not after
        if path is not None:
            check_writable(path, option)

    manifests = {str(Path(a).resolve()): read_manifest(Path(a)) for a in args.artifacts}
    tokenizer = ArtifactTokenizer(Path(next(iter(manifests))))  # the model's: every artifact has the same
    if args.prompt_file is not None:
        text = args.prompt_file.read_text()
        args.prompt_tokens = [len(tokenizer.encode(text))]
        prompts = {args.prompt_tokens[0]: (text, tokenizer.encode(text))}
    else:
        prompts = {n: exact_prompt(tokenizer, n) for n in args.prompt_tokens}
    for manifest in manifests.values():
        check_fits(max(args.prompt_tokens), args.new_tokens, manifest["max_cache_len"])
    gguf = gguf_of(args.model) if "llama" in args.paths else None
    llama_version = llama_available(args.llama_python) if gguf else None
    contexts = {n: plan_jobs(args, manifests, gguf, llama_version) for n in args.prompt_tokens}
    for n, jobs in contexts.items():
        for job in jobs:
            job["prompt_text"], job["prompt_ids"] = prompts[n]
    common = {"model": args.model, "new_tokens": args.new_tokens, "threads": args.threads}
    load_before = " ".join(f"{x:.2f}" for x in os.getloadavg())
    started = time.strftime("%Y-%m-%d %H:%M %Z")
    with tempfile.TemporaryDirectory(prefix="kvexport-bench-") as tmp:
        for repeat in range(args.repeats):
            for n, jobs in contexts.items():
                for job in jobs:
                    if job.get("skipped"):
                        continue
                    busy = background_busy()
                    result = {**run_job(job, common, Path(tmp)), "background_busy": busy}
                    job.setdefault("runs", []).append(result)
                    shown = "error: " + result["error"] if "error" in result else ", ".join(
                        f"{title} {'–' if result.get(key) is None else f'{result[key]:.{digits}f}'}"
                        for key, title, digits in METRICS)
                    where = f" ({n}-token prompt)" if len(contexts) > 1 else ""
                    print(f"[{repeat + 1}/{args.repeats}] {job['label']}{where}: {shown}", file=sys.stderr, flush=True)
    for jobs in contexts.values():
        finish(jobs)
    from kvexport.runtime.cpu import cpu_info

    cpu, features = cpu_info()
    every_run = [r for jobs in contexts.values() for job in jobs for r in job.get("runs", [])]
    report = {
        "date": started,
        "machine": {"cpu": cpu, "cpu_features": features, "cpus": os.cpu_count(), "load_before": load_before,
                    "load_after": " ".join(f"{x:.2f}" for x in os.getloadavg()),
                    "background_busy": summarize([r.get("background_busy") for r in every_run]),
                    "python": platform.python_version()},
        "protocol": {"prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens, "repeats": args.repeats,
                     "threads": args.threads, "warmup_new_tokens": WARMUP_NEW_TOKENS},
        "model": args.model,
        "llama_cpp": llama_version,
        "contexts": [
            {"prompt_tokens": n, "prompt_text": prompts[n][0], "ratios": ratios(jobs),
             "paths": [{k: v for k, v in job.items() if k not in ("python", "prompt_ids", "prompt_text")} for job in jobs]}
            for n, jobs in contexts.items()
        ],
    }
    if len(contexts) > 1:
        report["traffic"] = traffic_by_path(contexts, manifests, args.new_tokens)
    table = markdown(report)
    print(table)
    if args.json:
        write_text(args.json, json.dumps(report, indent=1), "--json")
    if args.markdown:
        write_text(args.markdown, table, "--markdown")
    return 0


def traffic_by_path(contexts: dict[int, list[dict]], manifests: dict[str, dict], new_tokens: int) -> dict:
    """For each path that runs a kvexport artifact (not another exporter's program, not eager or
    llama.cpp, whose bytes kvexport does not know, not a speculative run, whose steps each read the
    weights once for several tokens): its decode by prompt length beside the memory-traffic limit there."""
    from .traffic import limits

    decode = {}  # label -> {prompt length: decode tokens/s}
    for n, jobs in contexts.items():
        for job in jobs:
            if (job.get("skipped") or job.get("pte") or job.get("genai_folder") or job.get("draft")
                    or job.get("artifact") not in manifests):
                continue
            summary = job.get("summary", {}).get("decode_tokens_per_s")
            decode.setdefault(job["label"], (job["artifact"], {}))[1][n] = summary["median"] if summary else None
    return {label: limits(manifests[artifact], by_length, new_tokens) for label, (artifact, by_length) in decode.items()}


if __name__ == "__main__":
    sys.exit(main())
