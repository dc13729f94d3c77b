"""Weight quantization for the ExecuTorch target (``--quantize``, ``--quantize-embedding``).

Linear layers and embeddings are quantized in place before export with ExecuTorch's own torchao
recipes (``executorch.extension.llm.export.quantize.quantize_model_``): ``8da4w`` is int8 dynamic
activations with int4 weights in groups of 32, which XNNPACK runs as fused kernels.

torchao leaves a quantized embedding as ``dequantize_affine`` followed by ``embedding``, which
ExecuTorch's own fusion into its quantized embedding kernels no longer matches (the block size
arrives as a literal, its pattern expects a placeholder), so the lookup would dequantize the whole
table every call. ``fuse_quantized_embeddings`` does that fusion on the edge program instead.
"""

from __future__ import annotations

import torch

from ..errors import InvalidOptionError

LINEAR_SCHEMES = {"8da4w": "8da4w", "8da8w": "8da8w"}
EMBEDDING_SCHEMES = {"int8": "8w", "int4": "4w"}
# torchao's quant range for each embedding scheme, and the ExecuTorch kernel that reads it.
_EMBEDDING_KERNELS = {(-128, 127): ("embedding_byte", 8), (-8, 7): ("embedding_4bit", 4)}


def check_schemes(linear: str | None, embedding: str | None) -> None:
    if linear is not None and linear not in LINEAR_SCHEMES:
        raise InvalidOptionError(f"unknown --quantize '{linear}'; choose one of: {', '.join(LINEAR_SCHEMES)}")
    if embedding is not None and embedding not in EMBEDDING_SCHEMES:
        raise InvalidOptionError(
            f"unknown --quantize-embedding '{embedding}'; choose one of: {', '.join(EMBEDDING_SCHEMES)}"
        )


def quantize_model(model: torch.nn.Module, linear: str | None, embedding: str | None) -> None:
    """Quantize ``model``'s linear layers and embeddings in place (before export)."""
    from executorch.extension.llm.export.quantize import quantize_model_

    quantize_model_(
        model,
        qlinear_config=LINEAR_SCHEMES[linear] if linear else None,
        qembedding_config=EMBEDDING_SCHEMES[embedding] if embedding else None,
        # Layers whose width is not a multiple of the group size stay in float.
        skip_incompatible_shapes=True,
    )


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
        name, bits = kernel
        if bits == 4:
            _pack_int4_in_place(program, data)
        zero_values = _constant(program, zero) if zero is not None else None
        zeros = None if zero_values is None or not zero_values.any() else zero
        if zeros is not None:
            continue  # asymmetric: keep the generic path rather than guess the kernel's convention
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
