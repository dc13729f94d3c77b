"""ExecuTorch's weight quantization (``--quantize 8da4w``, ``--quantize-embedding``,
``--quantize-lm-head``): the module is quantized in place before export. Linear layers
(``quantize_linears``): int8 activations per token and int4 weights in groups of 32 that keep the
grid a quantized source put them on (``weight_grids``), int8 per channel where the source is finer
than 4 bits and for the lm_head (int4 on request); torchao's tensors, which XNNPACK runs as fused
kernels. With ``--quantize-grid symmetric``, ExecuTorch's own 8da4w config instead
(``symmetric_int4_linears``).
Embeddings: ExecuTorch's own torchao recipe (``executorch.extension.llm.export.quantize``), a
table at a time in pieces of rows (``quantize_embeddings``).

torchao leaves a quantized embedding as ``dequantize_affine`` followed by ``embedding``, which
ExecuTorch's own fusion into its quantized embedding kernels no longer matches (the block size
arrives as a literal, its pattern expects a placeholder), so the lookup would dequantize the whole
table every call. ``fuse_quantized_embeddings`` does that fusion on the edge program instead.
"""

from __future__ import annotations

import numpy as np
import torch

from ...allocator import return_freed_memory
from ...choices import EmbeddingScheme, LmHeadScheme
from ...progress import report
from ..quantization import EMBEDDING_SCHEMES, Quantization
from ..weight_grids import BLOCK

GROUP_SIZE = BLOCK  # weights per scale, for 4-bit linear weights and int4 embeddings (ExecuTorch)
# The scale of a block whose weights are all one value (any positive scale holds it exactly).
_FLAT_BLOCK_SCALE = np.float32(2**-24)
# torchao's quant range for each embedding scheme, and the ExecuTorch kernel that reads it.
_EMBEDDING_KERNELS = {(-128, 127): ("embedding_byte", 8), (-8, 7): ("embedding_4bit", 4)}


def quantize_model(model: torch.nn.Module, quantization: Quantization, fill=None) -> list[str]:
    """Quantize ``model``'s embeddings (torchao, ExecuTorch's recipe) and linear layers (``8da4w``,
    ``quantize_linears``; the lm_head as ``quantization.lm_head`` asks, default int8) in place,
    before export; return the names of the layers left in float (a width that is no multiple of
    the group size). ``fill(module)``: gives a layer its weight's values just before it is
    quantized (``DeferredWeights.fill``: weights left in the checkpoint until then)."""
    skipped: list[str] = []
    if quantization.embedding:
        skipped += quantize_embeddings(model, quantization.embedding, fill=fill)
    if quantization.scheme and quantization.symmetric:
        skipped += symmetric_int4_linears(model, quantization.lm_head or LmHeadScheme.INT8, fill)
    elif quantization.scheme:
        skipped += quantize_linears(model, quantization.lm_head or LmHeadScheme.INT8, fill)
    return skipped


def quantize_embeddings(model: torch.nn.Module, scheme: EmbeddingScheme, rows_per_piece: int = 16384, fill=None) -> list[str]:
    """ExecuTorch's embedding recipe (``quantize_model_``'s ``qembedding_config``: torchao's
    ``IntxWeightOnlyConfig`` with HQQ scales; int8 one scale per row, int4 groups of 32) applied
    to one table at a time and ``rows_per_piece`` rows at a time, each piece widened to float32
    on its own: a row's blocks are quantized apart from the other rows, so the pieces give the
    whole table's values, and no float32 copy of a whole table is held (Gemma's per-layer inputs
    are billions of values, kept in bfloat16 until here by ``load_model``'s ``compact``). Return
    the names of the tables left in float (a width that is no multiple of the group)."""
    from executorch.extension.llm.export.quantize import _make_embedding_config
    from torchao.quantization import IntxUnpackedToInt8Tensor
    from torchao.quantization.quant_api import _intx_weight_only_quantize_tensor

    group = GROUP_SIZE if scheme == EmbeddingScheme.INT4 else 0  # 0: one scale per row
    config = _make_embedding_config(EMBEDDING_SCHEMES[scheme], group)
    skipped = []
    for name, module in list(model.named_modules()):
        if not isinstance(module, torch.nn.Embedding):
            continue
        if group and module.embedding_dim % group:
            skipped.append(name)
            continue
        if fill:
            fill(module)
        table = module.weight.detach()
        qdata = torch.empty(table.shape, dtype=torch.int8)
        scales, zeros = [], []
        for start in range(0, table.shape[0], rows_per_piece):
            piece = _intx_weight_only_quantize_tensor(table[start : start + rows_per_piece].float(), config)
            qdata[start : start + piece.qdata.shape[0]] = piece.qdata
            scales.append(piece.scale)
            zeros.append(piece.zero_point)
        weight = IntxUnpackedToInt8Tensor(
            qdata=qdata, scale=torch.cat(scales), zero_point=torch.cat(zeros), target_dtype=piece.target_dtype,
            block_size=piece.block_size, dtype=torch.float32, activation_quantization=piece.activation_quantization,
        )  # fmt: skip
        del table
        module.weight = torch.nn.Parameter(weight, requires_grad=False)
        return_freed_memory()  # the float table's, where nothing else holds it (a tied lm_head does)
    return skipped


def quantize_linears(model: torch.nn.Module, lm_head: LmHeadScheme = LmHeadScheme.INT8, fill=None) -> list[str]:
    """``8da4w``: every linear layer with int8 activations (per token, on the fly) and weights that
    keep the grid they lie on (``weight_grids``); return the names of the layers left in float.

    - a weight on a 4-bit grid, or a float weight: int4 in groups of 32, ``Int4GridLinear``;
    - a weight the source stores finer than 4 bits (GGUF Q5_0, Q6_K, Q8_0), and the lm_head (its
      error lands straight on the logits): int8, one scale per output channel (XNNPACK's
      int8 x int8 kernel);
    - with ``lm_head="int4"``, the lm_head too is int4 whatever its source: the largest matrix of a
      small model at half the bytes, each block the source stores finer rounded to its min..max.
    """
    from ..weight_grids import finer_than_4_bits, grid_steps, int4_blocks

    head = model.get_output_embeddings()
    skipped: list[str] = []
    for name, module in _grouped_linears(model, skipped, fill):
        is_head = module is head
        if is_head and lm_head == LmHeadScheme.INT8:  # no float32 copy of the largest matrix: it is read in pieces
            module.weight = torch.nn.Parameter(_int8_per_channel(module.weight.detach()), requires_grad=False)
            continue
        weight = module.weight.detach().float().numpy()
        steps = None if is_head else grid_steps(weight, GROUP_SIZE)
        if not is_head and finer_than_4_bits(weight, coarse=steps):
            module.weight = torch.nn.Parameter(_int8_per_channel(module.weight.detach()), requires_grad=False)
            continue
        q, scale, offset = int4_blocks(weight, steps)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, Int4GridLinear.from_blocks(q, scale, offset, module.bias))
        return_freed_memory()  # the replaced weight's, and the blocks' working copies
    return skipped


def symmetric_int4_linears(model: torch.nn.Module, lm_head: LmHeadScheme = LmHeadScheme.INT8, fill=None) -> list[str]:
    """``--quantize-grid symmetric``: every linear layer rounded by ExecuTorch's own 8da4w config
    (``quantize_model_``'s, as ``export_llm`` and optimum-executorch apply it: symmetric int4 in
    groups of 32, HQQ scales, int8 activations per token), whatever grid its weight lies on; the
    lm_head int8 per channel as ``quantize_linears`` makes it, or the same int4 with ``lm_head="int4"``.
    A layer at a time, so only one float32 weight is widened at once; return the names left in float."""
    from executorch.extension.llm.export.quantize import _make_linear_config
    from torchao.quantization import quantize_

    config = _make_linear_config("8da4w", GROUP_SIZE)
    head = model.get_output_embeddings()
    skipped: list[str] = []
    for _, module in _grouped_linears(model, skipped, fill):
        if module is head and lm_head == LmHeadScheme.INT8:
            module.weight = torch.nn.Parameter(_int8_per_channel(module.weight.detach()), requires_grad=False)
            continue
        module.weight = torch.nn.Parameter(module.weight.detach().float(), requires_grad=False)
        quantize_(module, config)
        return_freed_memory()
    return skipped


def _grouped_linears(model: torch.nn.Module, skipped: list[str], fill=None):
    """The model's linear layers whose input width is a multiple of the group, with their names,
    each given its weight's values first (``fill``); the others' names go to ``skipped`` (they
    stay float). Found by name as they come: a layer the caller replaces is then held by nothing,
    its float weight freed with it, rather than kept by a list of modules until the last. The
    running step's status line counts them (``progress.report``)."""
    names = [name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)]
    for done, name in enumerate(names):
        report(f"{done:,} of {len(names):,} linear layers")
        module = model.get_submodule(name)
        if module.in_features % GROUP_SIZE:
            skipped.append(name)
            continue
        if fill:
            fill(module)
        yield name, module


def _activations_per_token():
    from torchao.quantization.quantize_.workflows.intx.intx_unpacked_to_int8_tensor import (
        IntxUnpackedToInt8TensorActivationQuantization,
    )

    return IntxUnpackedToInt8TensorActivationQuantization.INT8_ASYM_PER_TOKEN


def _int8_per_channel(weight: torch.Tensor, rows_per_piece: int = 16384) -> torch.Tensor:
    """torchao's 8da8w weight, one scale per output channel: the row's largest magnitude / 127
    (symmetric, GGUF's Q8_0 rule; torchao's own divides by 127.5). Quantized ``rows_per_piece``
    rows at a time (torchao's ``from_hp`` over a whole 262k-row lm_head would hold several float32
    copies of it at once); each row is its own block, so the pieces give ``from_hp``'s values."""
    from torchao.quantization import IntxUnpackedToInt8Tensor
    from torchao.quantization.quant_primitives import quantize_affine

    qdata, scales = [], []
    for rows in weight.detach().split(rows_per_piece):
        rows = rows.float()
        scale = (rows.abs().amax(-1, keepdim=True) / 127).clamp(min=torch.finfo(torch.float32).tiny)
        zero = torch.zeros_like(scale, dtype=torch.int8)
        qdata.append(quantize_affine(rows, (1, rows.shape[1]), scale, zero, output_dtype=torch.int8, quant_min=-128, quant_max=127))
        scales.append(scale)
    scale = torch.cat(scales)
    return IntxUnpackedToInt8Tensor(
        qdata=torch.cat(qdata), scale=scale, zero_point=torch.zeros_like(scale, dtype=torch.int8), target_dtype=torch.int8,
        block_size=(1, weight.shape[1]), dtype=torch.float32, activation_quantization=_activations_per_token(),
    )


class Int4GridLinear(torch.nn.Module):
    """A linear layer whose weight is ``scale * (q - 8) + offset`` per block of 32 along its input
    (``weight_grids.int4_blocks``: a 4-bit GGUF's weight, up to the roundings below).

    XNNPACK's int8 x int4 kernel reads symmetric blocks only (zero point 8): the weight is stored as
    torchao's 8da4w tensor ``scale * (q - 8)`` (XNNPACK keeps each scale as bfloat16) and the offsets
    are added back from the input's block sums: ``sums(x) @ offset.T``, a matmul 32x smaller, run as
    XNNPACK's int8 x int8 kernel with the offsets int8, one scale per output channel (a float32 matrix
    there would be larger and slower, for the same agreement). Symmetric int4 on its own
    (ExecuTorch's recipe) rounds a 4-bit GGUF's weights onto a second grid, far from float eager
    (docs/quantization.md).
    """

    def __init__(self, weight: torch.Tensor, offset: torch.Tensor, bias: torch.Tensor | None):
        """``weight``: torchao's int4 tensor ``scale * (q - 8)``; ``offset``: ``[out, in / 32]``,
        multiplying the input's block sums, as torchao's int8 tensor (``_int8_per_channel``) or float."""
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        self.offset = torch.nn.Parameter(offset, requires_grad=False)
        self.bias = bias
        # Block sums as a product with ones: XNNPACK's one reduction (mean.dim, as a pooling over a
        # 4-D tensor) would transpose in and out around it, and is slower.
        self.register_buffer("ones", torch.ones(1, GROUP_SIZE), persistent=False)

    @classmethod
    def from_blocks(cls, q, scale, offset, bias: torch.Tensor | None) -> "Int4GridLinear":
        """From ``weight_grids.int4_blocks``' arrays: levels ``q`` (0..15), per-block scales and offsets."""
        from torchao.quantization import IntxUnpackedToInt8Tensor

        n, blocks, _ = q.shape
        # XNNPACK refuses a zero scale, which a block of one value gets (an embedding's padding row,
        # all zeros, read as a tied int4 lm_head). Its levels are all 0, so any scale holds it exactly
        # once the offset makes up for it: scale * (0 - 8) + offset + 8 * scale.
        flat = scale == 0
        scale = np.where(flat, _FLAT_BLOCK_SCALE, scale).astype(np.float32)
        offset = np.where(flat, offset + 8 * _FLAT_BLOCK_SCALE, offset).astype(np.float32)
        weight = IntxUnpackedToInt8Tensor(
            qdata=torch.from_numpy(q.reshape(n, blocks * GROUP_SIZE).astype("int8") - 8),
            scale=torch.from_numpy(scale),
            zero_point=torch.zeros(n, blocks, dtype=torch.int8),
            target_dtype=torch.int4,
            block_size=(1, GROUP_SIZE),
            dtype=torch.float32,
            activation_quantization=_activations_per_token(),
        )
        offset = torch.from_numpy(offset)
        # One block (in_features 32: tiny test models) stays float: torchao's per-token int8
        # quantization of a one-value input fails.
        return cls(weight, _int8_per_channel(offset) if offset.shape[1] > 1 else offset, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        blocks = self.offset.shape[1]
        block_sums = torch.nn.functional.linear(x.reshape(-1, GROUP_SIZE), self.ones).reshape(*x.shape[:-1], blocks)
        return torch.nn.functional.linear(x, self.weight, self.bias) + torch.nn.functional.linear(block_sums, self.offset)


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
