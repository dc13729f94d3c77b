"""XNNPACK's own graph passes, run only where they can change the graph.

XNNPACK's ``preprocess`` runs its 17 passes on every delegated partition, and each pass ends by
retracing the partition with fake tensors and symbolic shapes, whether it rewrote anything or
not: a large share of an export's time goes there (docs/performance.md). Ten of the passes
rewrite only nodes of a few operators (batch norm, convolution, PReLU, padding, ReLU-like
activations, bilinear upsampling, the decomposed SDPA patterns, concatenations of more than five
tensors, max-pooling's and ``max.dim``'s indices), and no pass before them in XNNPACK's order
makes those operators; on a partition that holds none of them such a pass leaves the graph as it
was, so it is left out there. The remaining passes run as ExecuTorch runs them, in its order, and
the program's bytes are the same (a test compares them).

ExecuTorch has no public option for this: ``XnnpackBackend.preprocess`` builds its
``XNNPACKPassManager`` with every pass. ``only_the_passes_that_apply`` swaps in a pass manager that
filters its list for the duration of one lowering.
"""

from __future__ import annotations

import contextlib

from executorch.backends.xnnpack import _passes as xnnpack_passes
from executorch.backends.xnnpack import xnnpack_preprocess
from executorch.exir.dialects._ops import ops as exir_ops

_aten = exir_ops.edge.aten

# Pass -> the operators it rewrites: a partition without any of them is left as it was.
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
}


def passes_that_apply(passes: list, graph) -> list:
    """``passes`` without those whose operators ``graph`` does not hold."""
    present = {node.target for node in graph.nodes if node.op == "call_function"}
    return [p for p in passes if p not in PASS_NEEDS or PASS_NEEDS[p] & present]


class _PassManagerOfPassesThatApply(xnnpack_passes.XNNPACKPassManager):
    def __init__(self, exported_program, passes=None):
        super().__init__(exported_program, passes)
        self.passes = passes_that_apply(self.passes, exported_program.graph)


@contextlib.contextmanager
def only_the_passes_that_apply():
    """XNNPACK's preprocess, within the block, runs on each partition only the passes that can change it."""
    original = xnnpack_preprocess.XNNPACKPassManager
    xnnpack_preprocess.XNNPACKPassManager = _PassManagerOfPassesThatApply
    try:
        yield
    finally:
        xnnpack_preprocess.XNNPACKPassManager = original
