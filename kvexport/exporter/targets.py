"""Export targets: one subpackage of ``kvexport.exporter`` each, whose ``target`` module provides
what ``Target`` lists. The pipeline calls ``quantize_model`` (where ``QUANTIZES_MODULE``),
``export``, ``lower`` (write the program), then ``quantize_files`` (where not)."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, cast

from ..artifact.manifest import Layer
from ..choices import KvCache, SdpaQuery
from ..choices import Target as TargetName
from ..errors import InvalidOptionError

if TYPE_CHECKING:
    import torch

    from ..models.deferred_weights import DeferredWeights
    from .quantization import Quantization


@dataclass(frozen=True)
class ProgramSpec:
    """What a target needs to know to lower and describe a program (``kvexport.json`` says the same)."""

    dtype: str
    max_cache_len: int
    max_tokens_per_call: int  # --prefill-chunk
    layers: list[Layer]  # kvexport.json's `layers`
    vocab_size: int
    bos_token_id: int | None
    eos_token_ids: list[int]
    hidden_size: int
    num_attention_heads: int
    max_draft_tokens: int = 0  # --max-draft-tokens: verification of that many drafted tokens, rings' spare slots


class Target(Protocol):
    RUNTIME_PACKAGES: tuple[str, ...]  # the packages whose versions kvexport.json records
    INT8_KV_ROW_EXTRA_BYTES: int  # --kv-cache int8: what a row of head_dim int8 values takes besides them
    # Where --quantize applies: to the module before export (quantize_model), or to the written
    # program's weights after lowering (quantize_files); the other hook does nothing.
    QUANTIZES_MODULE: bool
    # Whether the model may load with its large weights left in the checkpoint for ``lower`` to read
    # (its ``deferred``); a target that QUANTIZES_MODULE reads them in ``quantize_model`` either way.
    DEFERS_WEIGHTS: bool
    # Whether --kv-cache int8 runs the model before export (fixed scales measured on a text), which
    # needs its weights loaded.
    CALIBRATES_KV_CACHE: bool
    MIN_MAX_CACHE_LEN: int  # the shortest cache it exports exactly
    RING_SPARE_SLOTS: bool  # whether its rings keep --max-draft-tokens spare slots for a call inside a verification
    CALL_BOUNDS_REFUSED: tuple[int, ...]  # --prefill-chunk values it cannot export as one program

    def quantize_model(self, model: torch.nn.Module, quantization: Quantization, deferred: DeferredWeights | None) -> list[str]:
        """Quantize the module in place before export; return the layers left in float. With
        ``deferred``, the weights it left in the checkpoint are read as it goes, and all by its end."""

    def export(
        self, model: torch.nn.Module, max_cache_len: int, max_tokens_per_call: int, kv_cache: KvCache,
        calibration_ids: torch.Tensor | None, max_draft_tokens: int, **choices,
    ) -> torch.export.ExportedProgram:
        """The model wrapped with the target's cache (its elements ``kv_cache``), traced with ``T``
        dynamic. ``calibration_ids``: for ``kv_cache`` int8, the tokens of the text a target with
        fixed scales measures them on (``kv_calibration``). ``max_draft_tokens``: the program also
        returns the logits of every position a verification asks for, and rings keep that many
        spare slots. ``choices``: what ``choose_sdpa_query`` and ``choose_int8_kv_sdpa`` chose (a
        target that has them)."""  # fmt: skip

    def lower(
        self, program: torch.export.ExportedProgram, spec: ProgramSpec, out_dir: Path, deferred: DeferredWeights | None
    ) -> dict:
        """Write the program file(s) into ``out_dir``; return facts for ``kvexport.json`` (at least
        ``program``, the main file's name). ``deferred``: for a target that ``DEFERS_WEIGHTS``, the
        weights of a model loaded with them left in the checkpoint (None otherwise)."""

    def quantize_files(self, out_dir: Path, spec: ProgramSpec, quantization: Quantization) -> dict:
        """Quantize the written program's weights in place; return facts for ``kvexport.json``."""

    def choose_sdpa_query(self, requested: SdpaQuery, kv_cache: KvCache, text_config, specs: list,
                          max_cache_len: int) -> tuple[SdpaQuery | None, dict | None]:
        """``--sdpa-query``'s form for this export (None: the target, cache or model has no such
        choice; ``export`` then takes no ``sdpa_query``), and the timings ``auto`` chose it by."""

    def choose_int8_kv_sdpa(self, requested, kv_cache: KvCache):
        """``--int8-kv-sdpa``'s kernel for this export (None: the target or cache has no such
        choice; ``export`` then takes no ``int8_kv_sdpa``)."""

    def check_layers(self, specs: list, max_cache_len: int) -> None:
        """Refuse, before the model loads, a model whose layers this target cannot describe
        (``UnsupportedModelError``)."""

    def check_kv_cache(self, kv_cache: KvCache, text_config, specs: list, max_cache_len: int) -> None:
        """Refuse, before the model loads, a ``--kv-cache`` other than float that this model's
        attention cannot have on this target (``UnsupportedModelError``)."""

    def describe_kv_cache(self, kv_cache: KvCache) -> dict:
        """What ``kvexport.json`` records under ``kv_cache`` for a ``--kv-cache`` other than float
        (the targets whose ``ACCEPTS`` name it)."""

    def describe_quantization(self, quantization: Quantization, hidden_size: int) -> dict | None:
        """What ``kvexport.json`` records under ``quantization`` (None: not quantized)."""

    def quantization_detail(self, quantization: Quantization) -> str:
        """The quantize step's one-line progress detail."""


def get_target(name: TargetName) -> Target:
    """The target's ``target`` module (what it accepts: its package's ``ACCEPTS``, ``options.accepts``)."""
    module = f"{__package__}.{name}.target"
    try:
        return cast(Target, importlib.import_module(module))
    except ModuleNotFoundError as e:
        if e.name not in (module, module.rsplit(".", 1)[0]):  # the target exists but a dependency is missing: a bug
            raise
        raise InvalidOptionError(f"target '{name}' is not built in this version of kvexport; use --target executorch or --target onnx")
