"""ExecuTorch target: XNNPACK-delegated ``model.pte`` with the metadata ExecuTorch's LLM runner reads."""

from __future__ import annotations

import contextlib
import platform
import tempfile
from pathlib import Path

import torch

from ...choices import DecodeAttention, EmbeddingScheme, Int8KvSdpa, KvCache, LmHeadScheme, SdpaQuery
from ...errors import KvexportError, UnsupportedModelError
from ...models.deferred_weights import DeferredWeights
from ...progress import report
from ..decoder import ExportableDecoder, export_decoder, export_verifier
from ..quantization import Quantization
from ..targets import ProgramSpec
from .quantize import GROUP_SIZE, fuse_quantized_embeddings

PROGRAM_FILE = "model.pte"
# All weights live in one ExecuTorch data file beside the program. The embedding lookup runs outside
# XNNPACK and reads the program's constants while the lm_head inside XNNPACK reads the delegate's;
# only in a shared data file are a tied embedding's two uses stored once (ExecuTorch resolves program
# constants from external data only, and the file's writer deduplicates identical tensors).
WEIGHTS_TAG = "model"
WEIGHTS_FILE = f"{WEIGHTS_TAG}.ptd"
# Serialized weights at least this large wait on disk, not in memory, until model.ptd is written.
SPILL_MIN_BYTES = 1 << 20
RUNTIME_PACKAGES = ("executorch",)
# --quantize applies to the module before export.
QUANTIZES_MODULE = True
# A float export from a checkpoint reads each weight as XNNPACK serializes it, and the weights left
# outside the delegate (a lookup's table) before the program is written (lower's ``deferred``); a
# quantized model's are read one at a time by quantize_model.
DEFERS_WEIGHTS = True
# --kv-cache int8 quantizes each row as it is written: nothing runs the model at export.
CALIBRATES_KV_CACHE = False
# --kv-cache int8: each row has a float32 scale and an int8 zero point.
INT8_KV_ROW_EXTRA_BYTES = 4 + 1
# A cache of one position is a decode-only program (T static at 1).
MIN_MAX_CACHE_LEN = 1
# --max-draft-tokens K: a second method, `verify`, of up to K + 1 tokens, returns every position's logits,
# sharing forward's cache buffers; rings keep K spare slots, so a call may start inside the verification.
RING_SPARE_SLOTS = True
VERIFY_METHOD = "verify"
# torch.export's dynamic sizes start at 2, so a bound of 2 on T would fix every call at 2 tokens,
# and decoding calls with 1: calls of up to 2 tokens are no one program.
CALL_BOUNDS_REFUSED = (2,)


def export(
    model: torch.nn.Module,
    max_cache_len: int,
    max_tokens_per_call: int,
    kv_cache: KvCache = KvCache.FLOAT,
    calibration_ids: torch.Tensor | None = None,
    max_draft_tokens: int = 0,
    sdpa_query: SdpaQuery = SdpaQuery.GROUPED,
    int8_kv_sdpa: Int8KvSdpa = Int8KvSdpa.QUANTIZED,
    decode_attention: DecodeAttention = DecodeAttention.CUSTOM_SDPA,
) -> torch.export.ExportedProgram | dict[str, torch.export.ExportedProgram]:
    """The cache lives in the program's mutable buffers, written and read by ExecuTorch's LLM
    custom ops (in-place update, fused attention over the filled positions only), in the model's
    dtype or in int8 (``kv_cache``; its scales are chosen per row as it is written, so
    ``calibration_ids`` is not needed). A call takes at most ``max_tokens_per_call`` tokens, the
    size ExecuTorch plans activation memory for. ``max_draft_tokens``: the programs of two methods,
    ``forward`` and ``verify`` (every position's logits), over the same buffers. ``sdpa_query``: the
    query rows a float cache's attention gives ``llama::custom_sdpa`` (``choose_sdpa_query``);
    ``int8_kv_sdpa``: the kernel an int8 cache's decode step attends with (``choose_int8_kv_sdpa``);
    ``decode_attention``: the kernel the full layers attend with in a short call (``by_call_length``)."""
    from .custom_op_cache import custom_op_caches
    from .quantized_kv_cache import quantized_caches
    from .stacked_projections import stacked_projections
    from .xnnpack_rewrites import rotary_as_matmul

    if kv_cache == KvCache.INT8:
        caches = quantized_caches(int8_kv_sdpa == Int8KvSdpa.QUANTIZED, decode_attention == DecodeAttention.KVEXPORT)
    else:
        caches = custom_op_caches(sdpa_query == SdpaQuery.GROUPED, decode_attention == DecodeAttention.KVEXPORT)
    with rotary_as_matmul(model), stacked_projections(model):
        decoder = ExportableDecoder(model, max_cache_len, caches, max_tokens_per_call, max_draft_tokens)
        if not max_draft_tokens:
            return export_decoder(decoder)
        return {"forward": export_decoder(decoder), VERIFY_METHOD: export_verifier(decoder, max_draft_tokens + 1)}


def choose_sdpa_query(requested: SdpaQuery, kv_cache: KvCache, text_config, specs: list,
                      max_cache_len: int) -> tuple[SdpaQuery | None, dict | None]:
    """``--sdpa-query``'s form for a float cache, and the timings ``auto`` chose it by
    (``sdpa_query.choose``); None for an int8 cache (its decode kernel takes one row per query head)
    and where ``auto`` finds no layer whose attention the choice changes."""
    if kv_cache != KvCache.FLOAT:
        return None, None
    from .sdpa_query import choose

    return choose(requested, text_config, specs, max_cache_len)


def choose_int8_kv_sdpa(requested: Int8KvSdpa, kv_cache: KvCache) -> Int8KvSdpa | None:
    """``--int8-kv-sdpa``'s kernel for an int8 cache (None for a float one). ``auto``: the int8
    kernel where this machine is aarch64, where torchao's int8 products are NEON micro-kernels; on
    any other CPU they are a scalar fallback, several times slower at decode than dequantizing the
    rows into the float kernel (docs/quantization.md#decode-in-the-float-kernel)."""
    if kv_cache != KvCache.INT8:
        return None
    if requested != Int8KvSdpa.AUTO:
        return requested
    return Int8KvSdpa.QUANTIZED if platform.machine().lower() in ("aarch64", "arm64") else Int8KvSdpa.DEQUANTIZED


def check_layers(specs: list, max_cache_len: int) -> None:
    """Every kind of layer runs on ExecuTorch: nothing to refuse."""


def check_kv_cache(kv_cache: KvCache, text_config, specs: list, max_cache_len: int) -> None:
    if getattr(text_config, "attn_logit_softcapping", None):
        # Its attention reads the rows dequantized (no fused int8 kernel soft-caps), and XNNPACK's
        # partitioner then groups the layer's ops into partitions that depend on each other.
        raise UnsupportedModelError(
            "--kv-cache int8 does not export soft-capped attention (attn_logit_softcapping, as in Gemma 2) for "
            "--target executorch in this version; export it with --kv-cache float, or for --target onnx"
        )


def describe_kv_cache(kv_cache: KvCache) -> dict:
    """What ``kvexport.json`` records under ``kv_cache`` for ``--kv-cache int8``."""
    return {
        "dtype": kv_cache,
        "scales": "float32 scale and int8 zero point per token and KV head (asymmetric, chosen when the row is written)",
        "keys": "rotated, with the queries, by one orthonormal Hadamard matrix of head_dim before they are quantized "
                "(where llama::custom_quantized_sdpa or llama::custom_sdpa attends)",
        "op": "decode: llama::custom_quantized_sdpa, the query quantized the same way (export_options.int8_kv_sdpa "
              "quantized), or the rows dequantized into llama::custom_sdpa (dequantized); longer calls: the latter",
    }


def quantize_model(model: torch.nn.Module, quantization: Quantization, deferred: DeferredWeights | None = None) -> list[str]:
    """Quantize the linear layers (``8da4w``) and embeddings in place with torchao, before export;
    with ``deferred``, each read from the checkpoint just before it is quantized, and the weights
    left in float read after."""
    from .quantize import quantize_model as quantize

    skipped = quantize(model, quantization, deferred.fill if deferred else None)
    if deferred:
        deferred.fill_all(model)
    return skipped


def quantize_files(out_dir: Path, spec: ProgramSpec, quantization: Quantization) -> dict:
    """Nothing: the module was quantized before export (``quantize_model``)."""
    return {}


def describe_quantization(quantization: Quantization, hidden_size: int) -> dict | None:
    if not quantization:
        return None
    scheme, embedding, lm_head = quantization.scheme, quantization.embedding, quantization.lm_head
    described: dict = {"scheme": scheme, "by": "kvexport.exporter.executorch.quantize (torchao tensors)"}
    activations = "int8, dynamic per token"
    if scheme and quantization.symmetric:
        described["grid"] = "symmetric"
        described["linear"] = {"weights": "int4", "group_size": GROUP_SIZE, "activations": activations, "symmetric": True,
                               "scales": "HQQ (ExecuTorch's 8da4w config)", "op": "XNNPACK int8 x int4"}
        described["lm_head"] = (described["linear"] if lm_head == LmHeadScheme.INT4
                                else {"weights": "int8", "group_size": "row", "activations": activations})
    elif scheme:
        described["linear"] = {"weights": "int4", "group_size": GROUP_SIZE, "activations": activations,
                               "op": "XNNPACK int8 x int4 + per-block offsets (int8, one scale per row)"}
        # A weight the source stores finer than 4 bits (GGUF Q5_0, Q6_K, Q8_0) is not rounded to 4.
        described["linear_finer_than_4_bits"] = {"weights": "int8", "group_size": "row", "activations": activations}
        described["lm_head"] = (
            {**described["linear"], "note": "--quantize-lm-head int4: a block on no 4-bit grid spans its min..max in 16 levels"}
            if lm_head == LmHeadScheme.INT4
            else {"weights": "int8", "group_size": "row", "activations": activations}
        )
    if embedding:
        described["embedding"] = {
            "weights": embedding,
            "group_size": GROUP_SIZE if embedding == EmbeddingScheme.INT4 else "row",
            "op": f"quantized_decomposed::{'embedding_4bit' if embedding == 'int4' else 'embedding_byte'}",
        }
    return described


def quantization_detail(quantization: Quantization) -> str:
    head = quantization.lm_head or LmHeadScheme.INT8
    grid = ", symmetric int4" if quantization.symmetric else ""
    parts = [f"8da4w linear weights{grid} ({head} lm_head)" if quantization.scheme else "",
             f"embedding {quantization.embedding}" if quantization.embedding else ""]
    return ", ".join(p for p in parts if p) + " (torchao tensors for XNNPACK)"


def _constant_methods(spec: ProgramSpec) -> dict:
    """Metadata methods of the ``.pte``, named and meant as ExecuTorch's ``llm_runner_helper`` reads them."""
    methods = {
        "get_max_seq_len": spec.max_tokens_per_call,  # most tokens one call takes: the prefill chunk
        "get_max_context_len": spec.max_cache_len,
        "use_kv_cache": True,
        "use_sdpa_with_kv_cache": False,
        # False for a decode-only program (T static at 1): the runner then prefills token by token.
        "enable_dynamic_shape": spec.max_tokens_per_call > 1,
        "get_eos_ids": spec.eos_token_ids,
        "get_vocab_size": spec.vocab_size,
        "get_n_layers": len(spec.layers),
    }
    if spec.bos_token_id is not None:
        methods["get_bos_id"] = spec.bos_token_id
    return methods


def lower(program: torch.export.ExportedProgram | dict[str, torch.export.ExportedProgram], spec: ProgramSpec,
          out_dir: Path, deferred: DeferredWeights | None = None) -> dict:
    """Lower to XNNPACK and write ``model.pte`` (one method, ``forward``, or each of a dict's, their
    mutable buffers shared by name); return facts for ``kvexport.json``. ``deferred``: the program's
    weights that are placeholders, each read from the checkpoint as it is serialized
    (``_weights_read_when_serialized``)."""
    from executorch.exir import EdgeCompileConfig, ExecutorchBackendConfig, to_edge_transform_and_lower
    from executorch.exir.passes import MemoryPlanningPass
    from executorch.exir.passes.sym_shape_eval_pass import ConstraintBasedSymShapeEvalPass

    from .edge_passes import operator_rewrites_chained
    from .xnnpack_partitioner import decomposed_once, functionalized_already, merge_checks_by_set_overlap, xnnpack_partitioner
    from .xnnpack_passes import only_the_passes_that_apply
    from .xnnpack_rewrites import XnnpackFriendlyShapes

    partitioner = xnnpack_partitioner(bfloat16=spec.dtype == "bfloat16")
    methods = program if isinstance(program, dict) else {"forward": program}
    methods = {name: decomposed_once(p, partitioner) for name, p in methods.items()}
    programs = list(methods.values())
    for p in programs:
        _tag_weights_for_data_file(p)
    # XNNPACK's serialized weights wait here (inside the staged artifact) until model.ptd is written.
    with tempfile.TemporaryDirectory(dir=out_dir, prefix=".weights-") as spill:
        with (_weights_shared_on_deepcopy(programs), _serialized_weights_on_disk(Path(spill)), only_the_passes_that_apply(),
              functionalized_already(programs), operator_rewrites_chained(), merge_checks_by_set_overlap(),
              _weights_read_when_serialized(deferred, programs) as read_outside_the_delegate):
            edge = to_edge_transform_and_lower(
                methods,
                transform_passes=[XnnpackFriendlyShapes()],
                partitioner=[partitioner],
                compile_config=EdgeCompileConfig(_check_ir_validity=False),
                constant_methods=_constant_methods(spec),
            )
            read_outside_the_delegate([edge.exported_program(name) for name in methods])
        # A quantized embedding is still torchao's dequantize + embedding: make it ExecuTorch's kernel.
        fused = fuse_quantized_embeddings(edge.exported_program("forward"))
        for name in methods.keys() - {"forward"}:
            fuse_quantized_embeddings(edge.exported_program(name))
        delegated, portable, custom = _op_counts(edge.exported_program("forward").graph_module)
        et_program = edge.to_executorch(
            ExecutorchBackendConfig(
                extract_delegate_segments=True,
                # The methods' caches are one set of buffers, shared by name.
                memory_planning_pass=MemoryPlanningPass(alloc_graph_input=False, share_mutable_buffers=len(methods) > 1),
                # Plan activation memory for the largest call (T = max_tokens_per_call), not the example input.
                sym_shape_eval_pass=ConstraintBasedSymShapeEvalPass(),
                # Methods' constants share one namespace in the data file, and constant propagation
                # names its results per method (`_prop_tensor_constant0`, ...): with several methods,
                # those stay in the program, where each method has its own.
                external_constants=_external_constants(len(methods) > 1),
                # Quantized embeddings (torchao dequantize + embedding) become ExecuTorch's
                # quantized_decomposed::embedding_* kernels; constant folding drops the packing ops.
                do_quant_fusion_and_const_prop=True,
            )
        )
        planned = _planned_memory_bytes(et_program)
        with open(out_dir / PROGRAM_FILE, "wb") as f:
            et_program.write_to_file(f)
        et_program.write_tensor_data_to_file(str(out_dir))
    if not (out_dir / WEIGHTS_FILE).is_file():
        raise RuntimeError(f"ExecuTorch wrote no {WEIGHTS_FILE}")
    return {
        "program": PROGRAM_FILE,
        "weights": WEIGHTS_FILE,
        # What a runtime allocates for forward's activations and KV cache (ExecuTorch's memory
        # plan), on top of the weights: it grows with max_tokens_per_call.
        "planned_memory_bytes": planned,
        "delegated_calls": delegated,
        "non_delegated_ops": portable,
        # Kernels beyond ExecuTorch's portable set that a runtime must link or register.
        "custom_ops": custom,
        **({"quantized_embedding_ops": fused} if fused else {}),
        **({"methods": list(methods)} if len(methods) > 1 else {}),
        # verify's calls take any length up to this (before, exactly this: a runner padded them).
        **({"verify_tokens": spec.max_draft_tokens + 1} if VERIFY_METHOD in methods else {}),
    }


@contextlib.contextmanager
def _weights_shared_on_deepcopy(programs: list[torch.export.ExportedProgram]):
    """``to_edge`` deep-copies the program it is given, weights included, while the caller's program
    (and the model it came from) keep theirs: one more copy of every weight at the export's peak
    (docs/performance.md; the artifact's bytes are the same).
    Lowering reads the weights and never changes them, so the copy may share them."""
    tensors = [t for p in programs for t in (*p.state_dict.values(), *p.constants.values()) if isinstance(t, torch.Tensor)]
    for t in tensors:
        t.__deepcopy__ = lambda memo, t=t: t
    try:
        yield
    finally:
        for t in tensors:
            t.__dict__.pop("__deepcopy__", None)


@contextlib.contextmanager
def _weights_read_when_serialized(deferred: DeferredWeights | None, programs: list[torch.export.ExportedProgram]):
    """With ``deferred``: while XNNPACK lowers, each placeholder weight it serializes is read from the
    checkpoint then, and let go once its bytes are on disk (``_serialized_weights_on_disk``), so the
    lowering never holds the float model. Yields the step to run on the lowered programs before they
    are written: their weights left outside the delegate (an embedding lookup's table, where a tied
    lm_head's copy went into the delegate) read too, one tensor per weight across the methods.
    Every placeholder of ``programs`` must have been read by one or the other: one a pass copied
    before it was read would be written as memory nobody wrote, and is refused instead."""
    if deferred is None:
        yield lambda lowered: None
        return
    from executorch.backends.xnnpack.operators import node_visitor

    held = {t.data_ptr(): deferred.source_of(t) for p in programs for t in (*p.state_dict.values(), *p.constants.values())
            if isinstance(t, torch.Tensor) and deferred.source_of(t) is not None}
    read: set[int] = set()
    get_param_tensor = node_visitor.get_param_tensor

    def read_if_placeholder(exported_program, node):
        tensor = get_param_tensor(exported_program, node)
        entry = deferred.source_of(tensor) if isinstance(tensor, torch.Tensor) else None
        if entry is None:
            return tensor
        read.add(tensor.data_ptr())
        return deferred.read(entry)

    def read_outside_the_delegate(lowered: list[torch.export.ExportedProgram]) -> None:
        values: dict[int, torch.Tensor] = {}
        for p in lowered:
            for tensors in (p.state_dict, p.constants):
                for name, tensor in tensors.items():
                    entry = deferred.source_of(tensor) if isinstance(tensor, torch.Tensor) else None
                    if entry is not None:
                        address = tensor.data_ptr()
                        if address not in values:
                            values[address] = deferred.read(entry).requires_grad_(tensor.requires_grad)
                        tensors[name] = values[address]
        unread = set(held) - read - set(values)
        if unread:
            raise KvexportError(
                f"lowering to ExecuTorch never read the checkpoint's {held[min(unread)].key} (and {len(unread) - 1} more) "
                "although the program holds it: please report it (the export would write memory nobody wrote)"
            )

    node_visitor.get_param_tensor = read_if_placeholder
    try:
        yield read_outside_the_delegate
    finally:
        node_visitor.get_param_tensor = get_param_tensor


@contextlib.contextmanager
def _serialized_weights_on_disk(folder: Path):
    """XNNPACK hands each weight it serializes to ExecuTorch's named data store as ``bytes``, which
    stay in memory beside the model's own weights until the data file is written: a second copy of
    the model at the export's peak. ExecuTorch's store also takes ``FileBackedData`` (its CUDA
    backend spills weights this way), so the weights bound for our data file are written to
    ``folder`` as they arrive and read back only when ``model.ptd`` is written: one model-sized copy
    less at the peak, the same bytes written."""
    from executorch.exir._serialize._cord import FileBackedData
    from executorch.exir._serialize._named_data_store import NamedDataStore

    add_named_data = NamedDataStore.add_named_data
    spilled = [0]

    def add_spilled(self, key, data, alignment=1, external_tag=None, tensor_layout=None):
        if external_tag == WEIGHTS_TAG and isinstance(data, bytes) and len(data) >= SPILL_MIN_BYTES:
            with tempfile.NamedTemporaryFile(dir=folder, suffix=".bin", delete=False) as f:
                f.write(data)
            spilled[0] += len(data)
            data = FileBackedData(f.name, cleanup=True)  # its sha256 only if dedup asks (lazily)
            report(f"{spilled[0] / 2**20:,.0f} MiB of weights serialized for XNNPACK")
        return add_named_data(self, key, data, alignment, external_tag, tensor_layout)

    NamedDataStore.add_named_data = add_spilled
    try:
        yield
    finally:
        NamedDataStore.add_named_data = add_named_data


def _external_constants(several_methods: bool):
    """Which constants ``model.ptd`` holds: every one, or with several methods, every one but those
    constant propagation made."""
    if not several_methods:
        return lambda node: WEIGHTS_TAG
    return lambda node: None if node.name.startswith("_prop_tensor_constant") else WEIGHTS_TAG


def _tag_weights_for_data_file(program: torch.export.ExportedProgram) -> None:
    """Ask XNNPACK to put the weights it takes into the shared data file too."""
    signature = program.graph_signature
    weights = set(signature.inputs_to_parameters) | set(signature.inputs_to_buffers)
    for node in program.graph.nodes:
        if node.op == "placeholder" and node.name in weights:
            node.meta.setdefault("custom", {})["delegate_constant_tag"] = WEIGHTS_TAG


def _planned_memory_bytes(et_program) -> int:
    """The memory plan's arenas, of the method that needs most (a program's methods share them)."""
    return max(sum(plan.non_const_buffer_sizes) for plan in et_program.executorch_program.execution_plan)


def _op_counts(graph_module: torch.fx.GraphModule) -> tuple[int, int, list[str]]:
    """XNNPACK delegate calls, ops left outside the delegate (the program's own graph), and the
    custom (non-aten) ops among them, in ``torch.cond`` branches too."""
    delegated = outside = 0
    custom: set[str] = set()
    for module in graph_module.modules():
        if not isinstance(module, torch.fx.GraphModule):
            continue
        for node in module.graph.nodes:
            if node.op != "call_function":
                continue
            target = node.args[0] if "auto_functionalized" in str(node.target) else node.target  # mutating custom ops
            name, counted = str(target), module is graph_module
            if "executorch_call_delegate" in name:
                delegated += counted
                continue
            if "getitem" in name:
                continue
            outside += counted
            # ExecuTorch's LLM ops, its quantized kernels (a quantized embedding), kvexport's own (kvexport/kernels).
            for namespace in ("llama", "quantized_decomposed", "kvexport"):
                if f"{namespace}." in name:
                    custom.add(f"{namespace}::" + name.split(f"{namespace}.")[1].split(".")[0])
    return delegated, outside, sorted(custom)
