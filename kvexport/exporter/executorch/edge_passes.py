"""ExecuTorch's operator-by-operator ATen-to-edge passes, run in one retrace instead of four.

Turning the ATen program into an edge program, ExecuTorch runs a list of passes over the whole graph
(``_get_aten_to_edge_passes``). Four in a row rewrite one operator call at a time and nothing else
(``aten.t`` to ``t_copy``, views to their copies, Python scalars and symbolic sizes to tensors), and
each is an ``ExportPass``: each retraces every node of the program with fake tensors and a symbolic
token count, a large share of an export's time (docs/performance.md). Chained as one class, each
pass's ``call_operator`` hands its rewritten call to the next one's (``super()``), in the list's
order, so one retrace makes all four rewrites; an operator one of them inserts goes through the
chain from its start, where the passes before it leave it as it is (none of them rewrites
``scalar_tensor``). The program's bytes are the same (a test compares them).

ExecuTorch has no public option for its list of passes; ``operator_rewrites_in_one_retrace`` swaps
in the chained pass for the duration of one lowering, and leaves the list as it is where the four
are not found in a row (another ExecuTorch version).
"""

from __future__ import annotations

import contextlib

from executorch.exir.passes.normalize_transpose_pass import NormalizeTransposePass
from executorch.exir.passes.replace_broken_ops_with_function_ops_pass import ReplaceBrokenOpsWithFunctionalOpsPass
from executorch.exir.passes.scalar_to_tensor_pass import ScalarToTensorPass
from executorch.exir.passes.sym_to_tensor_pass import SymToTensorPass
from executorch.exir.program import _program
from torch.fx.passes.infra.pass_manager import pass_result_wrapper

CHAINED = (NormalizeTransposePass, ReplaceBrokenOpsWithFunctionalOpsPass, ScalarToTensorPass, SymToTensorPass)


class OperatorRewrites(*CHAINED):
    """The four passes of ``CHAINED``, in that order, in one retrace."""


def chain_operator_rewrites(passes: list) -> list:
    """``passes`` with the run of ``CHAINED`` in it (ExecuTorch's instances, wrapped or not)
    replaced by one ``OperatorRewrites``; as they are where there is no such run."""
    kinds = [type(getattr(p, "__wrapped__", p)) for p in passes]
    for start in range(len(passes) - len(CHAINED) + 1):
        if tuple(kinds[start : start + len(CHAINED)]) == CHAINED:
            return [*passes[:start], pass_result_wrapper(OperatorRewrites()), *passes[start + len(CHAINED) :]]
    return passes


@contextlib.contextmanager
def operator_rewrites_in_one_retrace():
    """Within the block, ExecuTorch's ATen-to-edge passes run ``CHAINED`` as one ``OperatorRewrites``."""
    original = _program._get_aten_to_edge_passes

    def aten_to_edge_passes(config):
        pre_op_replace_passes, post_op_replace_passes = original(config)
        return chain_operator_rewrites(pre_op_replace_passes), post_op_replace_passes

    _program._get_aten_to_edge_passes = aten_to_edge_passes
    try:
        yield
    finally:
        _program._get_aten_to_edge_passes = original
