"""kvexport's shortcuts through ExecuTorch's lowering (XNNPACK's passes only where they can change a
partition, the partitioner's keep-whole choice made up front) give ExecuTorch's own program."""

from __future__ import annotations

import hashlib

from executorch.backends.xnnpack import _passes as xnnpack_passes
from executorch.backends.xnnpack.partition.graphs import bilinear_2d, sdpa

from kvexport.exporter.executorch import xnnpack_passes as only_applying
from kvexport.exporter.pipeline import ExportOptions, export_model
from kvexport.progress import Progress

from tests.conftest import TEST_CACHE_LEN


def test_every_pattern_a_skipped_matching_pass_looks_for_holds_its_operator():
    """The subgraph-matching passes are left out where an operator every one of their patterns holds
    is absent: a pattern without it would make that unsafe."""
    for pass_, patterns in ((xnnpack_passes.ConvertToSDPAPass, sdpa.get_graphs()),
                            (xnnpack_passes.ConvertToUpsampleBilinear2d, list(bilinear_2d.get_graphs_dict()))):
        needed = only_applying.PASS_NEEDS[pass_]
        for pattern in patterns:
            assert needed & {node.target for node in pattern.graph.nodes}, pass_.__name__


def test_the_passes_that_apply_are_xnnpack_s_in_its_order():
    all_passes = xnnpack_passes.XNNPACKPassManager(exported_program=None).passes
    assert set(only_applying.PASS_NEEDS) <= set(all_passes)

    class Graph:  # a partition with a batch norm and nothing else the filter knows
        nodes = [type("Node", (), {"op": "call_function", "target": next(iter(only_applying.PASS_NEEDS[xnnpack_passes.FuseBatchNormPass]))})]

    kept = only_applying.passes_that_apply(all_passes, Graph)
    assert kept == [p for p in all_passes if p not in only_applying.PASS_NEEDS
                    or p in (xnnpack_passes.FuseBatchNormPass, xnnpack_passes.DecomposeBatchNorm)]


def test_kvexport_s_lowering_shortcuts_give_executorch_s_own_program(artifact, tmp_path, monkeypatch):
    """Tiny Mistral (sliding rings through custom ops, several partitions a layer; no set-ordered
    tables, so its bytes do not follow the hash seed): the same .pte and .ptd bytes as the session's
    artifact when lowered as ExecuTorch lowers on its own, every XNNPACK pass run on every partition
    and XNNPACK's partitioner as it is (its keep-whole check made node by node, three decompositions)."""
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner

    from kvexport.exporter.executorch import xnnpack_partitioner
    from kvexport.exporter.executorch.xnnpack_rewrites import partitioner_configs

    shortcuts = artifact("tiny-mistral")
    monkeypatch.setattr(only_applying, "PASS_NEEDS", {})
    monkeypatch.setattr(xnnpack_partitioner, "xnnpack_partitioner", lambda: XnnpackPartitioner(configs=partitioner_configs()))
    as_executorch_lowers = tmp_path / "as-executorch-lowers"
    export_model(ExportOptions("tiny-mistral", "executorch", as_executorch_lowers, TEST_CACHE_LEN), Progress(quiet=True))
    for name in ("model.pte", "model.ptd"):
        assert sha256(as_executorch_lowers / name) == sha256(shortcuts / name), name


def test_an_operator_the_check_takes_only_in_part_is_left_to_executorch_s_node_by_node_path(monkeypatch):
    import torch
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner

    from kvexport.exporter.executorch.xnnpack_partitioner import xnnpack_partitioner

    class TwoLinears(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.b(self.a(x))

    program = torch.export.export(TwoLinears(), (torch.ones(1, 4),)).run_decompositions({})
    linear = torch.ops.aten.linear.default
    linears = [node for node in program.graph_module.graph.nodes if node.target == linear]
    assert len(linears) == 2
    partitioner = xnnpack_partitioner()
    for takes in ({linears[0].name, linears[1].name}, set(), {linears[0].name}):
        def check(node, takes=takes):
            return node.name in takes
        monkeypatch.setattr(XnnpackPartitioner, "ops_to_not_decompose", lambda self, ep, check=check: ([linear], check))
        ops, got_check = partitioner.ops_to_not_decompose(program)
        if len(takes) == 1:  # some nodes, not all: ExecuTorch keeps those the check takes
            assert (ops, got_check) == ([linear], check)
        else:  # all or none: decided here, no check left
            assert (ops, got_check) == (([linear] if takes else []), None)


def sha256(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()
