"""Where an ONNX artifact's decode step goes, by module, at several positions: ONNX Runtime's own
profiler over kvexport's runner, each node's time summed by the model module it came from (the
exporter's ``pkg.torch.onnx.name_scopes``: ``layers.3.linear_attn``, ``layers.3.mlp``, ...).

    python scripts/onnx_decode_profile.py FOLDER [--positions 128,4000] [--steps 16] [--threads 2] [--by module|op]

For each position P: a prompt of P token ids, then ``--steps`` one-token decode calls; the table
gives each kind of module's milliseconds per decode step (the mean over those calls) and its
share of the step, so one sees which part grows with the position. Nodes ONNX Runtime made by
fusing others have no module and count as ``fused``. ``--by op``: by the kind of operation
instead, a 4-bit and an 8-bit ``MatMulNBits`` apart, and the nodes ``--quantize int4`` adds to
keep a source's grid (each projection's block sums and offset product) as ``offsets``: what the
exact scheme costs beyond the symmetric one. A timing: compare within one run. The profiler adds
its own time to every node it times, so many small nodes look costlier than they are; take a
step's time from ``kvexport bench``.
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


# The nodes kvexport/exporter/onnx/quantize.py adds for a projection's per-block offsets, by name.
OFFSET_NODES = ("_blocks", "_block_sums", "_offset", "_add_offset")


def op_kinds(model_path: Path) -> dict[str, str]:
    """Node name -> its operation (``MatMulNBits`` with its bits, ``offsets`` for the offset nodes)."""
    kinds = {}
    for node in onnx.load(str(model_path), load_external_data=False).graph.node:
        kind = node.op_type
        if kind == "MatMulNBits":
            bits = next((a.i for a in node.attribute if a.name == "bits"), 4)
            kind = f"MatMulNBits {bits}-bit"
        elif node.name.endswith(OFFSET_NODES):
            kind = "offsets"
        kinds[node.name] = kind
    return kinds


def profile(folder: Path, position: int, steps: int, threads: int, by: str = "module") -> dict[str, float]:
    """Milliseconds per decode step by module kind (or by operation), after a prompt of ``position`` ids."""
    manifest = read_manifest(folder)
    kinds = (op_kinds if by == "op" else module_kinds)(folder / manifest.program)
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
        fused = event.get("args", {}).get("op_name", "fused") if by == "op" else "fused"  # a node ONNX Runtime made
        per_kind[kinds.get(node, fused)] += event["dur"] / 1000 / steps
    per_kind["step (wall)"] = sum(run["dur"] for run in runs) / 1000 / steps
    return dict(per_kind)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--positions", default="128,4000")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--by", choices=("module", "op"), default="module")
    args = parser.parse_args()
    positions = [int(p) for p in args.positions.split(",")]
    results = {p: profile(args.folder, p, args.steps, args.threads, args.by) for p in positions}
    kinds = {k for r in results.values() for k in r if k != "step (wall)"}
    kinds = sorted(kinds, key=lambda k: -results[positions[0]].get(k, 0))
    print(f"| {args.by} | " + " | ".join(f"ms/step at {p} (share)" for p in positions) + " |")
    print("|---|" + "---:|" * len(positions))
    for kind in [*kinds, "step (wall)"]:
        cells = []
        for p in positions:
            ms = results[p].get(kind, 0.0)
            cells.append(f"{ms:.2f} ({ms / results[p]['step (wall)']:.0%})")
        print(f"| {kind} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
