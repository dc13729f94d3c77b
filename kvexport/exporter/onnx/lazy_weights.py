"""A graph's weights read from the checkpoint as the file is written (``models/deferred_weights``).

torch.onnx exports the traced program's weights as initializers holding the model's tensors; for
a model loaded with deferred weights those are placeholders. Before the graph is optimized, each
placeholder initializer is given an ``onnx_ir.LazyTensor`` that reads the weight from the
checkpoint when its bytes are wanted, one weight at a time, so the export holds no weight for
longer than it takes to write it. onnxscript's optimizer folds the transpose of a linear weight
into a new initializer (``Transpose`` is always folded, whatever its size); while it runs, a fold
of a lazy weight is lazy too, the same name and values as the fold it stands for, so the written
bytes are those of an export from the loaded model.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from ...errors import KvexportError
from ...models.deferred_weights import CheckpointTensor, DeferredWeights
from ...progress import report


class _Count:
    """The lazy initializers read so far (a few are read twice as the file is written), on the
    running step's status line (``progress.report``)."""

    def __init__(self, total: int):
        self.total, self.read = total, set()

    def one_more(self, initializer) -> None:
        if initializer not in self.read:
            self.read.add(initializer)
            report(f"{len(self.read):,} of {self.total:,} weights read from the checkpoint")


@dataclass(frozen=True)
class _Read:
    """A lazy initializer's values: the checkpoint's weight, transposed by ``perm`` if given."""

    weights: DeferredWeights
    entry: CheckpointTensor
    perm: tuple[int, ...] | None = None
    count: _Count | None = None

    def __call__(self):
        import numpy as np
        import onnx_ir as ir

        if self.count is not None:
            self.count.one_more((self.entry.key, self.perm))
        values = _as_numpy(self.weights.read(self.entry))
        if self.perm is not None:
            values = np.ascontiguousarray(np.transpose(values, self.perm))
        return ir.Tensor(values)


def _as_numpy(tensor):
    """numpy has no bfloat16: such a tensor's bits are viewed as ml_dtypes' (which onnx_ir writes)."""
    import torch

    if tensor.dtype == torch.bfloat16:
        import ml_dtypes

        return tensor.view(torch.uint16).numpy().view(ml_dtypes.bfloat16)
    return tensor.numpy()


def read_weights_when_written(model, weights: DeferredWeights) -> int:
    """Give each initializer of ``model`` (an ``onnx_ir.Model``) that holds a placeholder a lazy
    read of its weight; return how many. Every placeholder of the model must be one."""
    import onnx_ir as ir

    placeholders = {value: entry for value in model.graph.initializers.values()
                    if (entry := _placeholder_of(value, weights)) is not None}
    count = _Count(len(placeholders))
    for value, entry in placeholders.items():
        tensor = value.const_value
        value.const_value = ir.LazyTensor(_Read(weights, entry, count=count), tensor.dtype, tensor.shape, name=tensor.name)
    return len(placeholders)


def check_no_placeholder_left(model, weights: DeferredWeights) -> None:
    """Refuse a graph that would write a placeholder's memory: an initializer computed from one
    before it was made lazy."""
    for value in model.graph.initializers.values():
        if _placeholder_of(value, weights) is not None:
            raise KvexportError(
                f"the ONNX graph's initializer {value.name} still holds a weight that was never read from the "
                "checkpoint; please report it"
            )


def _placeholder_of(value, weights: DeferredWeights) -> CheckpointTensor | None:
    """Where an initializer's values are, if it holds a placeholder (a torch tensor torch.onnx wrapped)."""
    raw = getattr(value.const_value, "raw", None)
    return weights.source_of(raw) if hasattr(raw, "data_ptr") else None


@contextlib.contextmanager
def lazy_transposes():
    """While onnxscript's optimizer runs: the transpose of a lazy weight with no other use folds into
    a lazy initializer (where the optimizer would compute it and hold it in memory)."""
    from onnxscript.optimizer import _constant_folding as folding

    key = ("", "Transpose")
    evaluators = folding.registry.op_evaluators
    before = evaluators.get(key)
    evaluators[key] = [folding.PartialEvaluator(None, None, _fold_lazy_transpose), *(before or [])]
    try:
        yield
    finally:
        if before is None:
            evaluators.pop(key)
        else:
            evaluators[key] = before


def _fold_lazy_transpose(node, op, state):
    """The fold onnxscript's constant folding makes of ``Transpose(weight)`` (``new_initializer``:
    an initializer named as the node's output), with the values read when written."""
    import onnx_ir as ir
    from onnxscript.optimizer._constant_folding import Replacement

    weight = node.inputs[0]
    tensor = weight.const_value if weight is not None else None
    if not isinstance(tensor, ir.LazyTensor) or not isinstance(tensor.raw, _Read) or len(weight.consumers()) != 1:
        return None
    rank = len(tensor.shape)
    perm = tuple(node.attributes.get_ints("perm", list(reversed(range(rank)))))
    shape = ir.Shape([tensor.shape[p] for p in perm])
    read = tensor.raw
    if read.perm is not None:  # a transpose of a transpose: one permutation of the stored weight
        perm = tuple(read.perm[p] for p in perm)
    name = node.outputs[0].name
    folded = ir.LazyTensor(_Read(read.weights, read.entry, perm, read.count), tensor.dtype, shape, name=name)
    value = ir.Value(name=name, type=ir.TensorType(tensor.dtype), shape=shape, const_value=folded)
    node.graph.register_initializer(value)
    return Replacement([value], [])
