"""``kvexport bench``: its options, its progress lines and its report on the terminal and in files.
What it measures and how is ``kvexport.bench.bench``'s."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

PATHS_HELP = (
    "comma-separated subset of eager (transformers' generate), run (kvexport's runner on each ARTIFACT), "
    "textllm (ExecuTorch's TextLLMRunner on each .pte), genai (onnxruntime-genai on each ONNX folder), "
    "llama (llama.cpp on MODEL's GGUF)"
)


def bench_command(
    model: Annotated[
        str, typer.Argument(metavar="MODEL", help="the model the artifacts come from (alias, preset, folder, .gguf): eager and llama.cpp run it")
    ],
    artifacts: Annotated[list[Path], typer.Argument(metavar="ARTIFACT", help="kvexport artifact folders (any target, dtype)")],
    prompt_tokens: Annotated[
        str, typer.Option(metavar="N[,N...]", help="prompt length, or several comma-separated (128,1024,4096): a table per length and decode by length beside its memory-traffic limit")
    ] = "128",
    new_tokens: Annotated[int, typer.Option(metavar="N", help="greedy tokens each run generates, EOS ignored")] = 128,
    repeats: Annotated[int, typer.Option(metavar="N", help="runs per path, each in a fresh process, interleaved round-robin across paths")] = 3,
    threads: Annotated[int, typer.Option(metavar="N", help="threads every runtime gets (torch, ExecuTorch's threadpool, ONNX Runtime, llama.cpp)")] = 2,
    paths: Annotated[str, typer.Option(metavar="PATH[,PATH...]", help=PATHS_HELP)] = "eager,run,textllm,genai,llama",
    llama_python: Annotated[
        Optional[str], typer.Option(metavar="PYTHON", help="interpreter that has llama_cpp [default: this one]")
    ] = None,
    pte: Annotated[
        Optional[list[Path]], typer.Option(metavar="FILE.pte", help="another exporter's .pte of MODEL, run through TextLLMRunner with the first ARTIFACT's tokenizer (repeatable)")
    ] = None,
    genai_folder: Annotated[
        Optional[list[Path]], typer.Option(metavar="DIR", help="another exporter's onnxruntime-genai folder of MODEL, run through genai (repeatable)")
    ] = None,
    draft: Annotated[
        Optional[list[str]], typer.Option(metavar="ngram|ARTIFACT", help="also run each artifact exported with --max-draft-tokens speculatively, drafting from prompt lookup (ngram) or this artifact (repeatable)")
    ] = None,
    draft_tokens: Annotated[
        str, typer.Option(metavar="K[,K...]", help="with --draft: tokens drafted per verification, or several")
    ] = "4",
    prompt_file: Annotated[
        Optional[Path], typer.Option(metavar="FILE", help="the prompt: this file's text as it is (its length replaces --prompt-tokens)")
    ] = None,
    device: Annotated[str, typer.Option(metavar="cpu|cuda", help="cuda: float16 or bfloat16 ONNX artifacts and eager transformers in their dtype on the GPU (paths eager, run, genai)")] = "cpu",
    json_out: Annotated[Optional[Path], typer.Option("--json", metavar="FILE", help="write the full report here")] = None,
    markdown_out: Annotated[Optional[Path], typer.Option("--markdown", metavar="FILE", help="write the tables here too")] = None,
):
    """Measure eager transformers, kvexport artifacts, ExecuTorch's own runner and llama.cpp in one run:
    TTFT, prefill and decode tokens/s and peak RSS per path, each run in a process of its own
    (docs/performance.md#method)."""
    from ..bench.bench import BenchOptions, prompt_lengths, run_bench
    from ..bench.report import markdown
    from ..bench.summary import METRICS
    from ..outputs import check_writable, write_text

    options = BenchOptions(
        model, artifacts, prompt_lengths(prompt_tokens), new_tokens, repeats, threads,
        [p.strip() for p in paths.split(",") if p.strip()], llama_python or sys.executable, pte or [],
        genai_folder or [], draft or [], prompt_lengths(draft_tokens), prompt_file, device,
    )
    for path, option in ((json_out, "--json"), (markdown_out, "--markdown")):  # before the runs, not after
        if path is not None:
            check_writable(path, option)

    def show(repeat: int, job: dict, prompt_tokens: int, result: dict) -> None:
        shown = "error: " + result["error"] if "error" in result else ", ".join(
            f"{title} {'–' if result.get(key) is None else f'{result[key]:.{digits}f}'}" for key, title, digits in METRICS)
        where = f" ({prompt_tokens}-token prompt)" if len(options.prompt_tokens) > 1 else ""
        print(f"[{repeat + 1}/{options.repeats}] {job['label']}{where}: {shown}", file=sys.stderr, flush=True)

    report = run_bench(options, show)
    table = markdown(report)
    print(table)
    if json_out:
        write_text(json_out, json.dumps(report, indent=1), "--json")
    if markdown_out:
        write_text(markdown_out, table, "--markdown")
