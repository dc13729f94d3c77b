"""ExecuTorch's operator-by-operator edge passes chained into two retraces."""

from __future__ import annotations

import torch
from executorch.exir.capture._config import EdgeCompileConfig
from executorch.exir.dialects.edge._ops import EdgeOpOverload
from executorch.exir.program import _program

from kvexport.exporter.executorch import edge_passes
from kvexport.exporter.executorch.edge_passes import CHAINED, TO_EDGE, OperatorRewrites, ToEdge, chain_operator_rewrites, operator_rewrites_chained


def kinds(passes) -> list:
    return [type(getattr(p, "__wrapped__", p)) for p in passes]


def test_the_chains_run_the_passes_in_executorch_s_order():
    assert OperatorRewrites.__mro__[1 : 1 + len(CHAINED)] == CHAINED
    assert ToEdge.__mro__[1 : 1 + len(TO_EDGE)] == TO_EDGE


def test_within_the_block_executorch_s_list_runs_the_chains_and_is_put_back_after():
    executorch_s = _program._get_aten_to_edge_passes
    original = kinds(executorch_s(EdgeCompileConfig())[0])
    start = original.index(CHAINED[0])
    assert tuple(original[start : start + len(CHAINED)]) == CHAINED and original[-1] is TO_EDGE[0]
    with operator_rewrites_chained():
        chained = kinds(_program._get_aten_to_edge_passes(EdgeCompileConfig())[0])
        # what _generate_edge_program appends after the list: stand-ins, ToEdge made their rewrites
        assert _program.OpReplacePass is edge_passes._MadeInTheChain and _program.MemoryFormatOpsPass is edge_passes._MadeInTheChain
    assert chained == [*original[:start], OperatorRewrites, *original[start + len(CHAINED) : -1], ToEdge]
    assert _program._get_aten_to_edge_passes is executorch_s
    assert (_program.OpReplacePass, _program.MemoryFormatOpsPass) == TO_EDGE[1:]


def test_a_config_without_dim_order_ops_keeps_the_second_run_as_it_is():
    with operator_rewrites_chained():
        passes, _ = _program._get_aten_to_edge_passes(EdgeCompileConfig(_skip_dim_order=True))
        assert kinds(passes)[-1] is TO_EDGE[0]
        assert (_program.OpReplacePass, _program.MemoryFormatOpsPass) == TO_EDGE[1:]  # ExecuTorch's, not stand-ins


def test_a_list_without_the_run_is_left_as_it_is():
    passes = [CHAINED[1](), CHAINED[0]()]  # not in ExecuTorch's order
    assert chain_operator_rewrites(passes) == passes


def targets(graph_module) -> list[str]:
    return [str(n.target) for n in graph_module.graph.nodes if n.op == "call_function"]


def test_each_chain_rewrites_as_its_passes_one_after_the_other():
    """aten.t (NormalizeTransposePass), a Python scalar where the schema takes a tensor
    (ScalarToTensorPass), a symbolic size used as a tensor (SymToTensorPass); then an int tensor
    times a float one (RemoveMixedTypeOperators: a _to_copy), every operator to its edge one
    (OpReplacePass) and a clone to its dim-order op (MemoryFormatOpsPass): node for node the same."""

    class Uses(torch.nn.Module):
        def forward(self, x, n):
            scaled = torch.ops.aten.t.default(x) * x.shape[0]
            return scaled.clone(memory_format=torch.contiguous_format), torch.ops.aten.mul.Tensor(x, 2.0), x * n

    rows, columns = torch.export.Dim("rows", max=8), torch.export.Dim("columns", max=8)
    dims = ({0: rows, 1: columns}, {0: rows, 1: columns})
    program = torch.export.export(Uses(), (torch.ones(3, 3), torch.ones(3, 3, dtype=torch.int32)), dynamic_shapes=dims)
    graph_module = program.run_decompositions({}).graph_module

    one_by_one = graph_module
    for pass_ in CHAINED:
        one_by_one = pass_()(one_by_one).graph_module
    chained = OperatorRewrites()(graph_module).graph_module
    assert targets(chained) == targets(one_by_one)
    assert "aten.t_copy.default" in targets(chained) and "aten.t.default" not in targets(chained)
    assert "aten.scalar_tensor.default" in targets(chained)

    edge_one_by_one = one_by_one
    for pass_ in TO_EDGE:
        edge_one_by_one = pass_()(edge_one_by_one).graph_module
    edge_chained = ToEdge()(chained).graph_module
    assert targets(edge_chained) == targets(edge_one_by_one)
    assert any("_to_dim_order_copy" in t for t in targets(edge_chained))  # the int tensor, cast
    assert any("_clone_dim_order" in t for t in targets(edge_chained))
    multiplications = [n.target for n in edge_chained.graph.nodes if "aten.mul.Tensor" in str(n.target)]
    assert multiplications and all(isinstance(op, EdgeOpOverload) for op in multiplications)  # edge operators
