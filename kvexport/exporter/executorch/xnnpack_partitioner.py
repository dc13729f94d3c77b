"""XNNPACK's partitioner, with its choice of the operators to keep whole made once, up front.

``to_edge_transform_and_lower`` asks each partitioner which ATen operators to keep whole rather than
decompose (XNNPACK takes ``linear`` and torchao's quantize / dequantize as they are). XNNPACK
answers with a per-node check besides, and for a partitioner with a check ExecuTorch decomposes the
whole program three times (functionalize; decompose keeping the candidates; decompose again once the
nodes the check accepts are set aside); for one without a check, twice. Each time retraces every
node of the program with fake tensors: a large share of an export's time (docs/performance.md).

``DecidedXnnpackPartitioner`` runs XNNPACK's check itself on the program it is asked about and
answers without a check: an operator is kept whole where the check accepts every node of it. Where
the check accepts some nodes of an operator and not others, and on the lowered program (the check
ExecuTorch makes after lowering), it answers as XNNPACK does. The program's bytes are the same (a
test compares them); ExecuTorch's path without a check is its own (``_can_skip_using_EDGE_DO_NOT_DECOMP``).

Before any of that, ExecuTorch functionalizes the program in a decomposition of its own
(``run_decompositions({})``, one more retrace of every node). ``decomposed_once`` functionalizes and
decomposes in one retrace, keeping whole every operator XNNPACK might take; within
``functionalized_already`` ExecuTorch's functionalizing call on that program returns it as it is,
and its decomposition afterwards runs only if the check turned an operator down (it looks for
operators left to decompose first).

``merge_checks_by_set_overlap`` cuts one step of ExecuTorch's partitioning itself: before merging
two partitions, ``GroupBasedPartitioner._can_merge_partitions`` asks of every outside user of their
nodes whether anything downstream of it is in them, by walking the user's whole downstream set
(most of the program, for a node early in it) once per user and per pair of partitions. The same
question asked as "do the two overlap" is one AND of two bitsets. And the sets themselves, every
node's transitive users and inputs (built twice: torch.fx's partitioner builds the users first,
then ExecuTorch's both, and only the users are ever asked for), grow with the square of the graph's
nodes, and at a billion parameters they made most of an 8da4w export's peak beyond its weights
(docs/performance.md#export-memory); ``Downstreams`` keeps each node's users as one bitset over the
graph's order (n²/8 bytes). Same answers, so the same partitions (upstream's own cut of this loop's work:
pytorch/executorch#12798).
"""

from __future__ import annotations

import contextlib
import functools
import operator

import torch
from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
from executorch.exir.backend.canonical_partitioners.group_partitioner import GroupBasedPartitioner
from executorch.exir.dialects.edge._ops import EdgeOpOverload

from .xnnpack_rewrites import partitioner_configs


class DecidedXnnpackPartitioner(XnnpackPartitioner):
    def ops_to_not_decompose(self, ep):
        ops, check = super().ops_to_not_decompose(ep)
        calls = [node for node in ep.graph_module.graph.nodes if node.op == "call_function"]
        if check is None or any(isinstance(node.target, EdgeOpOverload) for node in calls):
            return ops, check
        verdicts = {op: set() for op in ops}  # what the check says of each node of each operator
        for node in calls:
            if node.target in verdicts:
                verdicts[node.target].add(check(node))
        if any(len(verdict) > 1 for verdict in verdicts.values()):
            return ops, check
        return [op for op, verdict in verdicts.items() if verdict != {False}], None


def xnnpack_partitioner(bfloat16: bool = False) -> DecidedXnnpackPartitioner:
    """``bfloat16``: XNNPACK takes bfloat16 linear layers too (ExecuTorch's opt-in ``enable_bf16``,
    for its fully-connected kernel); the other bfloat16 ops stay with ExecuTorch's portable kernels:
    XNNPACK 1.5.1 fails to build a bfloat16 batch matmul when the program loads."""
    from executorch.backends.xnnpack.partition.config.gemm_configs import LinearConfig

    partitioner = DecidedXnnpackPartitioner(configs=partitioner_configs(), enable_bf16=bfloat16)
    for config in partitioner.target_partitioner_configs.values():
        config.enable_bf16 = bfloat16 and isinstance(config, LinearConfig)
    return partitioner


def decomposed_once(program: torch.export.ExportedProgram, partitioner: XnnpackPartitioner) -> torch.export.ExportedProgram:
    """``program`` functionalized and decomposed as ExecuTorch decomposes it, except the operators
    ``partitioner`` might keep whole (its check decides which, on the result)."""
    from executorch.exir.program._program import _default_decomposition_table

    candidates, _ = XnnpackPartitioner.ops_to_not_decompose(partitioner, program)  # the list only: no check run
    table = _default_decomposition_table()
    for op in candidates:
        table.pop(op, None)
    return program.run_decompositions(table)


@contextlib.contextmanager
def functionalized_already(programs: list[torch.export.ExportedProgram]):
    """Within the block, ``program.run_decompositions({})`` (functionalize, decompose nothing) is
    ``program`` for each of ``programs``: outputs of ``decomposed_once``, functional already."""
    original = torch.export.ExportedProgram.run_decompositions

    def run_decompositions(self, decomp_table=None, *args, **kwargs):
        if any(self is p for p in programs) and decomp_table == {} and not args and not kwargs:
            return self
        return original(self, decomp_table, *args, **kwargs)

    torch.export.ExportedProgram.run_decompositions = run_decompositions
    try:
        yield
    finally:
        torch.export.ExportedProgram.run_decompositions = original


class Downstreams:
    """Each node's transitive users, as one bitset over the graph's nodes in order: what the
    partitioners' dependency viewers hold as a set per node."""

    def __init__(self, graph_module: torch.fx.GraphModule):
        self.index = {node: i for i, node in enumerate(graph_module.graph.nodes)}
        self.bits: dict[torch.fx.Node, int] = {}
        for node in reversed(graph_module.graph.nodes):
            bits = 0
            for user in node.users:
                bits |= (1 << self.index[user]) | self.bits[user]
            self.bits[node] = bits

    def mask(self, nodes) -> int | None:
        """``nodes`` as a bitset, or None where one is not of the graph this was built on."""
        if any(node not in self.index for node in nodes):
            return None
        return functools.reduce(operator.or_, (1 << self.index[node] for node in nodes), 0)

    def downstreams_of(self, node: torch.fx.Node) -> set[torch.fx.Node]:
        """The viewers' answer, as a set (made now: ``mask`` is the quick question)."""
        bits, nodes = self.bits.get(node, 0), list(self.index)
        return {nodes[i] for i in range(bits.bit_length()) if bits >> i & 1}


def _can_merge_partitions(self, p1, p2, partitions_by_id) -> bool:
    """``GroupBasedPartitioner._can_merge_partitions``'s answer, its overlap test one AND of bitsets."""
    from torch.fx.passes.utils.fuser_utils import validate_partition

    combined = set(partitions_by_id[p1].nodes) | set(partitions_by_id[p2].nodes)
    outside_users = {user for node in combined for user in node.users if user not in combined}
    viewer = self.dependency_viewer
    mask = viewer.mask(combined) if isinstance(viewer, Downstreams) else None
    if mask is not None:
        if any(viewer.bits.get(user, 0) & mask for user in outside_users):
            return False  # merging would make a cycle through that user
    elif any(not combined.isdisjoint(viewer.downstreams_of(user)) for user in outside_users):
        return False
    return validate_partition(list(combined))


@contextlib.contextmanager
def merge_checks_by_set_overlap():
    """Within the block, ExecuTorch's group partitioner is built with ``Downstreams`` for both
    viewers and checks merges with ``_can_merge_partitions``."""
    from executorch.exir.backend.canonical_partitioners import group_partitioner
    from torch.fx.passes.infra import partitioner as fx_partitioner

    build, check = GroupBasedPartitioner.__init__, GroupBasedPartitioner._can_merge_partitions

    def built_with_bitsets(self, *args, **kwargs):
        viewers = fx_partitioner._DependencyViewer, group_partitioner._DependencyViewer
        fx_partitioner._DependencyViewer = group_partitioner._DependencyViewer = Downstreams
        try:
            build(self, *args, **kwargs)
        finally:
            fx_partitioner._DependencyViewer, group_partitioner._DependencyViewer = viewers

    GroupBasedPartitioner.__init__, GroupBasedPartitioner._can_merge_partitions = built_with_bitsets, _can_merge_partitions
    try:
        yield
    finally:
        GroupBasedPartitioner.__init__, GroupBasedPartitioner._can_merge_partitions = build, check
