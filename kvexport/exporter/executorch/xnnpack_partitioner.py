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
"""

from __future__ import annotations

from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
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


def xnnpack_partitioner() -> DecidedXnnpackPartitioner:
    return DecidedXnnpackPartitioner(configs=partitioner_configs())
