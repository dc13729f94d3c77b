"""XNNPACK's own graph passes, run only where they can change the graph.

XNNPACK's ``preprocess`` runs its 17 passes on every delegated partition, and each pass ends by
retracing the partition with fake tensors and symbolic shapes, whether it rewrote anything or
not: a large share of an export's time goes there (docs/performance.md). Thirteen of the passes
rewrite only nodes of a few operators (batch norm, convolution, PReLU, padding, ReLU-like
activations, bilinear upsampling, the decomposed SDPA patterns, concatenations of more than five
tensors, max-pooling's and ``max.dim``'s indices, clones, dim-order copies, dtype copies); where
the partition, as the passes before left it, holds none of them, such a pass would leave the graph
as it is, so it is left out. The others run as ExecuTorch runs them, in its order, and the
program's bytes are the same (a test compares them).

ExecuTorch has no public option for this: ``XnnpackBackend.preprocess`` builds its
``XNNPACKPassManager`` with every pass. ``only_the_passes_that_apply`` swaps in a pass manager
whose ``transform`` is XNNPACK's loop with that question asked before each pass, for the duration
of one lowering.
"""

from __future__ import annotations

import contextlib

from executorch.backends.xnnpack import _passes as xnnpack_passes
from executorch.backends.xnnpack import xnnpack_preprocess
from executorch.backends.xnnpack._passes.xnnpack_pass import XNNPACKPass
from executorch.exir.dialects._ops import ops as exir_ops
from executorch.exir.passes.dim_order_ops_registry import MemoryFormatOpsMap
from executorch.exir.program._program import _transform

_aten = exir_ops.edge.aten

# Pass -> the operators it rewrites: a partition without any of them is left as it was.
# RemoveCloneOpsTransform, DimOrderOpsRevertPass and RemoveRedundantCopyPass rewrite only those nodes.
# ConvertToSDPAPass matches subgraphs each of which holds ``any.dim`` (the test checks every pattern).
PASS_NEEDS = {
    xnnpack_passes.ConvertToUpsampleBilinear2d: {_aten.upsample_bilinear2d.vec},
    xnnpack_passes.ConvertToSDPAPass: {_aten.any.dim},
    xnnpack_passes.FuseBatchNormPass: {_aten.native_batch_norm.default, _aten._native_batch_norm_legit_no_training.default},
    xnnpack_passes.DecomposeBatchNorm: {_aten.native_batch_norm.default, _aten._native_batch_norm_legit_no_training.default},
    xnnpack_passes.FuseActivationPass: {_aten.relu.default, _aten.hardtanh.default},
    xnnpack_passes.InsertPadQDQPass: {_aten.constant_pad_nd.default},
    xnnpack_passes.Conv1dUnsqueezePass: {_aten.convolution.default},
    xnnpack_passes.PReLUReshapePass: {_aten._prelu_kernel.default},
    xnnpack_passes.DecomposeConcatenate: {_aten.cat.default},
    xnnpack_passes.RemoveGetItemPass: {_aten.max_pool2d_with_indices.default, _aten.max.dim},
    xnnpack_passes.XNNPACKRemoveCloneOpsTransform: set(xnnpack_passes.XNNPACKRemoveCloneOpsTransform.clone_ops),
    xnnpack_passes.DimOrderOpsRevertPass: set(MemoryFormatOpsMap),
    xnnpack_passes.RemoveRedundantCopyPass: {_aten._to_copy.default},
}


def applies(pass_, graph) -> bool:
    """Whether ``graph`` holds an operator ``pass_`` rewrites (every pass not in ``PASS_NEEDS`` does)."""
    return pass_ not in PASS_NEEDS or any(node.op == "call_function" and node.target in PASS_NEEDS[pass_] for node in graph.nodes)


class _PassManagerOfPassesThatApply(xnnpack_passes.XNNPACKPassManager):
    def transform(self):
        """``XNNPACKPassManager.transform``, a pass run only where it ``applies`` to the partition as
        the passes before it left it (the loop is XNNPACK's; it has no hook for this)."""
        program = self.exported_program
        for pass_ in self.passes:
            if applies(pass_, program.graph):
                program = _transform(program, pass_(program) if issubclass(pass_, XNNPACKPass) else pass_())
        return program


@contextlib.contextmanager
def only_the_passes_that_apply():
    """XNNPACK's preprocess, within the block, runs on each partition only the passes that can change it."""
    original = xnnpack_preprocess.XNNPACKPassManager
    xnnpack_preprocess.XNNPACKPassManager = _PassManagerOfPassesThatApply
    try:
        yield
    finally:
        xnnpack_preprocess.XNNPACKPassManager = original
