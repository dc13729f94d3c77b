#!/usr/bin/env python3
"""Where an ExecuTorch artifact's decode step goes: time per kernel from ExecuTorch's ETDump.

    python scripts/profile_pte.py ARTIFACT [--prompt-tokens 128] [--new-tokens 128] [--threads 2]
        [--top 25] [--json OUT.json]

Runs the artifact through ``kvexport run``'s loop (the prompt in calls of at most the prefill chunk, then one call per greedy token)
with ExecuTorch's event tracer on, reads the trace with ``executorch.devtools.Inspector`` and prints,
per event, milliseconds per decode step, its share of ``Method::execute`` and calls per step:

- ``Method::execute``: the whole call;
- ``DELEGATE_CALL``: time inside XNNPACK; ``OPERATOR_CALL``: every kernel outside it;
- each kernel outside (``llama::custom_sdpa.out``, ``llama::update_cache.out``, ...);
- XNNPACK's own operators, nested inside the delegate calls, one row per kind (``Fully Connected
  (NC, QD8, F32, QB4W) GEMM``: XNNPACK's "#N", which numbers the operators of a kind within one
  delegate call, is dropped), marked ``delegated``.

A second table lists the slowest single kernels (one operator of the program, e.g. the lm_head's
matmul). The prompt's calls are left out of the figures. The tracer adds its own overhead: read the shares,
and take speeds from kvexport bench.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import warnings
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if (REPO / "kvexport").is_dir() and str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # this checkout's kvexport, not another installed one

from kvexport.bench.bench import exact_prompt  # noqa: E402
from kvexport.bench.workers import set_torch_threads  # noqa: E402
from kvexport.runtime.cpu import THREADS_ENV  # noqa: E402

TOTAL = "Method::execute"
CONTAINERS = {TOTAL, "DELEGATE_CALL", "OPERATOR_CALL"}  # events that hold others
SLOWEST = 10  # single events listed


def trace_decode(folder: Path, prompt_tokens: int, new_tokens: int, threads: int, trace: Path) -> None:
    """Prefill ``prompt_tokens`` of bench's prompt text, decode ``new_tokens`` greedy tokens, and
    write the event trace of every call to ``trace``."""
    from kvexport.errors import InvalidOptionError
    from kvexport.artifact.manifest import read_manifest
    from kvexport.runtime import executorch_program
    from kvexport.runtime.generation import check_fits, generate
    from kvexport.runtime.tokenizer import ArtifactTokenizer

    manifest = read_manifest(folder)
    if manifest.target != "executorch":
        raise InvalidOptionError(
            f"{folder} is a {manifest.target} artifact; profile_pte.py reads ExecuTorch's event trace, "
            "so it takes an --target executorch artifact"
        )
    # The prefill call's token and one per decode call; refused before anything loads.
    check_fits(prompt_tokens, new_tokens + 1, manifest.max_cache_len)
    set_torch_threads(threads)
    os.environ[THREADS_ENV] = str(threads)  # the runner sizes ExecuTorch's threadpool from it
    program = executorch_program.load(folder, manifest, "cpu", trace_events=True)
    _, ids = exact_prompt(ArtifactTokenizer(folder), prompt_tokens)
    generate(program, ids, new_tokens + 1)
    program.write_event_trace(trace)


def decode_events(trace: Path, decode_calls: int) -> list[dict]:
    """Every event that ran once per call, with its mean ms over the last ``decode_calls`` calls (the
    decode steps; the prompt's calls before them, one per prefill chunk, and loading, which ran
    once, are left out)."""
    from executorch.devtools import Inspector

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Output Buffer not found": no tensor dump was asked for
        inspector = Inspector(etdump_path=str(trace))
    timed = [event for block in inspector.event_blocks for event in block.events if event.perf_data is not None]
    calls = max(len(event.perf_data.raw) for event in timed)  # every call runs Method::execute
    events = []
    for event in timed:
        raw = event.perf_data.raw
        if len(raw) == calls:
            events.append({"name": event.name, "ms_per_step": sum(raw[-decode_calls:]) / decode_calls,
                               "delegated": bool(getattr(event, "is_delegated_op", False))})
    return events


def per_kind(events: list[dict]) -> list[dict]:
    """Rows (name, ms per step, calls per step, delegated), slowest first; XNNPACK's operators of
    one kind share a row."""
    totals: dict[tuple, list] = defaultdict(lambda: [0.0, 0])
    for event in events:
        name = re.sub(r" #\d+$", "", event["name"]) if event["delegated"] else event["name"]
        row = totals[name, event["delegated"]]
        row[0] += event["ms_per_step"]
        row[1] += 1
    rows = [{"name": name, "ms_per_step": ms, "calls_per_step": n, "delegated": delegated}
            for (name, delegated), (ms, n) in totals.items()]
    return sorted(rows, key=lambda r: -r["ms_per_step"])


def table(rows: list[dict], total: float, top: int) -> str:
    """Markdown: each row's ms per step, share of the whole call and (when rows have it) calls per step."""
    with_calls = all("calls_per_step" in r for r in rows)
    lines = ["| event | ms / step | share |" + (" calls / step |" if with_calls else "") + " |",
             "|---|---|---|" + ("---|" if with_calls else "") + "---|"]
    for r in rows[:top]:
        calls = f" {r['calls_per_step']} |" if with_calls else ""
        where = "delegated" if r["delegated"] else ""
        lines.append(f"| {r['name']} | {r['ms_per_step']:.3f} | {100 * r['ms_per_step'] / total:.1f}% |{calls} {where} |")
    return "\n".join(lines)


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("artifact", type=Path, help="folder written by kvexport --target executorch")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128, help="decode steps traced (at least 1)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--top", type=int, default=25, help="rows printed (the JSON has them all)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if args.prompt_tokens < 1 or args.new_tokens < 1 or args.threads < 1:
        parser.error("--prompt-tokens, --new-tokens and --threads must be at least 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="kvexport-profile-") as tmp:
        trace = Path(tmp) / "trace.etdp"
        trace_decode(args.artifact, args.prompt_tokens, args.new_tokens, args.threads, trace)
        events = decode_events(trace, args.new_tokens)
    rows = per_kind(events)
    slowest = sorted((e for e in events if e["name"] not in CONTAINERS), key=lambda e: -e["ms_per_step"])
    total = next(r["ms_per_step"] for r in rows if r["name"] == TOTAL)
    print(table(rows, total, args.top))
    print(f"\nSlowest single kernels:\n{table(slowest, total, SLOWEST)}")
    if args.json:
        report = {"artifact": str(args.artifact.resolve()), "prompt_tokens": args.prompt_tokens,
                  "new_tokens": args.new_tokens, "threads": args.threads, "rows": rows,
                  "slowest_events": slowest[:SLOWEST]}
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
