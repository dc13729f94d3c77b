"""What bench's runs add up to: each path's medians and spread, whether it generated eager's
tokens, decode ratios between paths, and decode by prompt length beside its memory-traffic limit."""

from __future__ import annotations

import statistics
from pathlib import Path

from ..artifact.manifest import Manifest
from .traffic import limits, other_program_bytes

METRICS = (  # key, column title, digits
    ("ttft_ms", "TTFT ms", 0),
    ("prefill_tokens_per_s", "prefill tok/s", 0),
    ("decode_tokens_per_s", "decode tok/s", 1),
    ("peak_rss_mb", "peak RSS MB", 0),
)


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


def traffic_by_path(contexts: dict[int, list[dict]], manifests: dict[str, Manifest], new_tokens: int) -> dict:
    """For each path but llama.cpp and the speculative runs (whose steps each read the weights once
    for several tokens): its decode by prompt length beside the memory-traffic limit there. A path of
    another program of the model (eager, another exporter's) reads its own weights and the cache rows
    of the first artifact's layers in float32 (``traffic``'s docstring)."""
    first = next(iter(manifests))
    decode = {}  # label -> (manifest, weights or None, element bytes or None, {prompt length: decode tokens/s})
    for n, jobs in contexts.items():
        for job in jobs:
            if job.get("skipped") or job.get("draft") or job["path"] == "llama":
                continue
            other = job.get("pte") or job.get("genai_folder")
            if job["path"] == "eager":
                run = next((r for r in job.get("runs", []) if r.get("weight_bytes")), None)
                if run is None:
                    continue
                entry = (first, run["weight_bytes"], run["kv_element_bytes"])
            elif other:
                entry = (job["artifact"], other_program_bytes(Path(other)), 4)
            elif job.get("artifact") in manifests:
                entry = (job["artifact"], None, None)
            else:
                continue
            summary = job.get("summary", {}).get("decode_tokens_per_s")
            decode.setdefault(job["label"], (*entry, {}))[3][n] = summary["median"] if summary else None
    return {label: limits(manifests[artifact], by_length, new_tokens, weights=weights, element_bytes=element)
            for label, (artifact, weights, element, by_length) in decode.items()}
