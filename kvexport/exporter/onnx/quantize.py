"""``--quantize int4`` for ONNX: the saved graph's weights rewritten for ONNX Runtime's CPU kernels.

- Every MatMul with a constant weight becomes ``com.microsoft::MatMulNBits``, int4 in blocks of 32
  along K, asymmetric: a quantized source's grid (``grid_steps``) is kept, so no weight is rounded
  twice. The weight is stored as the symmetric ``d * (q - 8)`` the fast kernel reads, and the
  per-block offsets are added back exactly as ``blocksum(x) @ offsets``. A weight stored finer
  than 4 bits (``finer_than_4_bits``) goes 8-bit on its own grid instead.
- Projections that read one input (q/k/v; gate/up) are one MatMulNBits and a Split: fewer kernels.
- ``symmetric``: every MatMul's weight rounded to symmetric int4 by ONNX Runtime's own quantizer
  (``quantize_matmul_4bits``, as its ``MatMulNBitsQuantizer`` and onnxruntime-genai's builder
  round them), whatever grid it lies on; no offsets.
- The lm_head and embedding lookup stay 8-bit by default (their error lands on the logits; a tied
  table is stored once); ``accuracy_level`` 4, as onnxruntime-genai's builder uses on the CPU.
Accuracy and speed figures: docs/quantization.md.
"""

from __future__ import annotations

import collections
from pathlib import Path

import numpy as np

from ...choices import LmHeadScheme
from ...progress import report
from ..weight_grids import (
    BLOCK,
    FINE_BLOCK,
    finer_than_4_bits,
    grid_steps,
    int4_blocks,
    int4_zero_point_blocks,
    int8_blocks,
    on_levels,
)
from .external_data import DataFileWriter, Weights
from .graph import attribute, prune

ACCURACY_LEVEL = 4
MS_DOMAIN = "com.microsoft"


def quantize_onnx(path, data_file: str, lm_head: LmHeadScheme = LmHeadScheme.INT8, symmetric: bool = False) -> dict:
    """Rewrite the ONNX model at ``path`` in place (``data_file`` beside it), the lm_head ``int8``
    or ``int4``, every int4 weight ``symmetric`` (ONNX Runtime's rounding) or on its source's grid;
    return op counts for ``kvexport.json``."""
    return _GraphQuantizer(Path(path), data_file, lm_head, symmetric).run()


class _GraphQuantizer:
    """One rewrite of ``quantize_onnx``: the graph, its weights and what the rewrite has added so
    far, shared by one method per kind of node it rewrites."""

    def __init__(self, path: Path, data_file: str, lm_head: LmHeadScheme, symmetric: bool):
        import onnx
        from onnx.external_data_helper import uses_external_data

        self.path, self.data_file, self.lm_head, self.symmetric = path, data_file, lm_head, symmetric
        # One weight at a time: read from the float data file, and the new ones written to the new file
        # as they are made.
        self.model = onnx.load(str(path), load_external_data=False)
        self.weights = Weights(path.parent)
        self.writer = DataFileWriter(path.parent / f".{data_file}.new", data_file)
        self.graph = self.model.graph
        self.initializers = {i.name: i for i in self.graph.initializer}
        self.in_float_file = {i.name for i in self.graph.initializer if uses_external_data(i)}
        self.tied = _fold_weight_transposes(self.graph, self.initializers)
        self.head = _lm_head(self.graph)
        self.added: list = []  # new initializers
        self.nodes: list = []  # the rewritten graph's nodes, in order
        self.tables: dict[str, tuple[str, str]] = {}  # source initializer -> its 8-bit (data, scales)
        self.shared: set[str] = set()  # names of the initializers shared_constant added
        self.groups: dict[tuple[str, int], list] = collections.defaultdict(list)
        self.group_of: dict[str, tuple[str, int]] = {}  # a member's output -> its group
        self.grids: dict[str, dict[int, np.ndarray]] = {}  # a member's output -> its weight's grid_steps by run size
        self.group_projections()
        self.ranks = {v.name: len(v.type.tensor_type.shape.dim) for v in [*self.graph.input, *self.graph.value_info]
                      if v.type.tensor_type.HasField("shape")}

    def run(self) -> dict:
        """Every node rewritten, then the model and its new data file written; the op counts."""
        self.rewrite_nodes()
        return self.write()

    def to_array(self, tensor) -> np.ndarray:
        if tensor.name in self.tied:  # a folded transpose: its table, transposed
            return self.weights.array(self.initializers[self.tied[tensor.name]]).T
        return self.weights.array(tensor)

    def int8_table(self, source: str, matrix_nk) -> tuple[str, str]:
        """The 8-bit blocks of the [N, K] matrix ``matrix_nk()``, computed and added once however
        many ops read it (a tied table's second reader reads no float copy at all)."""
        if source not in self.tables:
            matrix = matrix_nk()
            block = table_block(matrix.shape[1])
            q, scale = int8_blocks(matrix, block)
            n, k = q.shape
            self.tables[source] = (f"{source}_q8", f"{source}_scales")
            self.added.extend([self.writer.add(q.reshape(n, k // block, block), f"{source}_q8"),
                               self.writer.add(scale, f"{source}_scales")])
        return self.tables[source]

    def group_projections(self) -> None:
        # Projections grouped by their input and bits: q/k/v (and gate/up) become one MatMulNBits over
        # their weights stacked along N (4-bit: one offset MatMul and one Add), then a Split. Every node
        # costs a thread-pool dispatch per step, which at this size costs as much as the arithmetic.
        for node in self.graph.node:
            weight = self.initializers.get(node.input[1]) if len(node.input) > 1 else None
            if node.op_type == "MatMul" and node.output[0] != self.head and _quantizable(weight, axis=0):
                if self.symmetric:
                    bits = 4
                else:
                    weight_nk = self.to_array(weight).T
                    grid = self.grids[node.output[0]] = {size: grid_steps(weight_nk, size) for size in (FINE_BLOCK, BLOCK)}
                    bits = 8 if finer_than_4_bits(weight_nk, grid[FINE_BLOCK], grid[BLOCK]) else 4
                self.group_of[node.output[0]] = (node.input[0], bits)
                self.groups[self.group_of[node.output[0]]].append(node)

    def shared_constant(self, name: str, make) -> str:
        """An initializer several nodes read, added the first time it is asked for."""
        if name not in self.shared:
            self.added.append(self.writer.add(make(), name))
            self.shared.add(name)
        return name

    def block_sums(self, x: str, k: int, base: str) -> str:
        """``x [..., K]`` summed per block of 32: ``[..., K/32]``, the offsets' multiplier."""
        from onnx import helper

        sums = f"{x}_block_sums"
        if x in self.ranks:  # a reshape to [..., K/32, 32] and a sum over the last axis
            rank = self.ranks[x]
            shape = self.shared_constant(f"block_shape_{rank}_{k}", lambda: np.array([0] * (rank - 1) + [k // BLOCK, BLOCK], np.int64))
            axes = self.shared_constant("block_sum_axes", lambda: np.array([-1], np.int64))
            self.nodes.append(helper.make_node("Reshape", [x, shape], [f"{x}_blocks"], name=f"{base}_blocks"))
            self.nodes.append(helper.make_node("ReduceSum", [f"{x}_blocks", axes], [sums], name=f"{base}_block_sums", keepdims=0))
        else:  # x's rank unknown: a MatMul by [K, K/32], 1 where row i is in block j
            membership = self.shared_constant(
                f"block_sum_{k}", lambda: np.kron(np.eye(k // BLOCK, dtype=np.float32), np.ones((BLOCK, 1), np.float32))
            )
            self.nodes.append(helper.make_node("MatMul", [x, membership], [sums], name=f"{base}_block_sums"))
        return sums

    def projection_group(self, members: list, bits: int) -> None:
        """The group's one MatMulNBits (and its offsets where asymmetric), then a Split back into
        the members' outputs."""
        from onnx import helper

        x, base = members[0].input[0], members[0].name or members[0].output[0]
        tensors = [self.initializers[m.input[1]] for m in members]
        k, n = tensors[0].dims[0], sum(w.dims[1] for w in tensors)
        stacked = np.concatenate([self.to_array(w).T for w in tensors])  # [N, K], stacked along N
        out = members[0].output[0] if len(members) == 1 else f"{base}_packed"
        if bits == 8:
            # Blocks of 32 where they hold the source's grid (Q5_0, Q8_0: one step per 32; fewer
            # bytes per step than blocks of 16), else 16 (Q6_K steps each run of 16).
            for block in (BLOCK, FINE_BLOCK):
                steps = np.concatenate([self.grids[m.output[0]][block] for m in members])  # the stacked runs' grids
                q8, scale = int8_blocks(stacked, block, steps)
                if block == FINE_BLOCK or on_levels(stacked, q8, scale, block):
                    break
            self.added.extend([self.writer.add(q8.reshape(n, k // block, block), f"{base}_q8"),
                               self.writer.add(scale, f"{base}_scales")])
            self.nodes.append(_matmul_nbits(helper, x, f"{base}_q8", f"{base}_scales", out, k, n, 8, block))
        elif self.symmetric:
            packed, scale = symmetric_int4(stacked.T)
            self.added.extend([self.writer.add(packed, f"{base}_q4"), self.writer.add(scale, f"{base}_scales")])
            self.nodes.append(_matmul_nbits(helper, x, f"{base}_q4", f"{base}_scales", out, k, n, 4))
        else:
            steps = np.concatenate([self.grids[m.output[0]][BLOCK] for m in members])
            q, scale, offset = int4_blocks(stacked, steps)
            packed = _two_per_byte(q)
            self.added.extend([self.writer.add(packed, f"{base}_q4"), self.writer.add(scale, f"{base}_scales"),
                               self.writer.add(np.ascontiguousarray(offset.T), f"{base}_offsets")])
            sums = self.block_sums(x, k, base)
            self.nodes.extend([
                _matmul_nbits(helper, x, f"{base}_q4", f"{base}_scales", f"{base}_symmetric", k, n, 4),
                helper.make_node("MatMul", [sums, f"{base}_offsets"], [f"{base}_offset"], name=f"{base}_offset"),
                helper.make_node("Add", [f"{base}_symmetric", f"{base}_offset"], [out], name=f"{base}_add_offset"),
            ])  # fmt: skip
        if len(members) > 1:
            sizes = f"{base}_split_sizes"
            self.added.append(self.writer.add(np.array([w.dims[1] for w in tensors], np.int64), sizes))
            self.nodes.append(helper.make_node("Split", [out, sizes], [m.output[0] for m in members], name=f"{base}_split", axis=-1))

    def lm_head_node(self, node, weight) -> None:
        """The lm_head's MatMul as a MatMulNBits: ``int4`` (symmetric or with zero points) or 8-bit."""
        from onnx import helper

        k, n = weight.dims  # [K, N]
        base = node.name or node.output[0]
        if self.lm_head == LmHeadScheme.INT4 and self.symmetric:
            data, scales = symmetric_int4(self.to_array(weight))
            self.added.extend([self.writer.add(data, f"{base}_q4"), self.writer.add(scales, f"{base}_scales")])
            self.nodes.append(_matmul_nbits(helper, node.input[0], f"{base}_q4", f"{base}_scales", node.output[0], k, n, 4))
        elif self.lm_head == LmHeadScheme.INT4:  # a copy of its own: a tied lookup keeps the 8-bit table
            data, scales, zero_points = _int4_with_zero_points(self.to_array(weight))
            self.added.extend([self.writer.add(data, f"{base}_q4"), self.writer.add(scales, f"{base}_scales"),
                               self.writer.add(zero_points, f"{base}_zero_points")])
            self.nodes.append(_matmul_nbits(helper, node.input[0], f"{base}_q4", f"{base}_scales", node.output[0], k, n, 4,
                                            zero_points=f"{base}_zero_points"))
        else:  # 8-bit, and a tied one shares the lookup's blocks
            data, scales = self.int8_table(self.tied.get(weight.name, weight.name),
                                           lambda: np.ascontiguousarray(self.to_array(weight).T))
            self.nodes.append(_matmul_nbits(helper, node.input[0], data, scales, node.output[0], k, n, 8, table_block(k)))

    def quantized_gather(self, node) -> None:
        """An embedding lookup (``Gather`` on axis 0) as a GatherBlockQuantized of the 8-bit table."""
        from onnx import helper

        table = self.initializers[node.input[0]]
        n, k = table.dims
        base = node.name or node.output[0]
        data, scales = self.int8_table(node.input[0], lambda: self.to_array(table))  # [N, K/b, b], [N, K/b]
        ids, block = node.input[1], table_block(k)
        self.added += [self.writer.add(np.array([n, k // block, 1], np.int64), f"{base}_scales_shape"),
                       self.writer.add(np.array([k], np.int64), f"{base}_hidden")]
        self.nodes += [
            helper.make_node("Reshape", [scales, f"{base}_scales_shape"], [f"{base}_scales"], name=f"{base}_scales"),
            helper.make_node(
                "GatherBlockQuantized", [data, ids, f"{base}_scales"], [f"{base}_blocks"], name=base,
                domain=MS_DOMAIN, bits=8, block_size=block, gather_axis=0, quantize_axis=2,
            ),  # [*ids.shape, K/b, b]
            helper.make_node("Shape", [ids], [f"{base}_ids_shape"], name=f"{base}_ids_shape"),
            helper.make_node("Concat", [f"{base}_ids_shape", f"{base}_hidden"], [f"{base}_shape"], name=f"{base}_shape", axis=0),
            helper.make_node("Reshape", [f"{base}_blocks", f"{base}_shape"], [node.output[0]], name=f"{base}_reshape"),
        ]

    def rewrite_nodes(self) -> None:
        """``nodes``: the graph's nodes in order, each with a quantizable weight rewritten."""
        graph, initializers = self.graph, self.initializers
        for done, node in enumerate(graph.node):
            if done % 64 == 0:
                report(f"{done:,} of {len(graph.node):,} nodes")
            weight = initializers.get(node.input[1]) if len(node.input) > 1 else None
            if node.op_type == "MatMul" and node.output[0] == self.head and _quantizable(weight, axis=0):
                self.lm_head_node(node, weight)
            elif node.output[0] in self.group_of:
                members = self.groups[self.group_of[node.output[0]]]
                if node is members[0]:  # the group is emitted where its first member was
                    self.projection_group(members, bits=self.group_of[node.output[0]][1])
            elif node.op_type == "Gather" and _quantizable(initializers.get(node.input[0]), axis=1) and attribute(node, "axis", 0) == 0:
                self.quantized_gather(node)
            else:
                self.nodes.append(node)
        _pack_attention_inputs(self.nodes)

    def write(self) -> dict:
        """The rewritten graph and its new data file written in place of the float ones; the op counts."""
        import onnx
        from onnx import helper

        graph = self.graph
        del graph.node[:]
        graph.node.extend(self.nodes)
        graph.initializer.extend(self.added)
        prune(graph)  # the float weights now unread go, and the Splits packed attention inputs no longer read
        # The float weights still read (norms, a weight left in float, a folded transpose a float
        # lm_head reads) go to the new file too.
        read = {name for node in graph.node for name in node.input}
        kept = [self.writer.add(self.to_array(t), t.name) if t.name in self.in_float_file else t for t in graph.initializer]
        kept += [self.writer.add(self.to_array(self.initializers[name]), name) for name in self.tied if name in read]
        del graph.initializer[:]
        graph.initializer.extend(kept)
        self.writer.replace(self.path.parent / self.data_file, mode_of=self.path)
        if not any(o.domain == MS_DOMAIN for o in self.model.opset_import):
            self.model.opset_import.append(helper.make_opsetid(MS_DOMAIN, 1))
        onnx.save_model(self.model, str(self.path))
        counts = collections.Counter(n.op_type for n in self.model.graph.node)
        return {op: counts[op] for op in ("MatMulNBits", "GatherBlockQuantized") if counts[op]}


def _pack_attention_inputs(nodes) -> None:
    """A GroupQueryAttention whose query, key and value are the three outputs of one Split (the
    stacked q/k/v projection; the value maybe reshaped and back) reads the packed projection
    instead: the kernel's packed-QKV form, without the Split."""
    producers = {out: node for node in nodes for out in node.output}
    for node in nodes:
        if node.op_type != "GroupQueryAttention":
            continue
        value = node.input[2]
        while value in producers and producers[value].op_type == "Reshape":  # reshapes keep the row's order
            value = producers[value].input[0]
        split = producers.get(node.input[0])
        if split is not None and split.op_type == "Split" and list(split.output) == [node.input[0], node.input[1], value]:
            node.input[0], node.input[1], node.input[2] = split.input[0], "", ""


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


def table_block(k: int) -> int:
    """The 8-bit lm_head's and embedding table's block along K: the largest of 128, 64, 32 that
    divides it (``_quantizable`` has checked 32 does). Larger blocks run the lm_head, a step's
    largest matmul, faster (docs/performance.md), even where the source's table has blocks of 32."""
    return next(block for block in (128, 64, BLOCK) if k % block == 0)


def _quantizable(weight, axis: int) -> bool:
    """A 2-D float initializer whose quantized dim (``axis``) is a multiple of the block."""
    from onnx import TensorProto

    return (weight is not None and len(weight.dims) == 2 and weight.data_type == TensorProto.FLOAT
            and weight.dims[axis] % BLOCK == 0)


def _matmul_nbits(helper, x: str, q: str, scales: str, out: str, k: int, n: int, bits: int, block: int = BLOCK,
                  zero_points: str | None = None):
    return helper.make_node(
        "MatMulNBits", [x, q, scales, *([zero_points] if zero_points else [])], [out], name=f"{out}_nbits",
        domain=MS_DOMAIN, K=k, N=n, bits=bits, block_size=block, accuracy_level=ACCURACY_LEVEL,
    )


def symmetric_int4(weight_kn: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A [K, N] weight rounded by ONNX Runtime's own symmetric int4 quantizer (what its
    ``MatMulNBitsQuantizer`` and onnxruntime-genai's builder call): MatMulNBits' data
    ``[N, K/32, 16]`` and scales ``[N, K/32]``; no zero points (the kernel's default, 8)."""
    from onnxruntime.capi._pybind_state import quantize_matmul_4bits

    k, n = weight_kn.shape
    packed = np.zeros((n, k // BLOCK, BLOCK // 2), np.uint8)
    scales = np.zeros((n, k // BLOCK), np.float32)
    zero_points = np.zeros((n, (k // BLOCK + 1) // 2), np.uint8)  # written, unused when symmetric
    quantize_matmul_4bits(packed, np.ascontiguousarray(weight_kn, dtype=np.float32), scales, zero_points, BLOCK, n, k, True)
    return packed, scales


def _int4_with_zero_points(weight_kn: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """MatMulNBits' int4 arrays for a [K, N] weight, ``int4_zero_point_blocks``' rounding: data
    ``[N, K/32, 16]``, scales ``[N, K/32]``, zero points ``[N, K/64]`` (two levels a byte).

    ONNX Runtime's own rounding (``quantize_matmul_4bits``) takes the step from the range and
    rounds the zero point, clipping one end by up to half a step: the weights of largest magnitude
    come out further off (docs/quantization.md)."""
    # The transpose as a view: int4_zero_point_blocks copies it a piece of rows at a time (a 262k-row
    # table whole would be one more float32 copy of itself at peak).
    q, step, zero = int4_zero_point_blocks(weight_kn.T)
    return _two_per_byte(q), step, _two_per_byte(zero)


def _two_per_byte(levels: np.ndarray) -> np.ndarray:
    """4-bit levels (uint8) packed two a byte along the last axis, low nibble first, as MatMulNBits
    reads them; an odd count ends with a zero nibble."""
    if levels.shape[-1] % 2:
        levels = np.pad(levels, [(0, 0)] * (levels.ndim - 1) + [(0, 1)])
    return levels[..., 0::2] | (levels[..., 1::2] << 4)


def _fold_weight_transposes(graph, initializers: dict) -> dict[str, str]:
    """A MatMul whose weight is ``Transpose(initializer)`` reads the transposed initializer instead;
    returns ``{transposed initializer: the initializer it was transposed from}``, and adds each to
    ``initializers`` as its shape (its values are the table's, read when asked for).

    The exporter folds a linear layer's ``W.T`` into a constant, except where the weight is shared
    (a tied lm_head reads the embedding table through a Transpose, so the table is stored once);
    only constant weights are quantized, and that lm_head, the largest matrix of a small model,
    would stay in float."""
    from onnx import TensorProto

    producers = {out: node for node in graph.node for out in node.output}
    folded: dict[str, str] = {}
    for node in list(graph.node):
        transpose = producers.get(node.input[1]) if node.op_type == "MatMul" and len(node.input) > 1 else None
        if transpose is None or transpose.op_type != "Transpose" or transpose.input[0] not in initializers:
            continue
        weight = initializers[transpose.input[0]]
        perm = next((list(a.ints) for a in transpose.attribute if a.name == "perm"), [1, 0])
        if len(weight.dims) != 2 or perm != [1, 0] or transpose not in graph.node:
            continue
        name = transpose.output[0]
        initializers[name] = TensorProto(name=name, data_type=weight.data_type, dims=list(reversed(weight.dims)))
        graph.node.remove(transpose)
        folded[name] = transpose.input[0]
    return folded
