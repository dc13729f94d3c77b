"""bench's report as markdown: a header on the machine and its load, a table per prompt length,
and decode by length beside its memory-traffic limit."""

from __future__ import annotations

from pathlib import Path

from .machine_load import BUSY_WARNING
from .summary import METRICS


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
    if m.get("gpu"):
        machine += f", on the GPU {m['gpu']}"
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
