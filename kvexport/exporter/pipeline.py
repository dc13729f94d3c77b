"""``kvexport export``: load, wrap, export, lower, save, each step timed."""

from __future__ import annotations

import math
import platform
from dataclasses import dataclass, field
from pathlib import Path

from ..artifact import manifest
from ..artifact.staging import check_output_path, staged_folder
from ..choices import KvCache
from ..errors import InvalidOptionError, UnsupportedModelError
from ..models import architecture, gguf_conversion, loading, sources
from ..models.model_source import ModelSource
from ..progress import Progress, peak_rss_mb
from ..version import __version__
from . import memory_plan
from . import quantization as quantize
from .kv_calibration import calibration_ids
from .options import ExportOptions, accepts
from .targets import ProgramSpec, get_target

DEFAULT_MAX_CACHE_LEN = 2048
# Most tokens one forward call takes, by default; longer prompts are prefilled in chunks of this
# many. ExecuTorch plans activation memory for the largest call, so the chunk bounds RSS
# (docs/performance.md).
DEFAULT_PREFILL_CHUNK = 512
# The default for a model with gated-delta linear attention: a call's delta rule solves a triangular
# system padded to the longest call (kv_cache.GatedDeltaState), which every decode step pays for;
# transformers' own chunk size.
LINEAR_ATTENTION_PREFILL_CHUNK = 64


@dataclass
class ExportResult:
    folder: Path
    manifest: manifest.Manifest
    seconds: dict = field(default_factory=dict)
    peak_rss_mb: float = 0.0


def default_output(model: str, target: str) -> Path:
    stem = Path(model).name.removesuffix(".gguf") or "model"
    return Path(f"{stem}-{target}")


def choose_max_cache_len(config, requested: int | None, target: str = "executorch") -> tuple[int, int | None]:
    """``(max_cache_len, model's max positions)``: the request, checked, or the default (at most
    the model's positions and what its rope type computes exactly), at least the target's shortest."""
    text = architecture.text_config(config)
    limit = getattr(text, "max_position_embeddings", None)
    if requested is None:
        bounds = (limit, architecture.exact_rope_positions(config))
        chosen = min([DEFAULT_MAX_CACHE_LEN, *(b for b in bounds if b)])
    else:
        if requested < 1:
            raise InvalidOptionError(f"--max-cache-len must be a positive number of tokens, got {requested}")
        if limit and requested > limit:
            raise InvalidOptionError(f"--max-cache-len {requested} exceeds the model's maximum positions ({limit})")
        chosen = requested
    shortest = get_target(target).MIN_MAX_CACHE_LEN
    if chosen < shortest:
        given = f"--max-cache-len {chosen}" if requested else f"max_cache_len {chosen} (the default)"
        raise InvalidOptionError(
            f"{given} is too short for --target {target}: its graph's sizes are traced from a call that needs "
            f"{shortest} positions; give --max-cache-len {shortest} or more"
        )
    return chosen, limit


def choose_prefill_chunk(
    max_cache_len: int, requested: int | None, target: str = "executorch", default: int = DEFAULT_PREFILL_CHUNK
) -> int:
    """The most tokens one forward call takes: the request, checked, or the default (at most the
    cache, and a bound the target exports)."""
    refused = get_target(target).CALL_BOUNDS_REFUSED
    if requested is None:
        chosen = min(max_cache_len, default)
        while chosen in refused:  # a cache of 2 positions on ExecuTorch: calls of 1 token
            chosen -= 1
        return chosen
    if requested < 1:
        raise InvalidOptionError(f"--prefill-chunk must be a positive number of tokens, got {requested}")
    if requested > max_cache_len:
        raise InvalidOptionError(
            f"--prefill-chunk {requested} exceeds --max-cache-len {max_cache_len}: a call cannot hold more "
            "tokens than the cache; leave it out or make it smaller"
        )
    if requested in refused:
        raise InvalidOptionError(
            f"--prefill-chunk {requested} cannot be exported for --target {target}: torch.export's dynamic call "
            f"length starts at 2 tokens, so a bound of {requested} would fix every call at {requested} and leave "
            "none of 1 token to decode with; use --prefill-chunk 1 (one token per call) or 3 or more"
        )
    return requested


@dataclass
class ExportPlan:
    """Everything decided before the weights load: a bad request fails here, in seconds."""

    options: ExportOptions
    out: Path
    source: ModelSource
    config: object
    specs: list
    max_cache_len: int
    max_positions: int | None
    dtype_bytes: int
    prefill_chunk: int

    @property
    def defers_weights(self) -> bool:
        """Whether the model loads with its large weights left in the checkpoint
        (``models/deferred_weights``): where the target writes each weight on its own, or quantizes
        each before export, and nothing runs the whole model before that (a calibrated int8 KV cache
        does; the half-precision probe reads each weight as its module runs)."""
        o = self.options
        target = get_target(o.target)
        runs_before = o.kv_cache != KvCache.FLOAT and target.CALIBRATES_KV_CACHE
        deferrable = not runs_before and self.source.kind != "preset"
        return deferrable and (target.DEFERS_WEIGHTS or (target.QUANTIZES_MODULE and bool(o.quantization)))

    def slots(self, spec) -> int:
        """A layer's cache slots: a ring's window, and its spare slots where the target keeps them
        (``--max-draft-tokens``)."""
        spare = self.options.max_draft_tokens if get_target(self.options.target).RING_SPARE_SLOTS else 0
        return spec.cache_slots(self.max_cache_len) + spare * spec.is_ring(self.max_cache_len)

    @property
    def kv_cache_bytes(self) -> int:
        """What the layers' own KV caches take (a layer that shares another's takes nothing; a
        convolution's or a linear-attention layer's state is not a KV cache)."""
        return sum(
            2 * layer.kv_heads * layer.slots * self.kv_row_bytes(layer.head_dim)
            for layer in self.layers()
            if layer.cache in (architecture.STATIC, architecture.RING, architecture.SHARED)
        )

    @property
    def state_bytes(self) -> int:
        """What the states of the layers that do not attend take, the same at every position: a
        convolution's last inputs (in the dtype), a linear-attention layer's recurrent state (float32)."""
        total = 0
        for s in self.specs:
            if s.conv_state:
                total += s.conv_state[0] * s.conv_state[1] * self.dtype_bytes
            if s.recurrent_state:
                total += math.prod(s.recurrent_state) * 4
        return total

    @property
    def kv_cache_bytes_if_all_full(self) -> int:
        """What the cache would take if every layer held max_cache_len positions of its own
        (transformers' export: no rings, no sharing)."""
        return sum(2 * s.kv_heads * self.max_cache_len * self.kv_row_bytes(s.head_dim) for s in self.specs if s.has_kv)

    def kv_row_bytes(self, head_dim: int) -> int:
        """Bytes of one position of one KV head, in K or in V."""
        if self.options.kv_cache == KvCache.INT8:  # int8 values, and on some targets a scale per row
            return head_dim + get_target(self.options.target).INT8_KV_ROW_EXTRA_BYTES
        return head_dim * self.dtype_bytes

    def layers(self) -> list[manifest.Layer]:
        """Each layer's entry in kvexport.json: its cache and the sizes a runtime builds it from."""
        layers = []
        for i, s in enumerate(self.specs):
            kind = s.cache_kind(self.max_cache_len)
            state = None
            if s.state_kind:  # float states: the convolution's [1, channels, slots], a recurrent [heads, key, value] (float32)
                channels, slots = s.conv_state
                state = manifest.State(s.state_kind, slots, channels, s.recurrent_state)
            if kind == architecture.NONE:  # mixes no positions: nothing to hold
                layers.append(manifest.Layer(i, s.layer_type, kind))
            elif not s.has_kv:
                layers.append(manifest.Layer(i, s.layer_type, kind, slots=slots, channels=channels, state=s.recurrent_state))
            else:
                layers.append(manifest.Layer(
                    i, s.layer_type, kind,
                    reads=s.reads if kind == architecture.SHARED else None,
                    window=s.window,
                    chunk=s.chunk or None,
                    slots=self.slots(s),
                    kv_heads=s.kv_heads,
                    head_dim=s.head_dim,
                    mixer=state,  # a hybrid layer (Falcon-H1): its mixer's state beside the KV cache
                ))  # fmt: skip
        return layers

    def summary(self) -> str:
        o = self.options
        rings = sum(s.is_ring(self.max_cache_len) and not s.chunk for s in self.specs)
        chunked = sum(s.is_ring(self.max_cache_len) and bool(s.chunk) for s in self.specs)
        shared = sum(s.reads is not None for s in self.specs)
        linear = sum(s.recurrent_state is not None and not s.has_kv for s in self.specs)
        hybrid = sum(s.has_kv and s.state_kind is not None for s in self.specs)
        convolutions = sum(s.state_kind == architecture.CONV for s in self.specs)
        other_kinds = f", {chunked} chunked-attention rings" if chunked else ""
        other_kinds += f", {shared} reading another layer's cache" if shared else ""
        other_kinds += f", {convolutions} short convolutions" if convolutions else ""
        other_kinds += f", {linear} linear attention" if linear else ""
        other_kinds += f", {hybrid} with a Mamba-2 mixer beside attention" if hybrid else ""
        schemes = [f"--{name.replace('_', '-')} {getattr(o, name)}" for name in quantize.OPTIONS if getattr(o, name)]
        kv = " int8" if o.kv_cache == KvCache.INT8 else ""
        quantized = f" ({', '.join(schemes)})" if schemes else ""
        default = (
            ""
            if o.max_cache_len
            else f" (default: the smaller of {self.max_positions} positions and {DEFAULT_MAX_CACHE_LEN})"
        )
        # A share of nothing where no layer attends (a stack of Mamba-2 layers alone).
        share = self.kv_cache_bytes / self.kv_cache_bytes_if_all_full if self.kv_cache_bytes_if_all_full else 0
        states = f", states {self.state_bytes / 2**20:.1f} MiB" if self.state_bytes else ""
        return (
            f"{o.model}: {len(self.specs)} layers ({rings} sliding-window rings{other_kinds}), max_cache_len "
            f"{self.max_cache_len}{default}, calls of up to {self.prefill_chunk} token{'s' if self.prefill_chunk > 1 else ''}, "
            f"KV cache{kv} {self.kv_cache_bytes / 2**20:.1f} MiB ({share:.0%} of full-length layers){states}, "
            f"{o.dtype} -> {o.target}{quantized}"
        )


def plan_export(options: ExportOptions, progress: Progress | None = None) -> ExportPlan:
    """Check the request against the target and the model's config (no weights are loaded; a hub id's
    files are downloaded, with ``progress``, unless they are in the local HF cache)."""
    # What needs no torch first: a mistyped option or path is refused in a fraction of a second.
    options.check()
    out = Path(options.out) if options.out else default_output(options.gguf_file or options.model, options.target)
    check_output_path(out, options.force)
    source = sources.resolve(options.model, options.revision, options.offline, options.gguf_file, progress)
    gguf_conversion.check_conversion_cache(source)
    target = get_target(options.target)
    config = sources.load_config(source)
    specs = architecture.layer_specs(config)
    max_cache_len, max_positions = choose_max_cache_len(config, options.max_cache_len, options.target)
    target.check_layers(specs, max_cache_len)
    if options.kv_cache != KvCache.FLOAT:
        target.check_kv_cache(options.kv_cache, architecture.text_config(config), specs, max_cache_len)
    architecture.check_rope(config, max_cache_len)
    linear = any(s.rule == architecture.GATED_DELTA for s in specs)
    default_chunk = LINEAR_ATTENTION_PREFILL_CHUNK if linear else DEFAULT_PREFILL_CHUNK
    if architecture.prompt_in_one_call(config):
        if options.prefill_chunk is not None and options.prefill_chunk < max_cache_len:
            raise InvalidOptionError(
                f"--prefill-chunk {options.prefill_chunk} would split a prompt into calls, and {config.model_type}'s "
                "Mamba-2 layers step differently in a one-token call than eager does in its one prefill call; "
                f"leave it out (one call takes any prompt the cache holds: {max_cache_len} tokens)"
            )
        default_chunk = max_cache_len
    prefill_chunk = choose_prefill_chunk(max_cache_len, options.prefill_chunk, options.target, default_chunk)
    if options.max_draft_tokens:
        check_draft_tokens(options, specs, max_cache_len, prefill_chunk, config.model_type)
    dtype_bytes = options.dtype.bytes
    plan = ExportPlan(options, out, source, config, specs, max_cache_len, max_positions, dtype_bytes, prefill_chunk)
    memory_plan.refuse_a_cache_beyond_memory(plan)
    return plan


def check_draft_tokens(options: ExportOptions, specs: list, max_cache_len: int, prefill_chunk: int, model_type: str) -> None:
    """Refuse a ``--max-draft-tokens`` the call bound or the model's layers cannot take:
    a verification's call must be able to start again where the previous one's accepted tokens end,
    which a ring does with spare slots and a full layer by writing over, but a state that has moved
    on (a convolution's, a recurrence's), a chunk's ring and a layer that reads another's cache
    within one call do not."""
    k = options.max_draft_tokens
    if k < 0:
        raise InvalidOptionError(f"--max-draft-tokens must be 0 (no speculative decoding) or more, got {k}")
    if k + 1 > prefill_chunk:
        raise InvalidOptionError(
            f"--max-draft-tokens {k}: a verification call takes the last token and {k} drafted ones, more than "
            f"--prefill-chunk {prefill_chunk}; draft fewer or raise the chunk"
        )
    refused = [(i, s) for i, s in enumerate(specs) if s.state_kind or s.reads is not None or (s.chunk and s.is_ring(max_cache_len))]
    if refused:
        i, s = refused[0]
        kind = "a state" if s.state_kind else "another layer's cache" if s.reads is not None else "a chunked-attention ring"
        raise UnsupportedModelError(
            f"--max-draft-tokens: {model_type}'s layer {i} holds {kind}, which cannot forget rejected drafted tokens "
            "in this version; export it without --max-draft-tokens"
        )


def export_model(options: ExportOptions, progress: Progress | None = None) -> ExportResult:
    progress = progress or Progress()
    plan = plan_export(options, progress)
    target = get_target(options.target)
    progress.info(plan.summary())
    sdpa_query, timed = target.choose_sdpa_query(
        options.sdpa_query, options.kv_cache, architecture.text_config(plan.config), plan.specs, plan.max_cache_len
    )
    if timed:
        times = ", ".join(f"{form} {us:,.0f} µs" for form, us in timed.items())
        progress.info(f"--sdpa-query auto: {sdpa_query} (a decode step's attention over a few layers here: {times})")
    int8_kv_sdpa = target.choose_int8_kv_sdpa(options.int8_kv_sdpa, options.kv_cache)
    if int8_kv_sdpa and options.int8_kv_sdpa == "auto":
        progress.info(f"--int8-kv-sdpa auto: {int8_kv_sdpa} (this machine: {platform.machine()})")
    chosen = {name: value for name, value in (("sdpa_query", sdpa_query), ("int8_kv_sdpa", int8_kv_sdpa)) if value}
    # A target that takes --decode-attention is given it (else it is left at its default, refused otherwise).
    decode_attention = {"decode_attention": options.decode_attention} if accepts(options.target).decode_attention else {}
    needs = plan_footprint(plan)
    if needs:
        progress.info(f"memory plan: {needs.summary()} (the artifact {memory_plan.size(needs.artifact_bytes)})")
        memory_plan.refuse_what_the_machine_cannot_hold(plan, needs)

    quantization = options.quantization
    # Layers quantized before export need no float32 copy of a bfloat16 checkpoint's weights.
    compact = ()
    if target.QUANTIZES_MODULE:
        compact = ("linear",) * bool(quantization.scheme) + ("embedding",) * bool(quantization.embedding)
    deferred = None  # the weights left in the checkpoint until they are written (or quantized)
    with progress.step("load", plan.source.name):
        if plan.defers_weights:
            model, tokenizer, deferred = sources.load_model_deferred(plan.source, options.dtype)
        else:
            model, tokenizer = sources.load_model(plan.source, options.dtype, compact=compact)
    if options.dtype != "float32":
        with progress.step("probe", f"eager {options.dtype} on {_PROBE_PROMPT!r}"):
            deferred = _probe(model, tokenizer, options.dtype, deferred)
    info = _manifest_info(plan, model, tokenizer, chosen)
    spec = _program_spec(plan, info)
    if quantization and target.QUANTIZES_MODULE:
        with progress.step("quantize", target.quantization_detail(quantization)):
            skipped = target.quantize_model(model, quantization, deferred)
            loading.widen_compact_weights(model)
        deferred = None  # read into the model as it was quantized
        if skipped:
            info["quantization"]["left_in_float"] = skipped

    with staged_folder(plan.out, options.force) as folder:
        calls = f"dynamic (calls of 1 to {plan.prefill_chunk} tokens)" if plan.prefill_chunk > 1 else "static (calls of 1 token)"
        with progress.step("export", f"torch.export, T {calls}"):
            calibration = calibration_ids(tokenizer) if options.kv_cache == KvCache.INT8 else None
            program = target.export(
                model, plan.max_cache_len, plan.prefill_chunk, options.kv_cache, calibration, options.max_draft_tokens,
                **chosen, **decode_attention,
            )
        with progress.step("lower", options.target):
            lowered = target.lower(program, spec, folder, deferred)
            del program
        if quantization and not target.QUANTIZES_MODULE:
            _release_weights(model)
            del model
            with progress.step("quantize", target.quantization_detail(quantization)):
                lowered.update(target.quantize_files(folder, spec, quantization))
        with progress.step("save", str(plan.out)):
            tokenizer.save_pretrained(folder)
            # The target's facts win: the ONNX target replaces `interface` with its graph's own.
            manifest.write_manifest(folder, {**info, **lowered})
    written = manifest.read_manifest(plan.out, verify=False)
    # The program file, and its weights where the target keeps them beside it (ONNX external data).
    program_files = [written.program, *([written.external_data] if written.external_data else [])]
    program_bytes = sum(written.files[name].bytes for name in program_files)
    progress.info(f"wrote {plan.out} ({program_bytes / 2**20:.1f} MiB program)")
    if written.genai_unsupported:
        progress.info(f"onnxruntime-genai cannot run it ({written.genai_unsupported}); kvexport run and check can")
    return ExportResult(plan.out, written, dict(progress.seconds), peak_rss_mb())


def _release_weights(model) -> None:
    """Free the model's weights: the graph torch.export traced stays reachable from module-level
    caches (torch.fx's, onnxscript's rewrite rules), and through it the weights, after the model is
    dropped. For the steps that read the written artifact's weights, not the model's."""
    import torch

    for tensor in [*model.parameters(), *model.buffers()]:
        tensor.data = torch.empty(0, dtype=tensor.dtype)


def plan_footprint(plan: ExportPlan) -> memory_plan.Footprint | None:
    """The export's memory and disk, from the config (None for a model transformers cannot build
    on the meta device: it is exported without a plan)."""
    try:
        parameters = memory_plan.count_parameters(plan.config)
    except Exception:  # noqa: BLE001 - a plan is advice; the export itself says what is wrong
        return None
    stored = getattr(architecture.text_config(plan.config), "dtype", None)
    # A preset is built in float32; a checkpoint is bfloat16 unless its config says otherwise.
    bytes_per_value = 4 if plan.source.kind == "preset" or str(stored).endswith("float32") else 2
    return memory_plan.footprint(plan, parameters, bytes_per_value)


# A model whose activations pass float16's range (Gemma 3's residual stream) gives non-finite logits
# in float16, in transformers and in its float16 artifacts alike, which would generate garbage
# silently. One forward pass of eager in the dtype on a short prompt finds that before anything is
# written.
_PROBE_PROMPT = "The capital of France is"


def _probe(model, tokenizer, dtype: str, deferred):
    """``_refuse_if_it_overflows``, each deferred weight read as its module runs; where the model
    reads a weight otherwise (the run fails on its stand-in), every weight is read into the model
    first and the export goes on from the loaded model. Returns the deferred weights left."""
    if deferred is None:
        _refuse_if_it_overflows(model, tokenizer, dtype)
        return None
    try:
        with deferred.read_while_running(model):
            _refuse_if_it_overflows(model, tokenizer, dtype)
        return deferred
    except InvalidOptionError:
        raise
    except Exception:  # a weight read outside its module's call: the meta stand-in refuses it
        deferred.fill_all(model)
        _refuse_if_it_overflows(model, tokenizer, dtype)
        return None


def _refuse_if_it_overflows(model, tokenizer, dtype: str) -> None:
    import torch

    ids = tokenizer(_PROBE_PROMPT, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model(input_ids=ids, output_hidden_states=True, use_cache=False)
    if torch.isfinite(out.logits).all():
        return
    layers = len(out.hidden_states) - 1  # [0] is the embedding's output
    first = next((i for i, h in enumerate(out.hidden_states) if not torch.isfinite(h).all()), None)
    where = f" (its hidden states overflow at layer {first} of {layers})" if first else ""
    raise InvalidOptionError(
        f"--dtype {dtype}: the model overflows in {dtype}: eager transformers in {dtype} gives non-finite logits "
        f"on {_PROBE_PROMPT!r}{where}; export it in float32 (the default)"
    )


def _eos_ids(model, tokenizer) -> list[int]:
    ids: list[int] = []
    for value in (model.generation_config.eos_token_id, model.config.eos_token_id, tokenizer.eos_token_id):
        for i in value if isinstance(value, (list, tuple)) else [value]:
            if i is not None and int(i) not in ids:
                ids.append(int(i))
    return ids


def _manifest_info(plan: ExportPlan, model, tokenizer, chosen: dict | None = None) -> dict:
    """``chosen``: what the target chose for options left to ``auto`` (``--sdpa-query``,
    ``--int8-kv-sdpa``), recorded with the options."""
    import torch
    import transformers

    target = get_target(plan.options.target)
    config = architecture.text_config(model.config)
    bos = tokenizer.bos_token_id
    dtype = plan.options.dtype
    return {
        "target": plan.options.target,
        "source": plan.source.describe().to_json(),
        # What reproduces this artifact byte for byte, with the versions below (the output folder
        # does not matter): `kvexport export MODEL --target T --dtype D --max-cache-len N --prefill-chunk C`
        # (and `--sdpa-query Q` or `--int8-kv-sdpa K`, where auto chose them on the exporting machine).
        "export_options": plan.options.recorded(max_cache_len=plan.max_cache_len, prefill_chunk=plan.prefill_chunk,
                                                **(chosen or {})),
        "model_type": config.model_type,
        "dtype": dtype,
        "max_cache_len": plan.max_cache_len,
        # Weight quantization (absent: float weights). `check` then measures agreement with float eager.
        **({"quantization": q} if (q := target.describe_quantization(plan.options.quantization, config.hidden_size)) else {}),
        "vocab_size": config.vocab_size,
        "bos_token_id": bos,
        "eos_token_ids": _eos_ids(model, tokenizer),
        # Whether the tokenizer already prepends BOS when encoding a prompt (runners must not add another).
        "tokenizer_adds_bos": bool(bos is not None and tokenizer("a").input_ids[:1] == [bos]),
        "layers": [layer.to_json() for layer in plan.layers()],
        # The KV cache's element type: the dtype's, or int8 (`kv_cache`, absent for float).
        **({"kv_cache": target.describe_kv_cache(plan.options.kv_cache)} if plan.options.kv_cache != KvCache.FLOAT else {}),
        "kv_cache_bytes": plan.kv_cache_bytes,
        "kv_cache_bytes_if_all_full": plan.kv_cache_bytes_if_all_full,
        **({"state_bytes": plan.state_bytes} if plan.state_bytes else {}),
        # Speculative decoding: a call may verify this many drafted tokens and start again after the accepted ones.
        **({"max_draft_tokens": plan.options.max_draft_tokens} if plan.options.max_draft_tokens else {}),
        "interface": {
            "inputs": [
                {"name": "tokens", "dtype": "int64", "shape": [1, "T"], "note": "1 <= T <= max_tokens_per_call"},
                {"name": "input_pos", "dtype": "int64", "shape": [1], "note": "position of tokens[0, 0]"},
            ],
            "outputs": [{"name": "logits", "dtype": dtype, "shape": [1, config.vocab_size], "note": "last position"}],
            "calls": "contiguous: each call starts where the previous one ended; start at 0 for a new sequence",
            # --prefill-chunk: a longer prompt takes several calls.
            "max_tokens_per_call": plan.prefill_chunk,
        },
        "versions": {
            "kvexport": __version__,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            **{name: _package_version(name) for name in get_target(plan.options.target).RUNTIME_PACKAGES},
            "python": platform.python_version(),
        },
    }


def _program_spec(plan: ExportPlan, info: dict) -> ProgramSpec:
    text = architecture.text_config(plan.config)
    return ProgramSpec(
        dtype=plan.options.dtype, max_cache_len=plan.max_cache_len, max_tokens_per_call=plan.prefill_chunk,
        layers=plan.layers(), vocab_size=info["vocab_size"], bos_token_id=info["bos_token_id"],
        eos_token_ids=info["eos_token_ids"], hidden_size=text.hidden_size, num_attention_heads=text.num_attention_heads,
        max_draft_tokens=plan.options.max_draft_tokens,
    )


def _package_version(name: str) -> str | None:
    import importlib
    from importlib.metadata import PackageNotFoundError, version

    try:
        return getattr(importlib.import_module(name), "__version__", None) or version(name)
    except (ImportError, PackageNotFoundError):
        return None

