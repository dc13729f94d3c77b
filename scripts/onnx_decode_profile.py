"""Where an ONNX artifact's decode step goes, by module, at several positions: ONNX Runtime's own
profiler over kvexport's runner, each node's time summed by the model module it came from (the
exporter's ``pkg.torch.onnx.name_scopes``: ``layers.3.linear_attn``, ``layers.3.mlp``, ...).

    python scripts/onnx_decode_profile.py FOLDER [--positions 128,4000] [--steps 16] [--threads 2]

For each position P: a prompt of P token ids, then ``--steps`` one-token decode calls; the table
gives each kind of module's milliseconds per decode step (the mean over those calls) and its
share of the step, so one sees which part grows with the position. Nodes ONNX Runtime made by
fusing others have no module and count as ``fused``. A timing: compare within one run.
"""

import argparse
import collections
import json
import re
import tempfile
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

from kvexport.artifact.manifest import read_manifest
from kvexport.runtime.onnx_program import OnnxProgram


def module_kinds(model_path: Path) -> dict[str, str]:
    """Node name -> the kind of module it came from (``linear_attn``, ``self_attn``, ``mlp``, ...),
    ``layers`` for a layer's own norms and residuals, ``model`` for what is outside the layers."""
    kinds = {}
    for node in onnx.load(str(model_path), load_external_data=False).graph.node:
        scopes = next((p.value for p in node.metadata_props if p.key == "pkg.torch.onnx.name_scopes"), "[]")
        scopes = json.loads(scopes.replace("'", '"'))
        # The scope of a layer's module: "model.model.layers.3.linear_attn" -> "linear_attn".
        inner = [re.sub(r"^.*\.layers\.\d+\.", "", s) for s in scopes if re.search(r"\.layers\.\d+\.", s)]
        in_layer = any(re.search(r"\.layers\.\d+$", s) for s in scopes)
        kinds[node.name] = inner[0].split(".")[0] if inner else "layers" if in_layer else "model"
    return kinds


def profile(folder: Path, position: int, steps: int, threads: int) -> dict[str, float]:
    """Milliseconds per decode step by module kind, after a prompt of ``position`` ids."""
    manifest = read_manifest(folder)
    kinds = module_kinds(folder / manifest.program)
    plain_options = ort.SessionOptions
    with tempfile.TemporaryDirectory() as tmp:

        def profiled_options():
            options = plain_options()
            options.enable_profiling = True
            options.profile_file_prefix = str(Path(tmp) / "ort")
            return options

        ort.SessionOptions = profiled_options  # OnnxProgram makes its own session
        try:
            program = OnnxProgram(folder, manifest, "cpu", threads=threads)
        finally:
            ort.SessionOptions = plain_options
        ids = np.random.default_rng(0).integers(0, manifest.vocab_size, position + steps).tolist()
        program.forward(ids[:position], 0)
        for i in range(steps):
            program.forward([ids[position + i]], position + i)
        events = json.loads(Path(program._session.end_profiling()).read_text())
    runs = sorted((e for e in events if e.get("name") == "model_run"), key=lambda e: e["ts"])[-steps:]
    per_kind: dict[str, float] = collections.defaultdict(float)
    for event in events:
        if event.get("cat") != "Node" or not event["name"].endswith("_kernel_time"):
            continue
        if not any(run["ts"] <= event["ts"] <= run["ts"] + run["dur"] for run in runs):
            continue
        node = event["name"].removesuffix("_kernel_time")
        per_kind[kinds.get(node, "fused")] += event["dur"] / 1000 / steps
    per_kind["step (wall)"] = sum(run["dur"] for run in runs) / 1000 / steps
    return dict(per_kind)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--positions", default="128,4000")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    positions = [int(p) for p in args.positions.split(",")]
    results = {p: profile(args.folder, p, args.steps, args.threads) for p in positions}
    kinds = {k for r in results.values() for k in r if k != "step (wall)"}
    kinds = sorted(kinds, key=lambda k: -results[positions[0]].get(k, 0))
    print("| module | " + " | ".join(f"ms/step at {p} (share)" for p in positions) + " |")
    print("|---|" + "---:|" * len(positions))
    for kind in [*kinds, "step (wall)"]:
        cells = []
        for p in positions:
            ms = results[p].get(kind, 0.0)
            cells.append(f"{ms:.2f} ({ms / results[p]['step (wall)']:.0%})")
        print(f"| {kind} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
