"""``--quantize int4`` for ONNX: the saved graph's weights rewritten for ONNX Runtime's CPU kernels.

- Every MatMul with a constant weight becomes ``com.microsoft::MatMulNBits`` with int4 weights in
  blocks of 32 along K, *asymmetric*: each block keeps its own minimum and maximum (``w = lo +
  d * q``, ``q`` in 0..15). A model read from a 4-bit GGUF (SmolLM2's Q4_1; Gemma 3's Q4_K_M
  mixes Q4_K with 5-, 6- and 8-bit tensors) already lies on such a grid, so those weights come
  out exactly as the float reference sees them; symmetric int4 would round them onto a second
  grid (top-1 agreement with float eager fell to ~70% on SmolLM2 that way).
  MatMulNBits takes a float zero point only on a path ~40x slower than its default, so the weight
  is stored as the symmetric ``d * (q - 8)`` the fast kernel reads, and the per-block offset
  ``lo + 8 d`` is added back as ``blocksum(x) @ offsets`` (two small MatMuls; ``blocksum(x)``
  computed once per input shared by several projections): exact, and ~1 extra bit per weight.
- The lm_head (the MatMul that computes the graph's logits) and the embedding lookup stay 8-bit
  (symmetric, blocks of 32: MatMulNBits ``bits=8`` and ``GatherBlockQuantized``): their error
  lands straight on the logits, and both real models ship their tied table as 8-bit (Q8_0).
  A tied table is stored once: both ops read one ``[N, K/32, 32]`` initializer (MatMulNBits'
  layout; the lookup quantizes along its last axis and reshapes its result back to ``[..., K]``).
- ``accuracy_level`` 4: int8 activations and the CPU's int8 dot products, as onnxruntime-genai's
  builder uses for int4 on the CPU.
"""

from __future__ import annotations

import collections
import os
import shutil

import numpy as np

BLOCK = 32  # weights per scale, along K (a MatMul's input dim, an embedding's hidden dim)
ACCURACY_LEVEL = 4
MS_DOMAIN = "com.microsoft"


def int4_blocks(weight_nk: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``weight_nk`` [N, K] as (q [N, K/32, 32] in 0..15, scale [N, K/32], offset [N, K/32]) with
    ``weight ~= scale * (q - 8) + offset`` per block; exact for a weight already on a 4-bit grid
    whose block uses its lowest and highest level (as GGUF's Q4_1 does)."""
    n, k = weight_nk.shape
    blocks = weight_nk.reshape(n, k // BLOCK, BLOCK).astype(np.float32)
    lo, hi = blocks.min(-1), blocks.max(-1)
    scale = (hi - lo) / np.float32(15)
    safe = np.where(scale == 0, np.float32(1), scale)
    q = np.clip(np.rint((blocks - lo[..., None]) / safe[..., None]), 0, 15).astype(np.uint8)
    return q, scale.astype(np.float32), (lo + 8 * scale).astype(np.float32)


def int8_blocks(weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``weight`` [R, C] as (q [R, C] as uint8 with zero point 128, scale [R, C/32]), symmetric:
    ``scale = max |block| / 127`` (GGUF's Q8_0 rule, so a Q8_0 table comes out unchanged)."""
    r, c = weight.shape
    blocks = weight.reshape(r, c // BLOCK, BLOCK).astype(np.float32)
    scale = np.abs(blocks).max(-1) / np.float32(127)
    safe = np.where(scale == 0, np.float32(1), scale)
    q = np.clip(np.rint(blocks / safe[..., None]), -127, 127).astype(np.int16) + 128
    return q.astype(np.uint8).reshape(r, c), scale.astype(np.float32)


def quantize_onnx(path, data_file: str) -> dict:
    """Rewrite the ONNX model at ``path`` in place (``data_file`` beside it); return op counts for
    ``kvexport.json``."""
    import onnx
    from onnx import helper, numpy_helper

    model = onnx.load(str(path), load_external_data=True)
    tied = _fold_weight_transposes(model)
    graph = model.graph
    initializers = {i.name: i for i in graph.initializer}
    lm_head = _lm_head(graph)
    readers = collections.Counter(name for node in graph.node for name in node.input)
    added: list = []  # new initializers
    block_sums: dict[str, str] = {}  # MatMul input -> its per-block sums (shared by q/k/v, gate/up)
    memberships: set[int] = set()  # K of each [K, K/32] block-membership matrix already added
    tables: dict[str, tuple[str, str]] = {}  # source initializer -> its 8-bit (data, scales)

    def int8_table(source: str, matrix_nk) -> tuple[str, str]:
        """The 8-bit blocks of the [N, K] matrix ``matrix_nk()``, computed and added once however
        many ops read it (a tied table's second reader reads no float copy at all)."""
        if source not in tables:
            q, scale = int8_blocks(matrix_nk())
            n, k = q.shape
            tables[source] = (f"{source}_q8", f"{source}_scales")
            added.extend([numpy_helper.from_array(q.reshape(n, k // BLOCK, BLOCK), f"{source}_q8"),
                          numpy_helper.from_array(scale, f"{source}_scales")])
        return tables[source]

    nodes = []
    for node in graph.node:
        weight = initializers.get(node.input[1]) if len(node.input) > 1 else None
        if node.op_type == "MatMul" and _quantizable(weight, axis=0):
            k, n = weight.dims  # [K, N]
            base = node.name or node.output[0]
            if node.output[0] == lm_head:  # 8-bit; a tied one shares the lookup's blocks
                data, scales = int8_table(tied.get(weight.name, weight.name),
                                          lambda: np.ascontiguousarray(numpy_helper.to_array(weight).T))
                nodes.append(_matmul_nbits(helper, node.input[0], data, scales, node.output[0], k, n, 8))
            else:
                q, scale, offset = int4_blocks(np.ascontiguousarray(numpy_helper.to_array(weight).T))
                packed = q[..., 0::2] | (q[..., 1::2] << 4)  # two per byte, low nibble first
                added += [numpy_helper.from_array(packed, f"{base}_q4"), numpy_helper.from_array(scale, f"{base}_scales"),
                          numpy_helper.from_array(np.ascontiguousarray(offset.T), f"{base}_offsets")]
                sums = block_sums.get(node.input[0])
                if sums is None:
                    ones = f"block_sum_{k}"
                    if k not in memberships:  # [K, K/32]: 1 where row i is in block j
                        membership = np.kron(np.eye(k // BLOCK, dtype=np.float32), np.ones((BLOCK, 1), np.float32))
                        added.append(numpy_helper.from_array(membership, ones))
                        memberships.add(k)
                    sums = block_sums[node.input[0]] = f"{node.input[0]}_block_sums"
                    nodes.append(helper.make_node("MatMul", [node.input[0], ones], [sums], name=f"{base}_block_sums"))
                nodes += [
                    _matmul_nbits(helper, node.input[0], f"{base}_q4", f"{base}_scales", f"{base}_symmetric", k, n, 4),
                    helper.make_node("MatMul", [sums, f"{base}_offsets"], [f"{base}_offset"], name=f"{base}_offset"),
                    helper.make_node("Add", [f"{base}_symmetric", f"{base}_offset"], [node.output[0]], name=f"{base}_add_offset"),
                ]
            readers[weight.name] -= 1
        elif node.op_type == "Gather" and _quantizable(initializers.get(node.input[0]), axis=1) and _attribute(node, "axis", 0) == 0:
            table = initializers[node.input[0]]
            n, k = table.dims
            base = node.name or node.output[0]
            data, scales = int8_table(node.input[0], lambda: numpy_helper.to_array(table))  # [N, K/32, 32], [N, K/32]
            ids = node.input[1]
            added += [numpy_helper.from_array(np.array([n, k // BLOCK, 1], np.int64), f"{base}_scales_shape"),
                      numpy_helper.from_array(np.array([k], np.int64), f"{base}_hidden")]
            nodes += [
                helper.make_node("Reshape", [scales, f"{base}_scales_shape"], [f"{base}_scales"], name=f"{base}_scales"),
                helper.make_node(
                    "GatherBlockQuantized", [data, ids, f"{base}_scales"], [f"{base}_blocks"], name=base,
                    domain=MS_DOMAIN, bits=8, block_size=BLOCK, gather_axis=0, quantize_axis=2,
                ),  # [*ids.shape, K/32, 32]
                helper.make_node("Shape", [ids], [f"{base}_ids_shape"], name=f"{base}_ids_shape"),
                helper.make_node("Concat", [f"{base}_ids_shape", f"{base}_hidden"], [f"{base}_shape"], name=f"{base}_shape", axis=0),
                helper.make_node("Reshape", [f"{base}_blocks", f"{base}_shape"], [node.output[0]], name=f"{base}_reshape"),
            ]
            readers[node.input[0]] -= 1
        else:
            nodes.append(node)
    del graph.node[:]
    graph.node.extend(nodes)
    kept = [i for i in graph.initializer if readers[i.name] > 0]  # the float weights now unread go
    del graph.initializer[:]
    graph.initializer.extend(kept + added)
    if not any(o.domain == MS_DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(MS_DOMAIN, 1))
    # onnx appends to an existing external data file: write a fresh one.
    data_path = os.path.join(os.path.dirname(str(path)), data_file)
    os.remove(data_path)
    onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True, location=data_file)
    shutil.copymode(path, data_path)  # onnx creates it owner-only (0600); readable like the graph beside it
    counts = collections.Counter(n.op_type for n in model.graph.node)
    return {op: counts[op] for op in ("MatMulNBits", "GatherBlockQuantized") if counts[op]}


def _lm_head(graph) -> str | None:
    """The output of the MatMul that computes the logits (the graph's first output), found walking
    back from them through what follows it (the last position's selection, a soft-cap)."""
    producers = {out: node for node in graph.node for out in node.output}
    node = producers.get(graph.output[0].name)
    for _ in range(16):
        if node is None:
            return None
        if node.op_type == "MatMul":
            return node.output[0]
        node = producers.get(node.input[0]) if node.input else None
    return None


def _quantizable(weight, axis: int) -> bool:
    """A 2-D float initializer whose quantized dim (``axis``) is a multiple of the block."""
    from onnx import TensorProto

    return (weight is not None and len(weight.dims) == 2 and weight.data_type == TensorProto.FLOAT
            and weight.dims[axis] % BLOCK == 0)


def _matmul_nbits(helper, x: str, q: str, scales: str, out: str, k: int, n: int, bits: int):
    return helper.make_node(
        "MatMulNBits", [x, q, scales], [out], name=f"{out}_nbits", domain=MS_DOMAIN,
        K=k, N=n, bits=bits, block_size=BLOCK, accuracy_level=ACCURACY_LEVEL,
    )


def _attribute(node, name: str, default):
    from onnx import helper

    return next((helper.get_attribute_value(a) for a in node.attribute if a.name == name), default)


def _fold_weight_transposes(model) -> dict[str, str]:
    """A MatMul whose weight is ``Transpose(initializer)`` gets the transposed initializer instead;
    returns ``{transposed initializer: the initializer it was transposed from}``.

    The exporter folds a linear layer's ``W.T`` into a constant, except where the weight is shared
    (a tied lm_head reads the embedding table through a Transpose, so the table is stored once);
    only constant weights are quantized, and that lm_head, the largest matrix of a small model,
    would stay in float."""
    from onnx import numpy_helper

    initializers = {i.name: i for i in model.graph.initializer}
    producers = {out: node for node in model.graph.node for out in node.output}
    folded: dict[str, str] = {}
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
        folded[transpose.output[0]] = transpose.input[0]
    return folded
