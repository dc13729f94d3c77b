"""One measured generation of one bench path, in a process of its own: ``python workers.py SPEC``.

Run as a script by ``kvexport bench`` (``bench.run_job``), so each path's peak RSS is its own; the
llama.cpp worker runs in ``--llama-python``, which need not have kvexport's dependencies: this module
imports only the standard library at its top, and kvexport's modules inside the worker that needs them.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if __name__ == "__main__":  # as a script, this folder comes first on sys.path: the checkout's root instead
    sys.path[0] = str(REPO)

WARMUP_NEW_TOKENS = 4


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


def set_torch_threads(threads: int) -> None:
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

    set_torch_threads(spec["threads"])
    device = spec.get("device", "cpu")
    t = time.perf_counter()
    model, _ = sources.load_model(sources.resolve(spec["model"]), spec.get("eager_dtype", "float32"))
    model = model.to(device)
    load_s = time.perf_counter() - t
    ids, n = spec["prompt_ids"], spec["new_tokens"]
    greedy_generate(model, ids, WARMUP_NEW_TOKENS)
    stamps: list[float] = []
    t0 = time.perf_counter()
    new_ids = greedy_generate(model, ids, n, on_logits=lambda step, _: stamps.append(time.perf_counter()))
    end = time.perf_counter()
    return {**_timed(ids, n, t0, stamps[0], end, len(new_ids)), "prefill_s": stamps[0] - t0, "load_s": load_s,
            "new_ids": new_ids, "weight_bytes": parameter_bytes(model), "kv_element_bytes": model.dtype.itemsize}


def parameter_bytes(model) -> int:
    """Bytes of a torch model's parameters and buffers, each storage once (a tied lm_head is the
    embedding's)."""
    storages = {}
    for tensor in (*model.parameters(), *model.buffers()):
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def work_run(spec: dict) -> dict:
    from kvexport.artifact.manifest import read_manifest
    from kvexport.runtime.cpu import THREADS_ENV
    from kvexport.runtime.generation import generate
    from kvexport.runtime.programs import load_program

    folder = Path(spec["artifact"])
    manifest = read_manifest(folder)
    os.environ[THREADS_ENV] = str(spec["threads"])  # the runners size their runtime's threads from it
    if manifest.target != "onnx":  # the ONNX runner imports no torch: its peak RSS stays its own
        set_torch_threads(spec["threads"])
    t = time.perf_counter()
    program = load_program(folder, manifest, spec.get("device", "cpu"))
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
    set_torch_threads(spec["threads"])
    set_executorch_threads(spec["threads"])
    register_kernels(manifest)
    from executorch.extension.llm.runner import GenerationConfig, TextLLMRunner

    if spec.get("pte"):
        program, data = Path(spec["pte"]), Path(spec["pte"]).with_suffix(".ptd")
        weights = str(data) if data.is_file() else None
    else:
        program = folder / manifest.program
        weights = str(folder / manifest.weights) if manifest.weights else None
    bos = 1 if manifest.tokenizer_adds_bos else 0  # its tokenizer adds none: the runner prepends them
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
    if spec.get("device") == "cuda":
        config.append_provider("cuda")
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


if __name__ == "__main__":
    sys.exit(worker_main(sys.argv[1]))
