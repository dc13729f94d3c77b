"""ExecuTorch's operator-by-operator edge passes chained into one retrace."""

from __future__ import annotations

import torch
from executorch.exir.capture._config import EdgeCompileConfig
from executorch.exir.program import _program

from kvexport.exporter.executorch.edge_passes import CHAINED, OperatorRewrites, chain_operator_rewrites, operator_rewrites_in_one_retrace


def test_the_chain_runs_the_passes_in_executorch_s_order():
    assert OperatorRewrites.__mro__[1 : 1 + len(CHAINED)] == CHAINED


def test_executorch_s_list_holds_the_chained_passes_in_a_row_and_the_block_chains_them():
    executorch_s = _program._get_aten_to_edge_passes
    original, _ = executorch_s(EdgeCompileConfig())
    kinds = [type(getattr(p, "__wrapped__", p)) for p in original]
    start = kinds.index(CHAINED[0])
    assert tuple(kinds[start : start + len(CHAINED)]) == CHAINED
    with operator_rewrites_in_one_retrace():
        chained, _ = _program._get_aten_to_edge_passes(EdgeCompileConfig())
    assert [type(getattr(p, "__wrapped__", p)) for p in chained] == [*kinds[:start], OperatorRewrites, *kinds[start + len(CHAINED):]]
    assert _program._get_aten_to_edge_passes is executorch_s  # put back


def test_a_list_without_the_run_is_left_as_it_is():
    passes = [CHAINED[1](), CHAINED[0]()]  # not in ExecuTorch's order
    assert chain_operator_rewrites(passes) == passes


def test_the_chain_makes_each_pass_s_rewrite_in_one_retrace():
    """aten.t (NormalizeTransposePass), a Python scalar where the schema takes a tensor
    (ScalarToTensorPass) and a symbolic size used as a tensor (SymToTensorPass) are rewritten as
    the passes one after the other rewrite them, node for node."""

    class Uses(torch.nn.Module):
        def forward(self, x):
            return torch.ops.aten.t.default(x) * x.shape[0], torch.ops.aten.mul.Tensor(x, 2.0)

    program = torch.export.export(Uses(), (torch.ones(3, 3),), dynamic_shapes=({0: torch.export.Dim("n", max=8), 1: torch.export.Dim("m", max=8)},))
    program = program.run_decompositions({})

    def targets(graph_module):
        return [str(n.target) for n in graph_module.graph.nodes if n.op == "call_function"]

    one_by_one = program.graph_module
    for pass_ in CHAINED:
        one_by_one = pass_()(one_by_one).graph_module
    chained = OperatorRewrites()(program.graph_module).graph_module
    assert targets(chained) == targets(one_by_one)
    assert "aten.t_copy.default" in targets(chained) and "aten.t.default" not in targets(chained)
    assert "aten.scalar_tensor.default" in targets(chained)
