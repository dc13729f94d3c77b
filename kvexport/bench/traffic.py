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


def cache_bytes_read(manifest: Manifest, positions: int) -> int:
    """Bytes of keys and values a decode step attends to with ``positions`` positions so far, at the
    cache's own bytes per element (``kv_cache_bytes`` over the elements its layers hold: int8 KV's
    scales included)."""
    layers = [layer for layer in manifest.layers if layer.cache in _KV_KINDS]
    row = {layer.index: 2 * layer.kv_heads * layer.head_dim for layer in layers}
    held = sum(row[layer.index] * layer.slots for layer in layers)
    if not held:
        return 0
    read = sum(row[layer.index] * min(positions, layer.slots) for layer in layers)
    return round(manifest.kv_cache_bytes * read / held)


def step_bytes(manifest: Manifest, positions: int) -> int:
    return weight_bytes(manifest) + cache_bytes_read(manifest, positions)


def limits(manifest: Manifest, decode_by_context: dict[int, float], new_tokens: int) -> dict[int, dict]:
    """Per context (prompt tokens): the measured decode tokens/s, the traffic limit and the measured
    share of it. A decode step of a generation after a ``P``-token prompt attends to ``P + new_tokens / 2``
    positions on average."""
    measured = {n: speed for n, speed in decode_by_context.items() if speed}
    if not measured:
        return {}
    shortest = min(measured)
    read = {n: step_bytes(manifest, n + new_tokens // 2) for n in measured}
    bandwidth = measured[shortest] * read[shortest]
    out = {}
    for n, speed in sorted(measured.items()):
        limit = bandwidth / read[n]
        out[n] = {"decode_tokens_per_s": speed, "limit_tokens_per_s": limit, "share_of_limit": speed / limit,
                  "step_bytes": read[n]}
    return out
