"""``kvexport export``'s options, declared once: each one's type, default and help text
(``ExportOptions``), and their check against what the target accepts (``ExportOptions.check``),
before anything loads. The CLI's options (``cli/__init__.py``) take their help texts from here;
the API's keywords (``api.py``) and a matrix row's keys (``matrix/spec.py``) are these fields, which
``tests/test_api.py`` keeps so. A target declares what it accepts in its package's ``ACCEPTS``
(``exporter/<target>/__init__.py``, without torch)."""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass, field
from pathlib import Path

from ..choices import DecodeAttention, Dtype, EmbeddingScheme, Grid, Int8KvSdpa, KvCache, LmHeadScheme, Scheme, SdpaQuery, Target, choose
from ..errors import InvalidOptionError
from .quantization import Quantization


@dataclass(frozen=True)
class Accepts:
    """What a target takes of the export options."""

    dtypes: tuple[Dtype, ...]
    quantize: Scheme  # the one --quantize scheme it runs
    quantize_embedding: bool  # whether it takes --quantize-embedding (else its scheme quantizes the embedding)
    kv_caches: tuple[KvCache, ...]
    sdpa_query: bool = False  # whether it takes --sdpa-query (its attention calls ExecuTorch's custom_sdpa)
    int8_kv_sdpa: bool = False  # whether it takes --int8-kv-sdpa (a choice of kernel over its int8 cache)
    decode_attention: bool = False  # whether it takes --decode-attention (kvexport's own decode kernel)
    gpu_dtypes: tuple[Dtype, ...] = ()  # dtypes whose artifacts run on the GPU only: with a float cache only


def accepts(target: Target) -> Accepts:
    """``target``'s ``ACCEPTS`` (its package imports no torch); a target missing from this
    installation is refused in one line."""
    try:
        return _package(target).ACCEPTS
    except ModuleNotFoundError as e:
        if e.name != f"{__package__}.{target}":  # the target is there but a dependency is missing: a bug
            raise
        built = " or ".join(f"--target {t}" for t in Target if t != target and _is_built(t))
        raise InvalidOptionError(f"target '{target}' is not built in this version of kvexport; use {built}") from None


def _package(target: Target):
    return importlib.import_module(f"{__package__}.{target}")


def _is_built(target: Target) -> bool:
    try:
        _package(target)
    except ModuleNotFoundError:
        return False
    return True


def _option(default, help: str, recorded: bool = True):
    """An option's declaration; ``recorded=False``: not in ``kvexport.json``'s ``export_options`` (it
    does not shape the artifact)."""
    return field(default=default, metadata={"help": help, "recorded": recorded})


@dataclass
class ExportOptions:
    model: str = field(metadata={"help": "alias, tiny preset, HF folder, .gguf file or hub id ORG/NAME (from the local HF cache, or downloaded)"})
    target: Target = _option(Target.EXECUTORCH, "executorch or onnx")
    out: Path | None = _option(None, "output folder [default: MODEL-TARGET]", recorded=False)
    max_cache_len: int | None = _option(None, "cache positions [default: min(model max positions, 2048)]")
    dtype: Dtype = _option(Dtype.FLOAT32, "float32, float16 or bfloat16 (executorch)")
    force: bool = _option(False, "replace an existing output folder", recorded=False)
    quantize: Scheme | None = _option(
        None, "4-bit weights: 8da4w (executorch: int8 dynamic activations, int4 weights, int8 lm_head and int8 where the "
        "source is finer than 4 bits) or int4 (onnx: MatMulNBits, int8 lm_head and embedding, int8 where the source is "
        "finer than 4 bits)")
    quantize_embedding: EmbeddingScheme | None = _option(None, "executorch: int8 or int4 embedding table")
    quantize_lm_head: LmHeadScheme | None = _option(
        None, "with --quantize: int8 or int4 lm_head (int4: smaller and faster, less exact) [default: int8]")
    quantize_grid: Grid | None = _option(
        None, "with --quantize: source (keep the grids the checkpoint's weights lie on: closest to float eager) or "
        "symmetric (every linear weight symmetric int4, as optimum-executorch and onnxruntime-genai's builder round "
        "them: faster, less exact) [default: source]")
    prefill_chunk: int | None = _option(
        None, "most tokens one forward call takes; longer prompts are prefilled in chunks (ExecuTorch plans activation "
        "memory for it) [default: min(max_cache_len, 512); 64 with gated-delta linear attention]")
    kv_cache: KvCache = _option(
        KvCache.FLOAT, "float (the export's dtype) or int8, about a quarter of float32's bytes (executorch: a scale and "
        "zero point per token and KV head; onnx: a fixed scale per KV head and channel, calibrated at export)")
    sdpa_query: SdpaQuery = _option(
        SdpaQuery.AUTO, "executorch, float KV cache: the query rows attention gives llama::custom_sdpa: grouped (a decode "
        "step's query heads stacked per KV head, each cached row read once; matrix products), per-head (one row per "
        "query head, as ExecuTorch's own recipes; matrix-vector products at decode) or auto (the faster of the two on "
        "this machine, timed at the model's shape; export on the device's kind of CPU, or pass what "
        "scripts/custom_sdpa_rows.py finds there)")
    int8_kv_sdpa: Int8KvSdpa = _option(
        Int8KvSdpa.AUTO, "executorch, --kv-cache int8: the kernel a decode step attends with: quantized "
        "(llama::custom_quantized_sdpa reads the int8 rows in place; torchao's int8 products, NEON on aarch64, a "
        "scalar fallback elsewhere), dequantized (the rows dequantized into llama::custom_sdpa) or auto (quantized "
        "where this machine is aarch64, else dequantized)")
    decode_attention: DecodeAttention = _option(
        DecodeAttention.CUSTOM_SDPA, "executorch, --dtype float32: the kernel full-attention layers attend with in calls of up "
        "to 16 tokens (decode steps, verifications): custom-sdpa (ExecuTorch's: llama::custom_sdpa, or with --kv-cache int8 --int8-kv-sdpa's; in any ExecuTorch "
        "runtime) or kvexport (kvexport's own, split over the cached positions, reading an int8 cache in place: faster at "
        "long contexts; built here with a C++ compiler and loaded by kvexport's runners, and a C++ runner must link it: "
        "docs/executorch.md)")
    max_draft_tokens: int = _option(
        0, "speculative decoding (run --draft): most drafted tokens one call verifies (a .pte gets a verify method, an "
        "ONNX graph a logits_indices input); 0: none")
    revision: str | None = _option(None, "hub id: branch, tag or commit [default: main]")
    offline: bool = _option(False, "hub id: the local HF cache only, no network (as HF_HUB_OFFLINE=1)", recorded=False)
    gguf_file: str | None = _option(None, "hub id: download only this .gguf file of the repo and export it")

    def __post_init__(self):
        """Each choice as its enum: an unknown value is refused here, whoever asked (CLI, API, matrix row)."""
        self.target = choose(Target, self.target, "target")
        self.dtype = choose(Dtype, self.dtype, "dtype")
        self.kv_cache = choose(KvCache, self.kv_cache, "--kv-cache")
        self.sdpa_query = choose(SdpaQuery, self.sdpa_query, "--sdpa-query")
        self.int8_kv_sdpa = choose(Int8KvSdpa, self.int8_kv_sdpa, "--int8-kv-sdpa")
        self.decode_attention = choose(DecodeAttention, self.decode_attention, "--decode-attention")
        if self.quantize is not None and self.quantize not in tuple(Scheme):
            schemes = ", ".join(f"{accepts(t).quantize} (--target {t})" for t in Target)
            raise InvalidOptionError(f"unknown --quantize '{self.quantize}'; choose one of: {schemes}")
        for name, kind in (("quantize", Scheme), ("quantize_embedding", EmbeddingScheme),
                           ("quantize_lm_head", LmHeadScheme), ("quantize_grid", Grid)):
            if getattr(self, name) is not None:
                setattr(self, name, choose(kind, getattr(self, name), "--" + name.replace("_", "-")))

    def recorded(self, **chosen) -> dict:
        """``kvexport.json``'s ``export_options``: what reproduces the artifact byte for byte (with the
        versions it records): the model, target and dtype, ``chosen`` (what the export chose for an
        option left to its default: the cache length, the call bound), then each other option that
        shapes the artifact, where it is not its default (so older manifests read the same)."""
        always = {"model": self.model, "target": self.target, "dtype": self.dtype, **chosen}
        return {**always, **{f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                             if f.name not in always and f.metadata.get("recorded") and getattr(self, f.name) != f.default}}

    @property
    def quantization(self) -> Quantization:
        return Quantization(self.quantize, self.quantize_embedding, self.quantize_lm_head, self.quantize_grid)

    def check(self) -> None:
        """Refuse, before anything loads, what the target does not accept, or options that do not go together."""
        takes = accepts(self.target)
        target, dtype = self.target, self.dtype
        if self.quantize is not None and self.quantize != takes.quantize:
            raise InvalidOptionError(f"--quantize {self.quantize} is for --target {_taken_by(self.quantize)}; "
                                     f"for --target {target} use --quantize {takes.quantize}")
        if self.quantize_embedding is not None and not takes.quantize_embedding:
            others = " or ".join(f"--target {t}" for t in Target if accepts(t).quantize_embedding)
            raise InvalidOptionError(f"--quantize-embedding is for {others}; for --target {target} leave it out "
                                     f"(--quantize {takes.quantize} quantizes the embedding too)")
        for name in ("quantize_lm_head", "quantize_grid"):
            if getattr(self, name) is not None and self.quantize is None:
                flag = "--" + name.replace("_", "-")
                raise InvalidOptionError(f"{flag} goes with --quantize {takes.quantize} (--target {target}); "
                                         f"add it, or leave {flag} out")
        if self.quantization and dtype != Dtype.FLOAT32:
            raise InvalidOptionError(f"--quantize takes --dtype float32 (the default), not {dtype}; leave --dtype out")
        if self.kv_cache not in takes.kv_caches:
            others = " or ".join(f"--target {t}" for t in Target if self.kv_cache in accepts(t).kv_caches)
            raise InvalidOptionError(f"--kv-cache {self.kv_cache} is not available for --target {target} in this "
                                     f"version; {others} takes it")
        if self.sdpa_query != SdpaQuery.AUTO:
            _refuse_unless_taken("sdpa_query", takes, target)
            if self.kv_cache != KvCache.FLOAT:
                raise InvalidOptionError(f"--sdpa-query goes with --kv-cache float: --kv-cache {self.kv_cache}'s decode "
                                         "kernel takes one row per query head; leave --sdpa-query out")
        if self.int8_kv_sdpa != Int8KvSdpa.AUTO:
            _refuse_unless_taken("int8_kv_sdpa", takes, target)
            if self.kv_cache != KvCache.INT8:
                raise InvalidOptionError(f"--int8-kv-sdpa goes with --kv-cache int8, not --kv-cache {self.kv_cache}; "
                                         "add --kv-cache int8, or leave --int8-kv-sdpa out")
        if self.decode_attention != DecodeAttention.CUSTOM_SDPA:
            _refuse_unless_taken("decode_attention", takes, target)
            if dtype != Dtype.FLOAT32:
                raise InvalidOptionError(f"--decode-attention {self.decode_attention} attends in float32: it goes with "
                                         f"--dtype float32 (the default), not {dtype}; leave it out")
        if dtype not in takes.dtypes:
            raise InvalidOptionError(f"target {target} does not take --dtype {dtype}; it takes {', '.join(takes.dtypes)}")
        if dtype in takes.gpu_dtypes and self.kv_cache != KvCache.FLOAT:
            raise InvalidOptionError(f"--dtype {dtype} for --target {target} (an artifact for the GPU) goes with --kv-cache float; "
                                     f"its --kv-cache {self.kv_cache} has not run on a GPU: use --dtype float32 or float16")


def _taken_by(scheme: Scheme) -> Target:
    return next(t for t in Target if accepts(t).quantize == scheme)


def _refuse_unless_taken(name: str, takes: Accepts, target: Target) -> None:
    """Refuse option ``name`` (an ``Accepts`` flag) for a target that does not take it, naming those that do."""
    if not getattr(takes, name):
        others = " or ".join(f"--target {t}" for t in Target if getattr(accepts(t), name))
        raise InvalidOptionError(f"--{name.replace('_', '-')} is for {others}; for --target {target} leave it out")


def help_text(name: str) -> str:
    """An export option's help text, as declared on its ``ExportOptions`` field."""
    return next(f.metadata["help"] for f in dataclasses.fields(ExportOptions) if f.name == name)
