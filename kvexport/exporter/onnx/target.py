"""ONNX target: ``model.onnx`` + ``model.onnx.data`` + ``genai_config.json``, a folder that
onnxruntime-genai loads as it is (``og.Model(folder)``) and kvexport's own runner runs too.

ONNX graphs hold no mutable state, so the cache crosses the graph boundary in onnxruntime-genai's
convention (see ``ExternalCacheDecoder``, ``attention``): ``input_ids``, an ``attention_mask`` of
ones whose width is the positions so far, and per layer a key and a value buffer that the runtime
allocates and binds as both past and present; each layer is one ``GroupQueryAttention`` node,
a sliding layer's over a window-sized buffer that the kernel itself keeps.
``kvexport.json``'s ``interface`` says how, for any runtime.
"""

from __future__ import annotations

import contextlib
import json
import re
from pathlib import Path

import torch

from ...artifact.manifest import Layer, buffer_layers, state_layers
from ...choices import KvCache, LmHeadScheme, SdpaQuery
from ...errors import UnsupportedModelError
from ...models.architecture import layer_specs
from ...models.deferred_weights import DeferredWeights
from ..quantization import Quantization
from ..targets import ProgramSpec
from .attention import ONNX_TRANSLATIONS as ATTENTION_TRANSLATIONS
from .attention import lengths_from_mask
from .decoder import ExternalCacheDecoder, export_external_cache_decoder
from .lazy_weights import check_no_placeholder_left, lazy_transposes, read_weights_when_written
from .quantize import ACCURACY_LEVEL, BLOCK, FINE_BLOCK, table_block
from .quantized_kv_cache import WINDOW_HEAD_DIM_MULTIPLE, calibrate, use_int8_buffers
from .rotary import ONNX_TRANSLATIONS as ROTARY_TRANSLATIONS
from .rotary import fold_rotations_into_attention, rotary_as_kernel

PROGRAM_FILE = "model.onnx"
# Weights always go to one external file: a single layout for every model, and ONNX's protobuf
# cannot hold more than 2 GB.
DATA_FILE = "model.onnx.data"
RUNTIME_PACKAGES = ("onnx", "onnxruntime", "onnxscript", "onnxruntime_genai")
# --quantize applies to the written graph.
QUANTIZES_MODULE = False
# Each weight is written on its own (external data): a model may load with its large weights left in
# the checkpoint, each read as it is written (lower's ``deferred``).
DEFERS_WEIGHTS = True
# --kv-cache int8's scales are fixed at export, measured by running the model on a text.
CALIBRATES_KV_CACHE = True
# --kv-cache int8: rows are int8 values only; the scales are fixed, one per KV head and channel.
INT8_KV_ROW_EXTRA_BYTES = 0
GENAI_CONFIG = "genai_config.json"
# The graph's sizes are traced from a call of 2 tokens after a cached position: torch.export
# specialises a size of 1, and equates the call's size with the mask's where both are 2.
MIN_MAX_CACHE_LEN = 3
# --max-draft-tokens: the graph takes logits_indices (decoder.ExternalCacheDecoder); a sliding
# buffer keeps exactly the window, which the runner rebuilds after rejected drafted tokens.
RING_SPARE_SLOTS = False
# The graph takes any T: --prefill-chunk is the interface's limit, which runners keep to.
CALL_BOUNDS_REFUSED = ()

# Symbolic dimensions of the graph's inputs and outputs.
SYMBOLS = {
    "T": "tokens in this call: 1 <= T <= max_tokens_per_call",
    "total": "positions so far, this call's included: P + T <= max_cache_len",
    "cache_rows": "rows of a full-attention layer's buffer: at least P + T (kvexport's runner: max_cache_len; "
    "onnxruntime-genai: the generation's max_length)",
    "window_rows": "rows of a sliding layer's buffer: at least its window (kvexport's runner: the window)",
}


def export(
    model: torch.nn.Module,
    max_cache_len: int,
    max_tokens_per_call: int,
    kv_cache: KvCache = KvCache.FLOAT,
    calibration_ids: torch.Tensor | None = None,
    max_draft_tokens: int = 0,
) -> torch.export.ExportedProgram:
    """The cache crosses the graph boundary: past rows in, the call's new rows out. Rotary
    embeddings go through ONNX Runtime's kernel where the family's rotation is the standard one.
    ``kv_cache`` int8: int8 buffers with fixed scales measured on ``calibration_ids``
    (``quantized_kv_cache``).

    ONNX Runtime sizes memory per call, so the graph itself takes any ``T`` the cache holds (its
    rotary tables are computed from a call of ``max_cache_len`` tokens); ``max_tokens_per_call``
    is the interface's limit, which runners keep to (``interface``). ``max_draft_tokens``: the graph
    also takes ``logits_indices`` (the positions whose logits a verification reads); a runner
    rebuilds a sliding layer's buffer after rejected drafted tokens (runtime/onnx_program.py)."""
    # Linear attention pads each call's system to the longest call: the bound matters there.
    has_states = any(spec.state_kind for spec in layer_specs(model.config))
    decoder = ExternalCacheDecoder(model, max_cache_len, max_tokens_per_call if has_states else None, max_draft_tokens > 0)
    if kv_cache == KvCache.INT8:
        use_int8_buffers(decoder, calibrate(decoder, calibration_ids))
    with rotary_as_kernel(decoder.model):
        return export_external_cache_decoder(decoder)


# onnxruntime-genai's names (genai_config.json's inputs / outputs templates).
PAST, PRESENT = "past_key_values.{index}.{kv}", "present.{index}.{kv}"
# The states of a layer that does not attend (exporter/onnx/states.py), by its cache kind.
PAST_STATE, PRESENT_STATE = "past_state.{index}.{state}", "present_state.{index}.{state}"
STATES = {"conv": ("conv",), "recurrent": ("conv", "recurrent")}


def choose_sdpa_query(requested: SdpaQuery, kv_cache: KvCache, text_config, specs: list, max_cache_len: int) -> tuple[None, None]:
    """No choice: ONNX Runtime's attention is its own kernel's (``--sdpa-query`` is refused before)."""
    return None, None


def choose_int8_kv_sdpa(requested, kv_cache: KvCache) -> None:
    """No choice: ONNX Runtime's attention is its own kernel's (``--int8-kv-sdpa`` is refused before)."""
    return None


def check_layers(specs: list, max_cache_len: int) -> None:
    """Refuse, before the model loads, layers this target cannot describe."""
    windows = sorted({s.window for s in specs if s.is_ring(max_cache_len) and not s.chunk})
    if len(windows) > 1:  # genai_config.json has one sliding_window section
        raise UnsupportedModelError(
            f"sliding layers with different windows ({windows}): the ONNX target supports one window per model"
        )


def io_names(layers: list[Layer], verifies: bool = False) -> tuple[list[str], list[str]]:
    """Graph input and output names, in ``ExternalCacheDecoder.forward``'s order: the n-th buffer
    layer's (``buffer_layers``) past and present are numbered n; then each state of the layers that
    do not attend, named by the layer's index; then, in a graph that ``verifies``, ``logits_indices``."""
    inputs, outputs = ["input_ids", "attention_mask"], ["logits"]
    for n, _ in enumerate(buffer_layers(layers)):
        for kv in ("key", "value"):
            inputs.append(PAST.format(index=n, kv=kv))
            outputs.append(PRESENT.format(index=n, kv=kv))
    for layer in state_layers(layers):
        for state in STATES[layer.cache]:
            inputs.append(PAST_STATE.format(index=layer.index, state=state))
            outputs.append(PRESENT_STATE.format(index=layer.index, state=state))
    return inputs + [LOGITS_INDICES] * verifies, outputs


# A verifying graph's input naming the call's positions whose logits come out (decoder.ExternalCacheDecoder).
LOGITS_INDICES = "logits_indices"


def quantize_model(model: torch.nn.Module, quantization: Quantization, deferred: DeferredWeights | None = None) -> list[str]:
    """Nothing: ONNX quantizes the written graph's weights (``quantize_files``)."""
    return []


def lower(
    program: torch.export.ExportedProgram, spec: ProgramSpec, out_dir: Path, deferred: DeferredWeights | None = None
) -> dict:
    """Convert to ONNX, check it, write ``model.onnx`` + ``model.onnx.data``; return facts for
    ``kvexport.json``. ``deferred``: the program's weights that are placeholders, each read from the
    checkpoint as the data file is written (``lazy_weights``)."""
    import onnx

    input_names, output_names = io_names(spec.layers, spec.max_draft_tokens > 0)
    with _exact_no_op_rules():
        onnx_program = torch.onnx.export(
            program,
            (),
            dynamo=True,
            input_names=input_names,
            output_names=output_names,
            custom_translation_table={**ATTENTION_TRANSLATIONS, **ROTARY_TRANSLATIONS},
            verbose=False,
            # With deferred weights the lazy reads go in before the optimizer folds any weight.
            optimize=deferred is None,
        )
        if deferred is not None:
            read_weights_when_written(onnx_program.model, deferred)
            with lazy_transposes():
                onnx_program.optimize()
            check_no_placeholder_left(onnx_program.model, deferred)
    if spec.dtype == "float32":
        _fuse_norms(onnx_program.model)
    _tidy(onnx_program.model, spec.layers)
    _drop_identity_reshapes(onnx_program.model)
    path = out_dir / PROGRAM_FILE
    onnx_program.save(path, external_data=True)
    # onnxscript's rewrite rules (module-level objects) keep the last graph they matched, whose
    # initializers hold the model's own tensors: let go of them, or the float model outlives the
    # export (and doubles the peak of --quantize int4, which runs after it).
    for value in onnx_program.model.graph.initializers.values():
        value.const_value = None
    del onnx_program
    lengths_from_mask(path)
    fold_rotations_into_attention(path, spec.max_cache_len)
    if spec.max_draft_tokens:
        _last_position_by_default(path)
    _check(path)
    graph = onnx.load(str(path), load_external_data=False)
    facts = {"program": PROGRAM_FILE, "external_data": DATA_FILE}
    if reason := genai_cannot_run(spec.layers):
        facts["genai_unsupported"] = reason
    else:
        (out_dir / GENAI_CONFIG).write_text(json.dumps(genai_config(spec), indent=2) + "\n")
        facts["genai_config"] = GENAI_CONFIG
    return {**facts, "opset": _opset(graph), "interface": interface(graph, spec)}


def _last_position_by_default(path: Path) -> None:
    """Give ``logits_indices`` a default, ``[-1]`` (an initializer of the input's name, which a caller
    may override): a runtime that does not know the input (onnxruntime-genai) gets the last
    position's logits, as from a graph without it. The logits are declared ``[1, 1, vocab]``, the
    default's shape: onnxruntime-genai sizes them ``[1, T, vocab]`` where that dimension is not 1."""
    import numpy as np
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(path), load_external_data=False)
    model.graph.initializer.append(numpy_helper.from_array(np.array([-1], np.int64), LOGITS_INDICES))
    logits = next(v for v in model.graph.output if v.name == "logits")
    logits.type.tensor_type.shape.dim[1].Clear()
    logits.type.tensor_type.shape.dim[1].dim_value = 1
    onnx.save(model, str(path))


def genai_cannot_run(layers: list[Layer]) -> str | None:
    """Why onnxruntime-genai cannot run the graph of these layers (None: it can).

    A chunked-attention layer (``attention.ExternalChunkedLayer``) reads its past buffer as a
    shared layer reads a window's, below.

    A layer that shares a sliding layer's cache reads the window buffer the kernel left, row ``r``
    holding position ``total - min(total, rows) + r``, which holds where the buffer has the
    window's rows, as kvexport's runner gives it. genai gives it more, and the kernel compacts
    such a buffer to the window when it fills, so where its newest rows end depends on the
    calls so far, which the graph cannot know. (A window Gemma 3n's sharing layers read runs in
    plain ops, whose layout holds for any rows; genai has not been tried on it, so it is refused
    the same way.)"""
    if state_layers(layers):
        return "layers with a convolution's or a recurrent state, which kvexport's graph passes as inputs genai does not know"
    by_index = {layer.index: layer for layer in layers}
    if any(layer.cache == "ring" and layer.chunk for layer in layers):
        return "chunked-attention layers read a window buffer of exactly the chunk's rows, which genai does not allocate"
    if any(layer.cache == "shared" and by_index[layer.reads].cache == "ring" for layer in layers):
        return "layers that share a sliding layer's cache read a window buffer of exactly the window's rows, which genai does not allocate"
    return None


def check_kv_cache(kv_cache: KvCache, text_config, specs: list, max_cache_len: int) -> None:
    odd = sorted({s.head_dim for s in specs if s.is_ring(max_cache_len) and s.head_dim % WINDOW_HEAD_DIM_MULTIPLE})
    if odd:
        raise UnsupportedModelError(
            f"--kv-cache int8 with sliding layers of head size {odd[0]}: ONNX Runtime's kernel takes an int8 window "
            f"of head sizes that are multiples of {WINDOW_HEAD_DIM_MULTIPLE} only; export it with --kv-cache float, "
            "or for --target executorch"
        )


def describe_kv_cache(kv_cache: KvCache) -> dict:
    """What ``kvexport.json`` records under ``kv_cache`` for ``--kv-cache int8``."""
    return {
        "dtype": kv_cache,
        "scales": "float32 scale per KV head and channel, symmetric, fixed at export: the largest magnitude on "
                  "kvexport's calibration text (keys: with its rotary positions moved across the cache), a quarter "
                  "above that for keys and a half for values, saturating beyond it",
        "op": "com.microsoft::GroupQueryAttention, k_quant_type and v_quant_type PER_CHANNEL, kv_cache_bit_width 8",
    }  # fmt: skip


def genai_config(spec: ProgramSpec) -> dict:
    """onnxruntime-genai's description of the folder: the graph's names, the cache's shape, and
    greedy search to ``max_cache_len``. Its sliding layers get window-sized buffers it never slides
    itself (the kernel evicts), and ``past_present_share_buffer`` binds each present to its past.
    genai knows a layer by its buffers: ``num_hidden_layers`` counts the layers that hold a cache,
    and where their shapes differ it reads each from the graph's inputs (the first is the default)."""
    layers = buffer_layers(spec.layers)
    sliding = [n for n, layer in enumerate(layers) if layer.cache == "ring"]
    eos = spec.eos_token_ids or [-1]  # -1: no end-of-sequence token
    decoder = {
        "session_options": {"log_id": "onnxruntime-genai", "provider_options": []},
        "filename": PROGRAM_FILE,
        "head_size": layers[0].head_dim,
        "hidden_size": spec.hidden_size,
        "inputs": {"input_ids": "input_ids", "attention_mask": "attention_mask",
                   "past_key_names": PAST.format(index="%d", kv="key"), "past_value_names": PAST.format(index="%d", kv="value")},
        "outputs": {"logits": "logits",
                    "present_key_names": PRESENT.format(index="%d", kv="key"), "present_value_names": PRESENT.format(index="%d", kv="value")},
        "num_attention_heads": spec.num_attention_heads,
        "num_hidden_layers": len(layers),
        "num_key_value_heads": layers[0].kv_heads,
    }  # fmt: skip
    if sliding:
        window = next(layer.window for layer in layers if layer.cache == "ring")
        decoder["sliding_window"] = {"window_size": window, "layers": sliding,
                                     "slide_key_value_cache": False, "slide_inputs": False}  # fmt: skip
    return {
        "model": {
            "bos_token_id": spec.bos_token_id if spec.bos_token_id is not None else eos[0],
            "eos_token_id": eos if len(eos) > 1 else eos[0],
            "pad_token_id": eos[0],
            "context_length": spec.max_cache_len,
            "vocab_size": spec.vocab_size,
            "type": "decoder",
            "decoder": decoder,
        },
        "search": {
            "do_sample": False, "num_beams": 1, "num_return_sequences": 1, "top_k": 1, "top_p": 1.0,
            "temperature": 1.0, "repetition_penalty": 1.0, "length_penalty": 1.0, "diversity_penalty": 0.0,
            "no_repeat_ngram_size": 0, "early_stopping": True, "min_length": 0,
            "max_length": spec.max_cache_len, "past_present_share_buffer": True,
        },
    }  # fmt: skip


def quantize_files(out_dir: Path, spec: ProgramSpec, quantization: Quantization) -> dict:
    """``--quantize int4``: the written graph's weights to 4 bits (8 for the embedding, and for the
    lm_head unless ``quantization.lm_head`` is ``int4``; ONNX Runtime's MatMulNBits and GatherBlockQuantized),
    rewritten in place as ``model.onnx`` + ``model.onnx.data``, then checked again. The interface
    does not change."""
    import onnx

    from .quantize import quantize_onnx

    path = out_dir / PROGRAM_FILE
    ops = quantize_onnx(path, DATA_FILE, quantization.lm_head or LmHeadScheme.INT8, symmetric=quantization.symmetric)
    _check(path)
    return {"opset": _opset(onnx.load(str(path), load_external_data=False)), "quantized_ops": ops}


def describe_quantization(quantization: Quantization, hidden_size: int) -> dict | None:
    """``hidden_size`` is the lm_head's and embedding table's K, which sets their block."""
    if not quantization:
        return None
    lm_head = quantization.lm_head
    embedding = {"weights": "int8", "symmetric": True, "block_size": table_block(hidden_size),
                 "op": "com.microsoft::GatherBlockQuantized"}
    if quantization.symmetric:
        linear = {"weights": "int4", "symmetric": True, "block_size": BLOCK, "accuracy_level": ACCURACY_LEVEL,
                  "op": "com.microsoft::MatMulNBits", "rounding": "onnxruntime's quantize_matmul_4bits, symmetric"}
        return {
            "scheme": "int4", "grid": "symmetric", "by": "kvexport.exporter.onnx.quantize", "linear": linear,
            "lm_head": linear if lm_head == LmHeadScheme.INT4 else {"weights": "int8", "symmetric": True, "block_size": table_block(hidden_size),
                                                        "op": "com.microsoft::MatMulNBits"},
            "embedding": embedding,
        }
    return {
        "scheme": "int4",
        "by": "kvexport.exporter.onnx.quantize",
        "linear": {"weights": "int4", "symmetric": False, "block_size": BLOCK, "accuracy_level": ACCURACY_LEVEL,
                   "op": "com.microsoft::MatMulNBits + per-block offset"},
        # A weight the source stores finer than 4 bits (GGUF Q5_0, Q6_K, Q8_0) is not rounded to 4.
        "linear_finer_than_4_bits": {"weights": "int8", "symmetric": True,
                                     "block_size": f"{BLOCK}, or {FINE_BLOCK} where the source steps runs of {FINE_BLOCK} (Q6_K)",
                                     "accuracy_level": ACCURACY_LEVEL, "op": "com.microsoft::MatMulNBits"},
        "lm_head": (
            {"weights": "int4", "symmetric": False, "block_size": BLOCK, "zero_points": "4-bit, one a block",
             "accuracy_level": ACCURACY_LEVEL, "op": "com.microsoft::MatMulNBits",
             "note": "--quantize-lm-head int4: each block's zero point the one whose smallest step reaches its min and max"}
            if lm_head == LmHeadScheme.INT4
            else {"weights": "int8", "symmetric": True, "block_size": table_block(hidden_size),
                  "op": "com.microsoft::MatMulNBits"}
        ),
        "embedding": embedding,
    }


def quantization_detail(quantization: Quantization) -> str:
    grid = ", symmetric" if quantization.symmetric else ""
    return (f"int4 linear weights{grid} ({quantization.lm_head or 'int8'} lm_head), MatMul -> MatMulNBits, "
            "Gather -> GatherBlockQuantized int8 (ONNX Runtime)")


@contextlib.contextmanager
def _exact_no_op_rules():
    """torch.onnx's optimization without onnxscript's no-op rules for arithmetic: they remove
    ``x + c`` and ``x - c`` where ``c`` is *close* to 0 (within 1e-8), ``x * c`` and ``x / c`` where
    it is close to 1 (within 1e-5). Helium's RMS norm adds an epsilon of 1e-8: the rule dropped it,
    and a hidden state of zeros (a padding token's embedding) became NaN. An exact 0 or 1 left in
    the graph costs an elementwise op; the other rules run as they do."""
    from onnxscript import rewriter
    from onnxscript.rewriter.rules.common import _no_op

    arithmetic = set(map(id, _no_op.rules)) - {id(_no_op.dropout_zero_rule), id(_no_op.dropout_inference_rule)}
    default = rewriter._DEFAULT_REWRITE_RULES
    rewriter._DEFAULT_REWRITE_RULES = tuple(rule for rule in default if id(rule) not in arithmetic)
    try:
        yield
    finally:
        rewriter._DEFAULT_REWRITE_RULES = default


def _fuse_norms(model) -> None:
    """RMS norms (``x * rsqrt(mean(x^2) + eps) * w``, seven nodes) as ONNX Runtime's
    ``SimplifiedLayerNormalization``, with the residual sum before them as its
    ``SkipSimplifiedLayerNormalization``: onnxscript's own fusion rules for ONNX Runtime.

    Float32 graphs only: where a float16 family computes its norm in float32 (Gemma 3), the fused
    skip norm binds one type parameter to both and ONNX Runtime refuses the graph."""
    from onnxscript.rewriter.ort_fusions.rms_normalization import fuse_rms_normalization
    from onnxscript.rewriter.ort_fusions.skip_normalization import fuse_skip_rms_normalization

    fuse_rms_normalization(model)
    fuse_skip_rms_normalization(model)


def _teach_onnx_default_domain_kernels() -> None:
    """ONNX Runtime registers ``SimplifiedLayerNormalization`` in the default domain, where
    onnx.checker knows no such op: give onnx its signature (once per process) so the check still
    covers the whole graph."""
    from onnx import defs

    if defs.has("SimplifiedLayerNormalization"):
        return
    floats = ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"]
    optional = defs.OpSchema.FormalParameterOption.Optional
    defs.register_schema(
        defs.OpSchema(
            "SimplifiedLayerNormalization",
            "",
            1,
            inputs=[defs.OpSchema.FormalParameter("X", "T"), defs.OpSchema.FormalParameter("scale", "V")],
            outputs=[
                defs.OpSchema.FormalParameter("Y", "V"),
                defs.OpSchema.FormalParameter("inv_std_var", "U", param_option=optional),
            ],
            type_constraints=[("T", floats, ""), ("U", floats, ""), ("V", floats, "")],
            attributes=[
                defs.OpSchema.Attribute("axis", defs.OpSchema.AttrType.INT, "", required=False),
                defs.OpSchema.Attribute("epsilon", defs.OpSchema.AttrType.FLOAT, "", required=False),
                defs.OpSchema.Attribute("stash_type", defs.OpSchema.AttrType.INT, "", required=False),
            ],
        )
    )


def _opset(graph) -> int:
    return next(o.version for o in graph.opset_import if o.domain in ("", "ai.onnx"))


def _check(path: Path) -> None:
    import onnx

    _teach_onnx_default_domain_kernels()
    try:
        # By path: the checker then reads the external data file as a runtime would.
        onnx.checker.check_model(str(path), full_check=True)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UnsupportedModelError(f"the exported ONNX model does not pass onnx.checker ({first}); nothing was written")


def _tidy(model, layers: list[Layer]) -> None:
    """Rename the exporter's symbols (``s27``, ``s27 + 6``, ...) everywhere in the graph: the
    call's length to ``T``, the mask's width to ``total``, a sliding buffer's rows to
    ``window_rows``; and drop the export's stack traces from the nodes."""
    import onnx_ir as ir

    inputs = {v.name: v for v in model.graph.inputs}
    names = {str(inputs["input_ids"].shape[1]): "T", str(inputs["attention_mask"].shape[1]): "total"}
    rings = {n for n, layer in enumerate(buffer_layers(layers)) if layer.cache == "ring"}
    for value in model.graph.inputs:
        if (match := _CACHE_NAME.fullmatch(value.name)) and isinstance(value.shape[2], ir.SymbolicDim):
            names[str(value.shape[2])] = "window_rows" if int(match.group(2)) in rings else "cache_rows"
    pattern = re.compile(r"\b(" + "|".join(map(re.escape, names)) + r")\b")

    def rename(dim):
        if isinstance(dim, ir.SymbolicDim) and dim.value:
            return ir.SymbolicDim(pattern.sub(lambda m: names[m.group(1)], dim.value))
        return dim

    nodes = list(ir.traversal.RecursiveGraphIterator(model.graph))
    for node in nodes:
        # Python stack traces of the export: most of the file's size, and paths of the exporting machine.
        node.metadata_props.pop("pkg.torch.onnx.stack_trace", None)
    for value in list(model.graph.inputs) + [out for node in nodes for out in node.outputs]:
        if value.shape is not None:
            value.shape = ir.Shape([rename(d) for d in value.shape])


def _drop_identity_reshapes(model) -> int:
    """Bypass each chain of Reshapes that ends in the shape it started from (attention's output,
    ``[1, T, heads * head_dim]``, is viewed as ``[1, T, heads, head_dim]`` and back before the
    output projection: two nodes per layer that ONNX Runtime runs every call); return how many.
    Shapes compare as the exporter wrote them, ``T`` for the call's length (``_tidy``)."""
    import onnx_ir as ir
    from onnx_ir.passes.common import RemoveUnusedNodesPass

    def known(shape) -> bool:
        return shape is not None and all(isinstance(d, int) or (isinstance(d, ir.SymbolicDim) and d.value) for d in shape)

    bypassed = 0
    for node in list(model.graph):
        if node.op_type != "Reshape" or node.outputs[0].is_graph_output():
            continue
        start = node.inputs[0]
        while start.producer() is not None and start.producer().op_type == "Reshape":
            start = start.producer().inputs[0]
        end = node.outputs[0]
        if known(start.shape) and known(end.shape) and list(start.shape) == list(end.shape):
            ir.convenience.replace_all_uses_with(end, start)
            bypassed += 1
    RemoveUnusedNodesPass()(model)
    return bypassed


_ONNX_DTYPES = {1: "float32", 10: "float16", 16: "bfloat16", 7: "int64", 6: "int32", 3: "int8"}
_CACHE_NAME = re.compile(r"(past_key_values|present)\.(\d+)\.(key|value)")
_STATE_NAME = re.compile(r"(past_state|present_state)\.(\d+)\.(conv|recurrent)")


def _describe(value, layers_by_buffer: list) -> dict:
    dims = [d.dim_param or d.dim_value for d in value.type.tensor_type.shape.dim]
    entry = {"name": value.name, "dtype": _ONNX_DTYPES[value.type.tensor_type.elem_type], "shape": dims}
    match = _CACHE_NAME.fullmatch(value.name)
    if value.name == "input_ids":
        entry["meaning"] = "token ids of this call"
    elif value.name == "attention_mask":
        entry["meaning"] = "ones, one per position so far (P + T): its width tells the graph where the call starts"
    elif value.name == "logits":
        entry["meaning"] = "logits of the call's last position (of logits_indices' positions, where the graph has it)"
    elif value.name == LOGITS_INDICES:
        entry["meaning"] = ("optional (default [-1]): the call's positions whose logits come out, indices into "
                            "the call (negative from its end); 0 .. T-1 verifies drafted tokens")
    elif state := _STATE_NAME.fullmatch(value.name):
        kind, entry["layer"], what = state.group(1), int(state.group(2)), state.group(3)
        held = "its convolution's last inputs" if what == "conv" else "its recurrent state (float32)"
        entry["meaning"] = (f"the layer's state before this call: {held}" if kind == "past_state" else
                            "the state after this call: the next call's past (a separate buffer, not the past's memory)")
    elif match:
        kind, index, kv = match.group(1), int(match.group(2)), match.group(3)
        layer = layers_by_buffer[index]
        entry["layer"] = layer.index
        if kind == "past" and layer.cache == "static":
            entry["meaning"] = f"the layer's whole {kv} buffer (rows 0 .. P-1 filled)"
        elif kind == "past":
            entry["meaning"] = f"the layer's whole {kv} window buffer (the newest min(P, rows) positions from row 0)"
        else:
            entry["meaning"] = f"the {kv} buffer with this call written: bind it to the past's memory"
    return entry


SHARED_LAYERS = (
    "; a layer that shares an earlier layer's cache has none (past_key_values.n is the n-th layer that holds one)"
)


def interface(graph, spec: ProgramSpec) -> dict:
    """The graph's inputs and outputs, and how a runtime drives the cache: enough for any runtime."""
    layers_by_buffer = buffer_layers(spec.layers)
    return {
        "inputs": [_describe(v, layers_by_buffer) for v in graph.graph.input],
        "outputs": [_describe(v, layers_by_buffer) for v in graph.graph.output],
        "symbols": SYMBOLS,
        "calls": "contiguous: each call starts where the previous one ended; start at 0 for a new sequence",
        # --prefill-chunk: kvexport's runner splits a longer prompt; the graph itself takes any T.
        "max_tokens_per_call": spec.max_tokens_per_call,
        "convention": f"onnxruntime-genai's ({GENAI_CONFIG}): past_present_share_buffer, sliding layers "
        "with slide_key_value_cache false",
        "cache": {
            "owner": "the runtime: per layer, a key and a value buffer allocated once and filled with zeros"
            + (SHARED_LAYERS if len(layers_by_buffer) < len(spec.layers) else ""),
            "layout": "static: [1, kv_heads, cache_rows, head_dim]; ring: [1, kv_heads, window_rows, head_dim] "
            "(head-major, ONNX Runtime's GroupQueryAttention)",
            "static": "past = the whole buffer; present = the same buffer with rows P .. P+T-1 written: bind present "
            "to the past's memory and it is written in place, reading rows 0 .. P+T-1 only; a runtime that does "
            "not alias them passes present as the next past",
            "ring": "the same binding; GroupQueryAttention with sliding_window_cache keeps the newest positions in "
            "order from row 0 and evicts the oldest itself: the runtime never moves a row"
            + (RING_REWIND if spec.max_draft_tokens else ""),
            "new_sequence": "call with an attention_mask of width T (P = 0): nothing needs clearing",
            **({"states": STATES_RULE} if state_layers(spec.layers) else {}),
        },
    }


RING_REWIND = (
    "; after a verification whose last drafted tokens were rejected, the next call starts inside it: the runtime "
    "then rebuilds the buffer as the kernel keeps it (the newest positions before the call in order from row 0) "
    "from the buffer the verification left and a copy of its first T rows taken before it (kvexport's runner)"
)


STATES_RULE = (
    "a layer that does not attend (cache conv or recurrent) has past_state.i.* inputs and present_state.i.* "
    "outputs (i: the layer's index), zeros at first: pass each present as the next call's past, in a buffer of "
    "its own (the graph reads the past after it begins writing the present); a call at P = 0 ignores the past"
)
