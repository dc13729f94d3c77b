"""What an export will need, said before the weights load: memory at its peak and disk for the
artifact, from the config and the options; an export the machine cannot hold (its container's
memory limit included) is refused in one line.

The peak is the process's resident memory: what the runtime libraries take, plus the weights as
the export holds them, plus the KV cache. How much of the weights it holds at once is measured per
target and per scheme (docs/performance.md#export-memory): a float export of a preset holds the model
in its dtype, and lowering a copy of about a quarter of it on ExecuTorch; ``--quantize 8da4w`` loads
a bfloat16 checkpoint's linear weights (and its embedding tables, with ``--quantize-embedding``) in
bfloat16 and quantizes them before export, from a checkpoint reading each just before it is
quantized; a float export from a checkpoint leaves the large weights in it and reads each as it is
written (ONNX) or serialized (ExecuTorch; ``models/deferred_weights``), and ONNX's int4 rewrites the
written graph's weights one at a time.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from ..choices import EmbeddingScheme, Target
from ..errors import InvalidOptionError
from .weight_grids import BLOCK

# What the libraries take before any weight: the tiny matrix's exports measure it.
BASE_BYTES = {Target.EXECUTORCH: 600 * 2**20, Target.ONNX: 680 * 2**20}
# The weights held at the peak, in multiples of the model's bytes in the export dtype.
WEIGHT_FACTOR = {Target.EXECUTORCH: 1.25, Target.ONNX: 1.0}
# The bytes of a 4-bit weight in the artifact, its block's scale and offset included.
INT4_BYTES = 0.625
# A container's memory limit: cgroup v2's, then v1's ("max" or a huge number where there is none).
CGROUP_MEMORY_LIMITS = (Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"))


@dataclass(frozen=True)
class Parameters:
    """The model's parameters (each counted once: a tied lm_head is its embedding) by kind."""

    linear: int  # weights of linear layers 8da4w quantizes (input width a multiple of the group)
    embedding: int
    other: int  # norms, biases, the linear weights left in float
    largest: dict[str, int]  # kind ("linear", "embedding", "other") -> its largest parameter's

    @property
    def total(self) -> int:
        return self.linear + self.embedding + self.other


def count_parameters(config) -> Parameters:
    """Counted on the meta device: no memory, no weights."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    seen: set[int] = set()
    counts = {"linear": 0, "embedding": 0, "other": 0}
    largest = dict.fromkeys(counts, 0)
    for module in model.modules():
        for param in module.parameters(recurse=False):
            if id(param) in seen:
                continue
            seen.add(id(param))
            if isinstance(module, torch.nn.Embedding):
                kind = "embedding"
            elif isinstance(module, torch.nn.Linear) and param is module.weight and module.in_features % BLOCK == 0:
                kind = "linear"
            else:
                kind = "other"
            counts[kind] += param.numel()
            largest[kind] = max(largest[kind], param.numel())
    return Parameters(**counts, largest=largest)


@dataclass(frozen=True)
class Footprint:
    peak_bytes: int  # the export's peak resident memory
    artifact_bytes: int  # the artifact's files
    staging_bytes: int  # disk the export writes at its fullest (the artifact, and what it stages beside it)

    def summary(self) -> str:
        return f"needs about {size(self.peak_bytes)} of memory and {size(self.staging_bytes)} of disk"


def footprint(plan, parameters: Parameters, checkpoint_bytes_per_value: int = 2) -> Footprint:
    """``plan``: an ``ExportPlan``; ``checkpoint_bytes_per_value``: the bytes of a value in the
    checkpoint's dtype (a bfloat16 checkpoint's linear weights load in bfloat16 for 8da4w)."""
    target, dtype_bytes = plan.options.target, plan.dtype_bytes
    quantization = plan.options.quantization
    floats = parameters.total * dtype_bytes
    # The artifact's bytes a value: 4-bit linear weights with a scale (and an offset) per block of
    # 32; ONNX's int4 keeps the embedding table in 8 bits.
    linear = INT4_BYTES if quantization.scheme else dtype_bytes
    embedding = {EmbeddingScheme.INT8: 1, EmbeddingScheme.INT4: INT4_BYTES}.get(quantization.embedding, dtype_bytes)
    if quantization.scheme and target == Target.ONNX:
        embedding = 1
    artifact = int(parameters.linear * linear + parameters.embedding * embedding + parameters.other * dtype_bytes)
    held = int(floats * WEIGHT_FACTOR[target])  # the weights at the peak
    if plan.defers_weights and quantization and target == Target.EXECUTORCH:
        # Quantized before export, each weight read from the checkpoint (in its stored dtype) just
        # before it is quantized, and widened to float32 for it; torchao holds 4-bit values a byte
        # each. The weights left in float are read after, in the export dtype. Then lowering.
        compact = ("linear", "embedding") if quantization.embedding else ("linear",)
        quantized = sum(getattr(parameters, kind) for kind in compact)
        kept = sum(getattr(parameters, kind) * dtype_bytes for kind in ("embedding", "other") if kind not in compact)
        read = max(parameters.largest[kind] for kind in compact) * (checkpoint_bytes_per_value + dtype_bytes)
        held = max(int(quantized + kept + read), int(artifact * WEIGHT_FACTOR[target]))
    elif plan.defers_weights and target == Target.EXECUTORCH:
        # The large weights stay in the checkpoint, each read as XNNPACK serializes it (converted
        # from its stored dtype), which copies it once more before it goes to disk; a table the
        # lookup reads outside the delegate is read again before the program is written. The other
        # weights load.
        table = parameters.largest["embedding"] * (checkpoint_bytes_per_value + 2 * dtype_bytes)
        held = int(parameters.other * dtype_bytes + max(table, parameters.largest["linear"] * 2 * dtype_bytes))
    elif plan.defers_weights:
        # The large weights stay in the checkpoint, each read as it is written: a table in its
        # stored dtype, then converted; a linear weight converted, then transposed (the graph
        # stores it so). The other weights load.
        table = parameters.largest["embedding"] * (checkpoint_bytes_per_value + dtype_bytes)
        held = int(parameters.other * dtype_bytes + max(table, parameters.largest["linear"] * 2 * dtype_bytes))
        if quantization.scheme:  # int4's rewrite: a float weight read, its 8-bit values and their working copy
            largest = max(parameters.largest["linear"], parameters.largest["embedding"])
            held = max(held, int(parameters.other * dtype_bytes + largest * (dtype_bytes + 2)))
    elif quantization.scheme and target == Target.EXECUTORCH:  # quantized before export, from compact weights
        # Loaded with the linear weights (and the embedding tables, when they are quantized too) in
        # the checkpoint's dtype, read as stored; the largest of the other weights read, then
        # converted. Then each weight quantized in turn (torchao holds 4-bit values a byte each),
        # the one it replaces freed: no more than the load.
        compact = ("linear", "embedding") if quantization.embedding else ("linear",)
        loaded = sum(getattr(parameters, kind) * checkpoint_bytes_per_value for kind in compact)
        loaded += sum(getattr(parameters, kind) * dtype_bytes for kind in ("embedding", "other") if kind not in compact)
        converted = max(parameters.largest[kind] for kind in ("embedding", "other") if kind not in compact)
        loaded += converted * (checkpoint_bytes_per_value + dtype_bytes)
        held = max(int(loaded), int(artifact * WEIGHT_FACTOR[target]))
    peak = BASE_BYTES[target] + plan.kv_cache_bytes + plan.state_bytes + held
    # ExecuTorch's serialized weights wait in the staged folder until model.ptd is written; ONNX's
    # int4 writes its data file beside the float one.
    staging = 2 * artifact if target == Target.EXECUTORCH else artifact + (floats if quantization.scheme else 0)
    return Footprint(peak, artifact, staging)


def total_memory_bytes() -> int | None:
    """The memory this process may use: the machine's, or its container's limit where that is less
    (None where the OS says neither)."""
    try:
        physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        physical = None
    return min((m for m in (physical, *map(_cgroup_limit, CGROUP_MEMORY_LIMITS)) if m), default=None)


def _cgroup_limit(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() and int(text) < 2**60 else None


def refuse_a_cache_beyond_memory(plan) -> None:
    """A KV cache larger than the machine's memory cannot be exported (nor run): refuse it before the
    weights load, with the largest --max-cache-len that fits."""
    memory = total_memory_bytes()
    if not memory or plan.kv_cache_bytes <= memory:
        return
    low, high = 0, plan.max_cache_len  # the cache grows with max_cache_len: the largest that fits
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if dataclasses.replace(plan, max_cache_len=mid).kv_cache_bytes <= memory else (low, mid - 1)
    raise InvalidOptionError(
        f"{_given(plan)}: the KV cache alone needs {size(plan.kv_cache_bytes)}, more than this machine's {size(memory)} of "
        f"memory; --max-cache-len {low} is the most whose cache fits, and the weights need room too"
    )


def refuse_what_the_machine_cannot_hold(plan, needs: Footprint) -> None:
    """Refuse an export whose estimated peak passes the machine's memory, or whose files pass the
    free disk where they are written."""
    memory = total_memory_bytes()
    if memory and needs.peak_bytes > memory:
        raise InvalidOptionError(
            f"exporting {plan.options.model} ({plan.options.dtype} -> {plan.options.target}) needs about "
            f"{size(needs.peak_bytes)} of memory at its peak, more than this machine's {size(memory)}: use a machine "
            f"with more, or {_holds_less(plan)}"
        )
    free = shutil.disk_usage(_existing_parent(plan.out)).free
    if needs.staging_bytes > free:
        raise InvalidOptionError(
            f"exporting {plan.options.model} writes about {size(needs.staging_bytes)} to disk, more than the {size(free)} "
            f"free where {plan.out} is written: free some disk or write it elsewhere (-o)"
        )


def _holds_less(plan) -> str:
    """What makes the same export hold less at its peak, where anything does."""
    o = plan.options
    if o.target == Target.EXECUTORCH and not o.quantization.scheme:
        return "quantize (--quantize 8da4w loads a bfloat16 checkpoint's linear weights as they are, then 4 bits)"
    if plan.defers_weights:
        return "a smaller --max-cache-len (the KV cache's share)"
    if o.target == Target.ONNX and plan.source.kind != "preset":
        return "export with a float KV cache (each weight is then read from the checkpoint as it is written)"
    if o.dtype == "float32":
        return "export in --dtype float16 (half the weights' bytes)"
    return "a smaller --max-cache-len (the KV cache's share)"


def _existing_parent(path: Path) -> Path:
    path = Path(path).absolute()
    while not path.exists():
        path = path.parent
    return path


def _given(plan) -> str:
    return f"--max-cache-len {plan.max_cache_len}" if plan.options.max_cache_len else f"max_cache_len {plan.max_cache_len} (the default)"


def size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:,.1f} {unit}"
    return f"{n} bytes"
