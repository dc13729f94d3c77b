"""Weight quantization (``--quantize``, ``--quantize-embedding``).

ExecuTorch (``8da4w``): linear layers and embeddings are quantized in place before export with ExecuTorch's own torchao
recipes (``executorch.extension.llm.export.quantize.quantize_model_``): ``8da4w`` is int8 dynamic
activations with int4 weights in groups of 32, which XNNPACK runs as fused kernels.

torchao leaves a quantized embedding as ``dequantize_affine`` followed by ``embedding``, which
ExecuTorch's own fusion into its quantized embedding kernels no longer matches (the block size
arrives as a literal, its pattern expects a placeholder), so the lookup would dequantize the whole
table every call. ``fuse_quantized_embeddings`` does that fusion on the edge program instead.

ONNX (``int4``): the saved graph's weights, with ONNX Runtime's ``MatMulNBitsQuantizer`` (``quantize_onnx``).
"""

from __future__ import annotations

import torch

from ..errors import InvalidOptionError

# --quantize: the scheme, and the one target that runs it.
SCHEMES = {"8da4w": "executorch", "int4": "onnx"}
# --quantize-embedding (ExecuTorch): kvexport's name -> ExecuTorch's quantize_model_ config.
EMBEDDING_SCHEMES = {"int8": "8w", "int4": "4w"}
GROUP_SIZE = 32  # weights per scale, for 4-bit linear weights on both targets and int4 embeddings
# MatMulNBits' accuracy_level 4: int8 activations, the CPU's int8 dot products (as 8da4w on
# XNNPACK, and as onnxruntime-genai's builder does for int4 on the CPU).
ONNX_ACCURACY_LEVEL = 4
# torchao's quant range for each embedding scheme, and the ExecuTorch kernel that reads it.
_EMBEDDING_KERNELS = {(-128, 127): ("embedding_byte", 8), (-8, 7): ("embedding_4bit", 4)}


def check_request(target: str, scheme: str | None, embedding: str | None, dtype: str) -> None:
    """Refuse, before anything loads, a scheme that does not exist or that the target does not run."""
    if scheme is not None and scheme not in SCHEMES:
        choices = ", ".join(f"{s} (--target {t})" for s, t in SCHEMES.items())
        raise InvalidOptionError(f"unknown --quantize '{scheme}'; choose one of: {choices}")
    if scheme is not None and SCHEMES[scheme] != target:
        right = next(s for s, t in SCHEMES.items() if t == target)
        raise InvalidOptionError(
            f"--quantize {scheme} is for --target {SCHEMES[scheme]}; for --target {target} use --quantize {right}"
        )
    if embedding is not None:
        if target != "executorch":
            raise InvalidOptionError(
                f"--quantize-embedding is for --target executorch; for --target {target} leave it out "
                "(--quantize int4 quantizes the embedding too)"
            )
        if embedding not in EMBEDDING_SCHEMES:
            raise InvalidOptionError(
                f"unknown --quantize-embedding '{embedding}'; choose one of: {', '.join(EMBEDDING_SCHEMES)}"
            )
    if (scheme or embedding) and dtype != "float32":
        raise InvalidOptionError(f"--quantize takes --dtype float32 (the default), not {dtype}; leave --dtype out")


def describe(scheme: str | None, embedding: str | None) -> dict | None:
    """What ``kvexport.json`` records under ``quantization`` (None: not quantized)."""
    if not scheme and not embedding:
        return None
    if scheme == "int4":
        return {
            "scheme": "int4",
            "by": "onnxruntime.quantization.MatMulNBitsQuantizer",
            "linear": {"weights": "int4", "symmetric": True, "block_size": GROUP_SIZE,
                       "op": "com.microsoft::MatMulNBits", "accuracy_level": ONNX_ACCURACY_LEVEL},
            "embedding": {"weights": "int4", "symmetric": True, "block_size": GROUP_SIZE,
                          "op": "com.microsoft::GatherBlockQuantized"},
        }
    described: dict = {"scheme": scheme, "by": "torchao via executorch.extension.llm.export.quantize"}
    if scheme:
        described["linear"] = {"weights": "int4", "group_size": GROUP_SIZE, "activations": "int8, dynamic per token"}
    if embedding:
        described["embedding"] = {
            "weights": embedding,
            "group_size": GROUP_SIZE if embedding == "int4" else "row",
            "op": f"quantized_decomposed::{'embedding_4bit' if embedding == 'int4' else 'embedding_byte'}",
        }
    return described



def quantize_model(model: torch.nn.Module, scheme: str | None, embedding: str | None) -> list[str]:
    """Quantize ``model``'s linear layers and embeddings in place (before export, ExecuTorch);
    return the names of the layers left in float (a width that is no multiple of the group size)."""
    import contextlib
    import io

    from executorch.extension.llm.export.quantize import quantize_model_

    skipped: list[str] = []
    # quantize_model_ prints what it does, and each layer it skips, on stdout (which --json owns).
    with contextlib.redirect_stdout(io.StringIO()) as said:
        quantize_model_(
            model,
            qlinear_config=scheme,
            qlinear_group_size=GROUP_SIZE if scheme else None,
            qembedding_config=EMBEDDING_SCHEMES[embedding] if embedding else None,
            # int8: one scale per row (the embedding_byte kernel's fastest form); int4: groups of 32.
            qembedding_group_size=(GROUP_SIZE if embedding == "int4" else 0) if embedding else None,
            # Layers whose width is not a multiple of the group size stay in float.
            skip_incompatible_shapes=True,
        )
    for line in said.getvalue().splitlines():
        if line.strip().startswith("Skipping "):
            skipped.append(line.strip().split()[1].rstrip(":"))
    return skipped


def fuse_quantized_embeddings(program: torch.export.ExportedProgram) -> int:
    """Rewrite ``embedding(dequantize_affine(q, [1, g], scale, zero, int8, lo, hi), ids)`` into
    ExecuTorch's ``quantized_decomposed.embedding_{byte,4bit}``; return how many were fused.

    int4 weights are packed two per byte, as the 4-bit kernel reads them.
    """
    from executorch.exir.dialects._ops import ops as exir_ops

    dequantize = exir_ops.edge.torchao.dequantize_affine.default
    embedding = exir_ops.edge.aten.embedding.default
    graph = program.graph_module.graph
    fused = 0
    for node in list(graph.nodes):
        if node.target != embedding or getattr(node.args[0], "target", None) != dequantize:
            continue
        dq = node.args[0]
        data, block, scale, zero, _, low, high = dq.args[:7]
        kernel = _EMBEDDING_KERNELS.get((low, high))
        if kernel is None or len(dq.users) != 1 or block[0] != 1:
            continue
        zero_values = _constant(program, zero) if zero is not None else None
        if zero_values is not None and zero_values.any():
            continue  # asymmetric: keep the generic path rather than guess the kernel's convention
        name, bits = kernel
        if bits == 4:  # only now, once the node is certain to be rewritten
            _pack_int4_in_place(program, data)
        op = getattr(exir_ops.edge.quantized_decomposed, name).dtype
        with graph.inserting_before(node):
            fused_node = graph.call_function(
                op, (data, scale, None, low, high, node.args[1]), {"dtype": node.meta["val"].dtype}
            )
        fused_node.meta = dict(node.meta)
        node.replace_all_uses_with(fused_node)
        graph.erase_node(node)
        graph.erase_node(dq)
        fused += 1
    if fused:
        graph.eliminate_dead_code()
        program.graph_module.recompile()
    return fused


def _constant(program: torch.export.ExportedProgram, node) -> torch.Tensor | None:
    spec = next((s for s in program.graph_signature.input_specs if s.arg.name == node.name), None)
    if spec is None:
        return None
    return program.state_dict.get(spec.target, program.constants.get(spec.target))


def _pack_int4_in_place(program: torch.export.ExportedProgram, node) -> None:
    """Two int4 values (stored one per int8) per byte, high nibble first, offset to unsigned."""
    spec = next(s for s in program.graph_signature.input_specs if s.arg.name == node.name)
    store = program.state_dict if spec.target in program.state_dict else program.constants
    values = store[spec.target]
    shifted = (values.to(torch.int16) + 8).to(torch.uint8).view(values.shape[0], -1, 2)
    packed = shifted[:, :, 0] * 16 + shifted[:, :, 1]
    store[spec.target] = torch.nn.Parameter(packed, requires_grad=False) if store is program.state_dict else packed
    node.meta["val"] = node.meta["val"].new_empty(packed.shape, dtype=torch.uint8)


def quantize_onnx(path, data_file: str, embedding: bool = True) -> dict:
    """Quantize the saved ONNX graph's weights in place with ONNX Runtime's ``MatMulNBitsQuantizer``,
    as onnxruntime-genai's builder does for int4: every MatMul with a constant weight (the lm_head
    included) becomes ``com.microsoft::MatMulNBits``, int4 symmetric in blocks of 32 along K, and
    the embedding's Gather ``com.microsoft::GatherBlockQuantized`` (blocks of 32 along the hidden
    dim). Returns op counts for ``kvexport.json``."""
    import collections
    import logging
    import os

    import numpy as np
    import onnx
    from onnxruntime.quantization import QuantFormat
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    # The quantizer logs each node, and warns that it raises the opset to 21 for the int4 tensor
    # type of GatherBlockQuantized's table: opset 21 only adds (u)int4 to the ops this graph uses,
    # and onnx.checker checks the result below.
    logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer").setLevel(logging.ERROR)
    model = onnx.load(str(path), load_external_data=True)
    _fold_weight_transposes(model)
    quantizer = MatMulNBitsQuantizer(
        model,
        bits=4,
        block_size=GROUP_SIZE,
        is_symmetric=True,
        accuracy_level=ONNX_ACCURACY_LEVEL,
        quant_format=QuantFormat.QOperator,
        op_types_to_quantize=("MatMul", "Gather") if embedding else ("MatMul",),
        quant_axes=(("MatMul", 0), ("Gather", 1)),
    )
    with np.errstate(divide="ignore", invalid="ignore"):  # an all-zero block (a padding row) has scale 0
        quantizer.process()
    model = quantizer.model.model
    del quantizer
    # onnx appends to an existing external data file: write a fresh one.
    os.remove(os.path.join(os.path.dirname(str(path)), data_file))
    onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True, location=data_file)
    counts = collections.Counter(n.op_type for n in model.graph.node)
    return {op: counts[op] for op in ("MatMulNBits", "GatherBlockQuantized", "MatMul", "Gather") if counts[op]}


def _fold_weight_transposes(model) -> None:
    """A MatMul whose weight is ``Transpose(initializer)`` gets the transposed initializer instead.

    The exporter folds a linear layer's ``W.T`` into a constant, except where the weight is shared
    (a tied lm_head reads the embedding table through a Transpose, so the table is stored once);
    MatMulNBitsQuantizer quantizes only constant weights, and would leave that lm_head, the largest
    matrix of a small model, in float."""
    from onnx import numpy_helper

    initializers = {i.name: i for i in model.graph.initializer}
    producers = {out: node for node in model.graph.node for out in node.output}
    for node in list(model.graph.node):
        transpose = producers.get(node.input[1]) if node.op_type == "MatMul" and len(node.input) > 1 else None
        if transpose is None or transpose.op_type != "Transpose" or transpose.input[0] not in initializers:
            continue
        weight = initializers[transpose.input[0]]
        perm = next((list(a.ints) for a in transpose.attribute if a.name == "perm"), [1, 0])
        if len(weight.dims) != 2 or perm != [1, 0] or transpose not in model.graph.node:
            continue
        array = numpy_helper.to_array(weight)
        model.graph.initializer.append(numpy_helper.from_array(array.T.copy(), transpose.output[0]))
        model.graph.node.remove(transpose)
