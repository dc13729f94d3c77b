"""ExecuTorch's operator-by-operator ATen-to-edge passes, run in two retraces instead of seven.

Turning the ATen program into an edge program, ExecuTorch runs a list of passes over the whole graph
(``_generate_edge_program``: the list ``_get_aten_to_edge_passes`` gives, then ``OpReplacePass`` and
``MemoryFormatOpsPass``). Seven of them rewrite one operator call at a time and nothing else, in two
runs: ``aten.t`` to ``t_copy``, views to their copies, Python scalars and symbolic sizes to tensors;
then, after a few passes of another kind, mixed-dtype arithmetic to one dtype, ATen operators to
edge operators, memory formats to dim orders. Each is an ``ExportPass``: each retraces every node of
the program with fake tensors and a symbolic token count, a large share of an export's time
(docs/performance.md).

Chained as one class, each pass's ``call_operator`` hands its rewritten call to the next one's
(``super()``), in the list's order, so one retrace makes all of a run's rewrites. An operator one of
them inserts (a ``scalar_tensor``, a ``_to_copy``) goes through the chain from its start, where the
passes before the one that inserted it leave it as it is (none rewrites those). The program's bytes
are the same (a test compares them).

ExecuTorch has no public option for its list of passes; ``operator_rewrites_chained`` swaps in the
chained passes for the duration of one lowering (the second run's last two passes are built inside
``_generate_edge_program``: where ``ToEdge`` runs, their names there stand for a pass that leaves
the graph as it is, the chain having made their rewrites). Where a run is not found as expected
(another ExecuTorch version, a config without dim-order ops), that run is left as ExecuTorch has it.
"""

from __future__ import annotations

import contextlib

from executorch.exir.passes import MemoryFormatOpsPass, OpReplacePass
from executorch.exir.passes.normalize_transpose_pass import NormalizeTransposePass
from executorch.exir.passes.remove_mixed_type_operators import RemoveMixedTypeOperators
from executorch.exir.passes.replace_broken_ops_with_function_ops_pass import ReplaceBrokenOpsWithFunctionalOpsPass
from executorch.exir.passes.scalar_to_tensor_pass import ScalarToTensorPass
from executorch.exir.passes.sym_to_tensor_pass import SymToTensorPass
from executorch.exir.program import _program
from torch.fx.passes.infra.pass_manager import PassResult, pass_result_wrapper

CHAINED = (NormalizeTransposePass, ReplaceBrokenOpsWithFunctionalOpsPass, ScalarToTensorPass, SymToTensorPass)
TO_EDGE = (RemoveMixedTypeOperators, OpReplacePass, MemoryFormatOpsPass)


class OperatorRewrites(*CHAINED):
    """The four passes of ``CHAINED``, in that order, in one retrace."""


class ToEdge(*TO_EDGE):
    """The three passes of ``TO_EDGE``, in that order, in one retrace."""


class _MadeInTheChain:
    """Stands for a pass of ``TO_EDGE`` that ``_generate_edge_program`` builds: ``ToEdge`` made its rewrites."""

    def __call__(self, graph_module):
        return PassResult(graph_module, False)


def chain_operator_rewrites(passes: list) -> list:
    """``passes`` with the run of ``CHAINED`` in it (ExecuTorch's instances, wrapped or not) replaced
    by one ``OperatorRewrites``; as they are where there is no such run."""
    kinds = [type(getattr(p, "__wrapped__", p)) for p in passes]
    for start in range(len(passes) - len(CHAINED) + 1):
        if tuple(kinds[start : start + len(CHAINED)]) == CHAINED:
            return [*passes[:start], pass_result_wrapper(OperatorRewrites()), *passes[start + len(CHAINED) :]]
    return passes


def chain_to_edge(passes: list) -> list | None:
    """``passes`` with its last, ``RemoveMixedTypeOperators``, replaced by ``ToEdge``; None where
    the list does not end so."""
    if not passes or type(getattr(passes[-1], "__wrapped__", passes[-1])) is not TO_EDGE[0]:
        return None
    return [*passes[:-1], ToEdge()]


@contextlib.contextmanager
def operator_rewrites_chained():
    """Within the block, ExecuTorch's ATen-to-edge passes run ``CHAINED`` as one ``OperatorRewrites``
    and ``TO_EDGE`` as one ``ToEdge``."""
    original = _program._get_aten_to_edge_passes
    # The names _generate_edge_program builds the second run's last two passes by. Where they are
    # not ExecuTorch's passes, or the config leaves dim-order ops out, the second run is left alone.
    built_inside = dict(zip(("OpReplacePass", "MemoryFormatOpsPass"), TO_EDGE[1:]))
    names_as_expected = all(getattr(_program, name, None) is kind for name, kind in built_inside.items())

    def aten_to_edge_passes(config):
        pre_op_replace_passes, post_op_replace_passes = original(config)
        chained = chain_operator_rewrites(pre_op_replace_passes)
        to_edge = chain_to_edge(chained) if names_as_expected and not config._skip_dim_order else None
        if names_as_expected:  # the stand-ins only where ToEdge makes their rewrites
            for name, kind in built_inside.items():
                setattr(_program, name, _MadeInTheChain if to_edge else kind)
        return to_edge or chained, post_op_replace_passes

    _program._get_aten_to_edge_passes = aten_to_edge_passes
    try:
        yield
    finally:
        _program._get_aten_to_edge_passes = original
        if names_as_expected:
            for name, kind in built_inside.items():
                setattr(_program, name, kind)
