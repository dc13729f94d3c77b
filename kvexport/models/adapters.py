"""Changes made to a model before tracing, where transformers' default code path is one that
``torch.export`` or a target runtime cannot take. Each picks an equivalent computation through a
switch transformers itself offers, so the modeling code still runs unchanged; the eager reference
that ``check`` compares against keeps transformers' defaults.

Keyed on what a model has (e.g. mixture-of-experts layers), not on its family name, so a family
that shares the feature needs no code of its own.
"""

from __future__ import annotations

from torch import nn


def prepare_for_export(model: nn.Module) -> None:
    _experts_as_batched_matmuls(model)


def _experts_as_batched_matmuls(model: nn.Module) -> None:
    """Mixture-of-experts layers (GPT-OSS, Mixtral, Qwen3-MoE, ...).

    transformers' default experts implementation, ``grouped_mm``, runs on the CPU through its own
    custom op (``transformers::grouped_mm_fallback``), which no target runtime has a kernel for;
    its ``eager`` one loops over the experts a call hits (data-dependent control flow).
    ``batched_mm`` gathers each token's top-k expert weights and multiplies in one batched matmul:
    plain aten ops and no shape that depends on the routing.
    """
    can_set = getattr(model, "_can_set_experts_implementation", None)
    if can_set is not None and can_set():
        model.set_experts_implementation("batched_mm")
