"""kvexport's shortcuts through ExecuTorch's lowering (XNNPACK's passes only where they can change a
partition, the partitioner's keep-whole choice made up front, one decomposition, the merge check on
sets, the edge passes chained) give ExecuTorch's own program."""

from __future__ import annotations

import hashlib

from executorch.backends.xnnpack import _passes as xnnpack_passes
from executorch.backends.xnnpack.partition.graphs import bilinear_2d, sdpa

from kvexport.artifact.manifest import read_manifest
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

    kept = [p for p in all_passes if only_applying.applies(p, Graph)]
    assert kept == [p for p in all_passes if p not in only_applying.PASS_NEEDS
                    or p in (xnnpack_passes.FuseBatchNormPass, xnnpack_passes.DecomposeBatchNorm)]


def test_a_pass_is_asked_about_the_partition_the_passes_before_it_left(monkeypatch):
    """A pass whose operator an earlier pass of the same run makes runs after that pass, not before."""
    import torch
    from executorch.exir import to_edge
    from executorch.exir.pass_base import ExportPass, PassResult

    ran = []

    def pass_named(name, makes=None):
        class Pass(ExportPass):
            def call(self, graph_module):
                ran.append(name)
                if makes is not None:
                    next(n for n in graph_module.graph.nodes if n.op == "call_function").target = makes
                return PassResult(graph_module, True)
        return Pass

    class Squares(torch.nn.Module):
        def forward(self, x):
            return x * x

    program = to_edge(torch.export.export(Squares(), (torch.ones(2),))).exported_program()
    made = only_applying._aten.sub.Tensor  # what the first pass makes of the product
    first, second = pass_named("first", makes=made), pass_named("second")
    monkeypatch.setitem(only_applying.PASS_NEEDS, second, {made})
    only_applying._PassManagerOfPassesThatApply(program, passes=[second, first, second]).transform()
    assert ran == ["first", "second"]


def test_kvexport_s_lowering_shortcuts_give_executorch_s_own_program(artifact, tmp_path, monkeypatch):
    """Tiny Mistral (sliding rings through custom ops, several partitions a layer; no set-ordered
    tables, so its bytes do not follow the hash seed): the same .pte and .ptd bytes as the session's
    artifact when lowered as ExecuTorch lowers on its own, every XNNPACK pass run on every partition,
    XNNPACK's partitioner as it is (its keep-whole check made node by node, three decompositions,
    the first functionalizing), its merge check walking each downstream set of its own dependency
    viewers, and the edge passes
    each in a retrace of its own."""
    import contextlib

    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner

    from kvexport.exporter.executorch import edge_passes, xnnpack_partitioner
    from kvexport.exporter.executorch.xnnpack_rewrites import partitioner_configs

    shortcuts = artifact("tiny-mistral")
    monkeypatch.setattr(only_applying, "PASS_NEEDS", {})
    monkeypatch.setattr(xnnpack_partitioner, "xnnpack_partitioner", lambda bfloat16: XnnpackPartitioner(configs=partitioner_configs()))
    monkeypatch.setattr(xnnpack_partitioner, "decomposed_once", lambda program, partitioner: program)
    monkeypatch.setattr(xnnpack_partitioner, "functionalized_already", lambda program: contextlib.nullcontext())
    monkeypatch.setattr(xnnpack_partitioner, "merge_checks_by_set_overlap", contextlib.nullcontext)
    monkeypatch.setattr(edge_passes, "operator_rewrites_chained", contextlib.nullcontext)
    as_executorch_lowers = tmp_path / "as-executorch-lowers"
    chosen = read_manifest(shortcuts).export_options.get("sdpa_query", "auto")  # what auto chose for the artifact
    export_model(ExportOptions("tiny-mistral", "executorch", as_executorch_lowers, TEST_CACHE_LEN, sdpa_query=chosen),
                 Progress(quiet=True))
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


def test_the_bitset_merge_check_answers_as_executorch_s_for_every_pair():
    """On a graph where some merges would make a cycle (a node outside both partitions between
    them) and others would not, every pair of single-node partitions gets ExecuTorch's answer
    from a partitioner built with ``Downstreams``, whose users of each node are ExecuTorch's."""
    import torch
    from executorch.exir.backend.canonical_partitioners.group_partitioner import GroupBasedPartitioner
    from torch.fx.passes.infra.partitioner import Partition
    from torch.fx.passes.operator_support import create_op_support

    from kvexport.exporter.executorch.xnnpack_partitioner import Downstreams, _can_merge_partitions, merge_checks_by_set_overlap

    def f(x, y):
        a = torch.relu(x)
        b = torch.sin(a)  # between a and c: {a, c} would depend on b and b on it
        c = a + b
        d = torch.cos(y)  # independent of a, b, c
        e = c * d
        return torch.tanh(e) + a

    graph_module = torch.fx.symbolic_trace(f)
    support = create_op_support(lambda submodules, node: True)
    executorch_s = GroupBasedPartitioner(graph_module, support)
    with merge_checks_by_set_overlap():
        partitioner = GroupBasedPartitioner(graph_module, support)
    assert isinstance(partitioner.dependency_viewer, Downstreams)
    for node in graph_module.graph.nodes:
        assert partitioner.dependency_viewer.downstreams_of(node) == executorch_s.dependency_viewer.downstreams_of(node)
    nodes = [n for n in graph_module.graph.nodes if n.op == "call_function"]
    partitions = {i: Partition(id=i, nodes=[n]) for i, n in enumerate(nodes)}
    answers = {}
    for p1 in partitions:
        for p2 in partitions:
            if p1 != p2:
                ours = _can_merge_partitions(partitioner, p1, p2, partitions)
                assert ours == GroupBasedPartitioner._can_merge_partitions(executorch_s, p1, p2, partitions), (nodes[p1], nodes[p2])
                answers[ours] = answers.get(ours, 0) + 1
    assert answers.get(True) and answers.get(False)  # both answers were given


def test_functionalized_already_answers_for_its_program_only():
    import torch

    from kvexport.exporter.executorch.xnnpack_partitioner import decomposed_once, functionalized_already, xnnpack_partitioner

    class Scale(torch.nn.Module):
        def forward(self, x):
            return torch.nn.functional.silu(x) * 2

    program = torch.export.export(Scale(), (torch.ones(2, 3),))
    decomposed = decomposed_once(program, xnnpack_partitioner())
    with functionalized_already([decomposed]):
        assert decomposed.run_decompositions({}) is decomposed
        assert program.run_decompositions({}) is not program  # another program: torch's own
        assert decomposed.run_decompositions() is not decomposed  # another table: torch's own
    assert decomposed.run_decompositions({}) is not decomposed  # outside the block: torch's own


def sha256(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()
