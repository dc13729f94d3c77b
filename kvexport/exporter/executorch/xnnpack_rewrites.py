"""Equivalent rewrites that keep XNNPACK's delegate whole when the token count is dynamic.

Left alone, three patterns in every decoder layer fall outside the delegate, splitting each layer
into several delegate calls with portable ops between them (slower to run and to lower):

- a reshape whose target shape names the symbolic token count (XNNPACK's reshape takes ``-1`` for
  the one inferred dim, not a symbol; where the shape infers another dim too, as attention's
  ``view(1, T, -1, head_dim)`` does, that dim is computed first);
- RMSNorm's mean over the last dim of a 3-D tensor, or of a 4-D one for per-head norms (XNNPACK
  averages the two innermost dims of a 4-D tensor only);
- rotary embeddings' ``rotate_half`` (slices along the head dim, which XNNPACK refuses on tensors
  with a dynamic dim).

Each rewrite computes the same values; ``rotate_half`` as a product with a signed permutation
matrix is exact (every output is one input times ±1 plus zeros).

``partitioner_configs`` leaves out of the delegate what XNNPACK gets wrong (see there).
"""

from __future__ import annotations

import contextlib
import math
import sys

import torch
from executorch.exir.dialects._ops import ops as exir_ops
from executorch.exir.pass_base import ExportPass

from ...models.architecture import layer_specs, text_config

_VIEW = exir_ops.edge.aten.view_copy.default
_MEAN = exir_ops.edge.aten.mean.dim


def partitioner_configs() -> list:
    """XNNPACK's partitioner configs, without ``max.dim``.

    XNNPACK lowers ``max(dim=-1).values`` over a dynamic dim to a max-pooling, and a softmax that
    reads ``x - max`` then comes out wrong (ExecuTorch 1.5.1; docs/executorch.md): that
    is how attention sinks (GPT-OSS) stabilise their softmax. ExecuTorch's portable kernel for it
    is exact, and no other family uses it.
    """
    from executorch.backends.xnnpack.partition.config import ALL_PARTITIONER_CONFIGS, MaxDimConfig

    return [config for config in ALL_PARTITIONER_CONFIGS if config is not MaxDimConfig]


class XnnpackFriendlyShapes(ExportPass):
    """Edge-dialect pass: symbolic reshapes use ``-1``; last-dim means become means over a 4-D tensor's two innermost dims."""

    def call_operator(self, op, args, kwargs, meta):
        if op == _VIEW:
            shape = list(args[1])
            symbolic = [i for i, d in enumerate(shape) if not isinstance(d, int)]
            if len(symbolic) == 1 and -1 in shape:  # e.g. attention's view(1, T, -1, head_dim)
                shape[shape.index(-1)] = self._inferred_dim(args[0].to_tensor().shape, shape, shape[symbolic[0]])
            if len(symbolic) == 1 and -1 not in shape:
                shape[symbolic[0]] = -1
                return super().call_operator(op, (args[0], shape), kwargs, meta)
        if op == _MEAN and self._is_last_dim_mean(args, kwargs):
            x = args[0]
            batch, *middle, dim = x.to_tensor().shape
            as_4d = super().call_operator(_VIEW, (x, [batch, -1, dim, 1]), {}, meta)
            mean = super().call_operator(_MEAN, (as_4d, [2, 3], True), {}, meta)
            back = [batch, *(d if isinstance(d, int) else -1 for d in middle), 1]
            return super().call_operator(_VIEW, (mean, back), {}, meta)
        return super().call_operator(op, args, kwargs, meta)

    @staticmethod
    def _inferred_dim(source_shape, shape: list, token_dim) -> int:
        """The value of ``shape``'s ``-1`` where the one symbolic dim of the source and of ``shape`` is
        the same (the static dims then account for the rest); ``-1`` otherwise."""
        source_symbolic = [d for d in source_shape if not isinstance(d, int)]
        token_dim = getattr(token_dim, "data", token_dim)  # a ProxyValue's SymInt
        if len(source_symbolic) != 1 or str(source_symbolic[0]) != str(token_dim):
            return -1
        source_static = math.prod(d for d in source_shape if isinstance(d, int))
        target_static = math.prod(d for d in shape if isinstance(d, int) and d != -1)
        return source_static // target_static if target_static and source_static % target_static == 0 else -1

    @staticmethod
    def _is_last_dim_mean(args, kwargs) -> bool:
        """A keepdim mean over the last dim of a 3-D tensor (RMSNorm's) or a 4-D one (per-head q/k
        norms: Gemma 3, Qwen 3) whose dims are static but one of the middle ones."""
        x = args[0].to_tensor()
        dims = list(args[1]) if len(args) > 1 and args[1] is not None else []
        keepdim = len(args) > 2 and bool(args[2])
        batch, *middle, last = x.shape if x.dim() in (3, 4) else (None, None)
        return (
            dims in ([-1], [x.dim() - 1])
            and keepdim
            and kwargs.get("dtype") is None
            and isinstance(batch, int)
            and isinstance(last, int)
            and sum(not isinstance(d, int) for d in middle) <= 1
        )


def _rotation(rotate_half, dim: int, dtype: torch.dtype) -> torch.Tensor | None:
    """W with ``linear(x, W) == rotate_half(x)``, read off the family's own ``rotate_half``.

    Families rotate differently (Llama pairs the two halves, Cohere interleaves even and odd
    dims), so the matrix is what the function does to each basis vector. None where that is not a
    signed permutation (the function is not the linear map it should be): no rewrite then.
    """
    rows = rotate_half(torch.eye(dim, dtype=torch.float64))  # row i: rotate_half(e_i)
    nonzero = rows != 0
    signed_permutation = (
        rows.shape == (dim, dim)
        and bool(torch.all(rows.abs()[nonzero] == 1))
        and bool(torch.all(nonzero.sum(dim=0) == 1))
        and bool(torch.all(nonzero.sum(dim=1) == 1))
    )
    return rows.T.to(dtype).contiguous() if signed_permutation else None


@contextlib.contextmanager
def rotary_as_matmul(model: torch.nn.Module):
    """While tracing, the model's modeling file computes ``rotate_half`` as a matrix product.

    The matrices are built before tracing, one per rotary width the config implies (every attention
    layer's head size, and its rotated part where the config rotates part of it); an unexpected width
    falls back to the original function.
    """
    module = sys.modules[type(model).__module__]
    original = getattr(module, "rotate_half", None)
    if original is None:
        yield
        return
    config = text_config(model.config)
    dtype = next(model.parameters()).dtype
    head_dims = {spec.head_dim for spec in layer_specs(config) if spec.has_kv}  # each layer's own (Gemma 4)
    partial = getattr(config, "partial_rotary_factor", 1.0)
    widths = head_dims | {int(d * partial) for d in head_dims}
    # Registered as buffers and read back through the model at call time, so the program holds them
    # as the model's constants (a tensor captured from elsewhere becomes a lifted constant, which
    # XNNPACK's lowering does not take).
    rotations = {w: _rotation(original, w, dtype) for w in widths if w % 2 == 0}
    names = {w: f"_kvexport_rotation_{w}" for w, r in rotations.items() if r is not None}
    for width, name in names.items():
        model.register_buffer(name, rotations[width], persistent=False)

    def rotate_half(x: torch.Tensor) -> torch.Tensor:
        name = names.get(x.shape[-1])
        if name is None or x.dtype != dtype:
            return original(x)
        # 2-D for the product: a 4-D input would make linear broadcast the weight (an expand).
        return torch.nn.functional.linear(x.reshape(-1, x.shape[-1]), getattr(model, name)).view(x.shape)

    module.rotate_half = rotate_half
    try:
        yield
    finally:
        module.rotate_half = original
        for name in names.values():
            delattr(model, name)
