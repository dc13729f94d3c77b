"""What a decode step reads from memory, and the decode speed that traffic allows at each context.

A step reads every weight once (the program's files; an untied embedding table, of which a step
reads one row, is counted whole) and, in every layer that holds keys and values, the rows it attends
to: every position so far in a full layer, at most the window in a ring, none in a layer that reads
another layer's cache. Convolution and recurrent states are left out (a few KiB a layer, the same
at any context).

Decode bound by memory traffic runs at bandwidth / bytes a step reads. ``limits`` takes the
bandwidth a path reached at its shortest context and gives, at each longer one, the speed it would
have if only the bytes it reads grew: a path far below its limit there spends its time on
something else than reading (kernels that read rows more than once, threads left idle).

Paths that run no kvexport artifact (eager transformers, another exporter's ``.pte`` or genai
folder) read the same model: their weights are their own (the loaded parameters, the program's
files), their cache rows those of a kvexport artifact of the model, in float32, as eager and the
other exporters' CPU programs keep them.
"""

from __future__ import annotations

from pathlib import Path

from ..artifact.manifest import Manifest
# The program's files: what a step reads its weights from.
_PROGRAM_SUFFIXES = (".pte", ".ptd", ".onnx", ".data")
_KV_KINDS = ("static", "ring")


def weight_bytes(manifest: Manifest) -> int:
    """Bytes of the artifact's program and weights files, as its manifest lists them."""
    return sum(entry.bytes for name, entry in manifest.files.items() if Path(name).suffix in _PROGRAM_SUFFIXES)


def other_program_bytes(program: Path) -> int:
    """Bytes of another exporter's program files: a ``.pte`` and the ``.ptd`` of the same name beside
    it, or a genai folder's ONNX graphs and their external data."""
    if program.is_file():
        return sum(f.stat().st_size for f in (program, program.with_suffix(".ptd")) if f.is_file())
    return sum(f.stat().st_size for f in program.iterdir() if f.is_file() and f.suffix in _PROGRAM_SUFFIXES)


def cache_bytes_read(manifest: Manifest, positions: int, element_bytes: int | None = None) -> int:
    """Bytes of keys and values a decode step attends to with ``positions`` positions so far, at the
    cache's own bytes per element (``kv_cache_bytes`` over the elements its layers hold: int8 KV's
    scales included), or at ``element_bytes`` for another program of the same model."""
    layers = [layer for layer in manifest.layers if layer.cache in _KV_KINDS]
    row = {layer.index: 2 * layer.kv_heads * layer.head_dim for layer in layers}
    held = sum(row[layer.index] * layer.slots for layer in layers)
    if not held:
        return 0
    read = sum(row[layer.index] * min(positions, layer.slots) for layer in layers)
    return read * element_bytes if element_bytes else round(manifest.kv_cache_bytes * read / held)


def limits(manifest: Manifest, decode_by_context: dict[int, float], new_tokens: int, *,
           weights: int | None = None, element_bytes: int | None = None) -> dict[int, dict]:
    """Per context (prompt tokens): the measured decode tokens/s, the traffic limit and the measured
    share of it. A decode step of a generation after a ``P``-token prompt attends to ``P + new_tokens / 2``
    positions on average. ``weights`` and ``element_bytes`` describe another program of the manifest's
    model (its weights' bytes, its cache's bytes per element); by default the artifact's own."""
    measured = {n: speed for n, speed in decode_by_context.items() if speed}
    if not measured:
        return {}
    shortest = min(measured)
    weights = weight_bytes(manifest) if weights is None else weights
    read = {n: weights + cache_bytes_read(manifest, n + new_tokens // 2, element_bytes) for n in measured}
    bandwidth = measured[shortest] * read[shortest]
    out = {}
    for n, speed in sorted(measured.items()):
        limit = bandwidth / read[n]
        out[n] = {"decode_tokens_per_s": speed, "limit_tokens_per_s": limit, "share_of_limit": speed / limit,
                  "step_bytes": read[n]}
    return out
