"""ONNX target: ``model.onnx`` + ``model.onnx.data``, with the KV cache owned by the runtime.

ONNX graphs hold no mutable state, so the cache crosses the graph boundary (see
``ExternalCacheDecoder``, ``onnx_attention``): each layer is one ``GroupQueryAttention`` node that
takes the runtime's whole buffer and returns it with the call's rows written (in place when both
are bound to the same memory); a sliding layer's buffer has ``2 * window`` rows, which the runtime
keeps contiguous in positions, and the node reads only the window.
``kvexport.json``'s ``interface`` says how, for any runtime.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from ...errors import UnsupportedModelError
from ..quantization import Quantization
from ..targets import ProgramSpec
from .attention import ONNX_TRANSLATIONS as ATTENTION_TRANSLATIONS
from .attention import lengths_as_inputs
from .decoder import ExternalCacheDecoder, export_external_cache_decoder
from .quantize import ACCURACY_LEVEL, BLOCK, FINE_BLOCK, table_block
from .rotary import ONNX_TRANSLATIONS as ROTARY_TRANSLATIONS
from .rotary import fold_rotations_into_attention, rotary_as_kernel

PROGRAM_FILE = "model.onnx"
# Weights always go to one external file: a single layout for every model, and ONNX's protobuf
# cannot hold more than 2 GB.
DATA_FILE = "model.onnx.data"
SUPPORTED_DTYPES = ("float32", "float16")
RUNTIME_PACKAGES = ("onnx", "onnxruntime", "onnxscript")
# --quantize applies to the written graph.
QUANTIZES_MODULE = False
# A sliding layer's buffer has 2 * window rows, kept contiguous in positions (see interface).
RING_WINDOWS = 2

# Symbolic dimensions of the graph's inputs and outputs.
SYMBOLS = {
    "T": "tokens in this call: 1 <= T <= max_tokens_per_call, and input_pos[0] + T <= max_cache_len",
}


def export(model: torch.nn.Module, max_cache_len: int, max_tokens_per_call: int) -> torch.export.ExportedProgram:
    """The cache crosses the graph boundary: past rows in, the call's new rows out. Rotary
    embeddings go through ONNX Runtime's kernel where the family's rotation is the standard one.

    ONNX Runtime sizes memory per call, so the graph itself takes any ``T`` the cache holds (its
    rotary tables are computed from a call of ``max_cache_len`` tokens); ``max_tokens_per_call``
    is the interface's limit, which runners keep to (``interface``)."""
    decoder = ExternalCacheDecoder(model, max_cache_len)
    windows = {layer.window for layer in decoder.caches if layer.window}
    if len(windows) > 1:  # one ring_start serves every ring
        raise UnsupportedModelError(
            f"sliding layers with different windows ({sorted(windows)}): the ONNX target supports one window per model"
        )
    with rotary_as_kernel(decoder.model):
        return export_external_cache_decoder(decoder)


def io_names(layers: list[dict]) -> tuple[list[str], list[str]]:
    """Graph input and output names, in ``ExternalCacheDecoder.forward``'s order."""
    inputs, outputs = ["tokens", "input_pos"], ["logits"]
    if any(layer["cache"] == "ring" for layer in layers):
        inputs.append("ring_start")
    for layer in layers:
        for kv in ("key", "value"):
            inputs.append(f"past_{kv}_{layer['index']}")
            outputs.append(f"present_{kv}_{layer['index']}")
    return inputs, outputs


def quantize_model(model: torch.nn.Module, quantization: Quantization) -> list[str]:
    """Nothing: ONNX quantizes the written graph's weights (``quantize_files``)."""
    return []


def lower(program: torch.export.ExportedProgram, spec: ProgramSpec, out_dir: Path) -> dict:
    """Convert to ONNX, check it, write ``model.onnx`` + ``model.onnx.data``; return facts for ``kvexport.json``."""
    import onnx

    input_names, output_names = io_names(spec.layers)
    onnx_program = torch.onnx.export(
        program,
        (),
        dynamo=True,
        input_names=input_names,
        output_names=output_names,
        custom_translation_table={**ATTENTION_TRANSLATIONS, **ROTARY_TRANSLATIONS},
        verbose=False,
    )
    if spec.dtype == "float32":
        _fuse_norms(onnx_program.model)
    _tidy(onnx_program.model)
    _drop_identity_reshapes(onnx_program.model)
    path = out_dir / PROGRAM_FILE
    onnx_program.save(path, external_data=True)
    del onnx_program
    fold_rotations_into_attention(path, spec.max_cache_len)
    lengths_as_inputs(path)
    _check(path)
    graph = onnx.load(str(path), load_external_data=False)
    return {
        "program": PROGRAM_FILE,
        "external_data": DATA_FILE,
        "opset": _opset(graph),
        "interface": interface(graph, spec),
    }


def quantize_files(out_dir: Path, spec: ProgramSpec, quantization: Quantization) -> dict:
    """``--quantize int4``: the written graph's weights to 4 bits (8 for the embedding, and for the
    lm_head unless ``quantization.lm_head`` is ``int4``; ONNX Runtime's MatMulNBits and GatherBlockQuantized),
    rewritten in place as ``model.onnx`` + ``model.onnx.data``, then checked again. The interface
    does not change."""
    import onnx

    from .quantize import quantize_onnx

    path = out_dir / PROGRAM_FILE
    ops = quantize_onnx(path, DATA_FILE, quantization.lm_head or "int8")
    _check(path)
    return {"opset": _opset(onnx.load(str(path), load_external_data=False)), "quantized_ops": ops}


def describe_quantization(quantization: Quantization, hidden_size: int) -> dict | None:
    """``hidden_size`` is the lm_head's and embedding table's K, which sets their block."""
    if not quantization:
        return None
    lm_head = quantization.lm_head
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
            if lm_head == "int4"
            else {"weights": "int8", "symmetric": True, "block_size": table_block(hidden_size),
                  "op": "com.microsoft::MatMulNBits"}
        ),
        "embedding": {"weights": "int8", "symmetric": True, "block_size": table_block(hidden_size),
                      "op": "com.microsoft::GatherBlockQuantized"},
    }


def quantization_detail(quantization: Quantization) -> str:
    return (f"int4 linear weights ({quantization.lm_head or 'int8'} lm_head), MatMul -> MatMulNBits, "
            "Gather -> GatherBlockQuantized int8 (ONNX Runtime)")


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


def _tidy(model) -> None:
    """Rename the exporter's symbol for the call's length (``s27``, ``s27 + 6``, ...) to ``T``
    everywhere in the graph, and drop the export's stack traces from the nodes."""
    import onnx_ir as ir

    inputs = {v.name: v for v in model.graph.inputs}
    names = {str(inputs["tokens"].shape[1]): "T"}
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


_ONNX_DTYPES = {1: "float32", 10: "float16", 16: "bfloat16", 7: "int64", 6: "int32"}


def _describe(value, layers_by_index: dict) -> dict:
    dims = [d.dim_param or d.dim_value for d in value.type.tensor_type.shape.dim]
    entry = {"name": value.name, "dtype": _ONNX_DTYPES[value.type.tensor_type.elem_type], "shape": dims}
    match = re.fullmatch(r"(past|present)_(key|value)_(\d+)", value.name)
    if value.name == "tokens":
        entry["meaning"] = "token ids of this call"
    elif value.name == "input_pos":
        entry["meaning"] = "position of tokens[0, 0] = P, the positions already in the cache (0 starts a sequence)"
    elif value.name == "ring_start":
        entry["meaning"] = "row of every sliding layer's buffer that takes tokens[0, 0] (see cache.ring)"
    elif value.name == "total_length":
        entry["meaning"] = "input_pos[0] + T, in host memory: the full-attention kernels' total_sequence_length"
    elif value.name == "ring_total_length":
        entry["meaning"] = "ring_start[0] + T, in host memory: the sliding kernels' total_sequence_length"
    elif value.name == "logits":
        entry["meaning"] = "logits of the call's last position"
    elif match:
        kind, kv, index = match.group(1), match.group(2), int(match.group(3))
        layer = layers_by_index[index]
        entry["layer"] = index
        if layer["cache"] == "static" and kind == "past":
            entry["meaning"] = f"the layer's whole {kv} buffer (rows 0 .. P-1 filled)"
        elif layer["cache"] == "static":
            entry["meaning"] = f"the {kv} buffer with rows P .. P+T-1 written: bind it to the past's memory"
        elif kind == "past":
            entry["meaning"] = f"the layer's whole {kv} ring buffer ({layer['slots']} rows, see cache.ring)"
        else:
            entry["meaning"] = f"the {kv} ring buffer with rows ring_start .. ring_start+T-1 written: bind it to the past's memory"
    return entry


def interface(graph, spec: ProgramSpec) -> dict:
    """The graph's inputs and outputs, and how a runtime drives the cache: enough for any runtime."""
    layers_by_index = {layer["index"]: layer for layer in spec.layers}
    windows = [layer["window"] for layer in spec.layers if layer["cache"] == "ring"]
    return {
        "inputs": [_describe(v, layers_by_index) for v in graph.graph.input],
        "outputs": [_describe(v, layers_by_index) for v in graph.graph.output],
        "symbols": SYMBOLS,
        "calls": "contiguous: each call starts where the previous one ended; start at 0 for a new sequence",
        # --prefill-chunk; and a ring buffer has 2W rows and a call may start at row W - 1: W more rows fit.
        "max_tokens_per_call": min([spec.max_tokens_per_call, *windows]),
        "cache": {
            "owner": "the runtime: per layer, a key and a value buffer allocated once and filled with zeros "
            "(a masked slot still enters attention with weight 0, so it must hold finite numbers)",
            "layout": "static: [1, kv_heads, max_cache_len, head_dim]; ring: [1, kv_heads, 2 * window, head_dim] "
            "(head-major, ONNX Runtime's GroupQueryAttention)",
            "static": "past = the whole buffer; present = the same buffer with rows P .. P+T-1 written "
            "(ONNX Runtime's GroupQueryAttention): bind present to the past's memory and it is written in place, "
            "reading rows 0 .. P+T-1 only; a runtime that does not alias them passes present as the next past",
            "ring": "the same, with the call's rows at ring_start .. ring_start+T-1 and the node reading only the "
            "window: rows ring_start-window+1 .. ring_start-1 must hold positions P-window+1 .. P-1. The runtime "
            "keeps R, the rows in use: R = 0 when P = 0; before a call with R + T > 2 * window, it moves rows "
            "R-window+1 .. R-1 to 0 .. window-2 in every ring buffer and sets R = window - 1; it passes "
            "ring_start = R and adds T after the call",
            "new_sequence": "call with input_pos 0 (and ring_start 0): nothing needs clearing, attention ignores older contents",
        },
    }
