"""Quantized projections that read one input run as one matmul while tracing (ExecuTorch 8da4w).

A decoder layer multiplies the same hidden state by q, k and v, and the MLP's input by gate and
up. XNNPACK runs each quantized linear layer as several operators (the int8 activations'
quantization, the matmul and, for ``Int4GridLinear``, its block offsets), and at 4-bit decode a
step's time goes as much to the number of operators as to their arithmetic. Stacking a group's
weights by rows computes the same dot products with one set of operators; the result is split
back into the group's outputs (outside the delegate: XNNPACK takes no slice of a tensor with a
dynamic dim). Float weights are left alone: their decode is bound by reading them, so stacking
gains nothing there, and it would copy weights the model maps from its file (one more copy at the
export's peak; docs/performance.md).

The modeling code still calls ``q_proj``, ``k_proj`` and ``v_proj``: each is replaced by a view
of the group that returns its own part of the stacked product, computed once per input. A member
called on another input (no family here does) gets the stacked product of that input: correct,
only slower.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

# Sibling linear layers that the families kvexport supports call on one input.
GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class StackedLinear(nn.Module):
    """The group's layers as one, and the last input's product split into their outputs."""

    def __init__(self, linear: nn.Module, sizes: list[int]):
        super().__init__()
        self.linear = linear
        self.sizes = sizes

    def parts(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        last = _LAST.get(self)
        if last is None or last[0] is not x:
            last = _LAST[self] = (x, self.linear(x).split(self.sizes, dim=-1))
        return last[1]


# Each stack's last input and its parts. Kept off the modules: torch.export takes a tensor attribute
# set while tracing for state the program should carry (and warns).
_LAST: dict[StackedLinear, tuple] = {}


class StackedMember(nn.Module):
    """Stands in for one layer of the group: its part of the stacked product."""

    def __init__(self, stack: StackedLinear, index: int):
        super().__init__()
        object.__setattr__(self, "stack", stack)  # not a submodule: the parent owns the stack
        self.index = index

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.stack.parts(x)[self.index]


def stack_rows(layers: list[nn.Module]) -> nn.Module | None:
    """One layer computing the quantized ``layers``' outputs side by side, or None where they are
    float or their kinds differ. Each layer's weights become views of its rows of the stack, so the
    model holds every weight once."""
    from .quantize import Int4GridLinear

    first = layers[0]
    if any(type(layer) is not type(first) for layer in layers) or type(first) not in (nn.Linear, Int4GridLinear):
        return None
    if not isinstance(first, Int4GridLinear) and _kind(first.weight) is None:
        return None  # float weights (see the module's docstring)
    if len({layer.bias is None for layer in layers}) > 1 or len({_kind(layer.weight) for layer in layers}) > 1:
        return None
    if _kind(first.weight) is not None and first.weight.block_size[0] != 1:
        return None  # blocks spanning rows: stacking would regroup them
    names = ["weight", *(["offset"] if isinstance(first, Int4GridLinear) else []), *([] if first.bias is None else ["bias"])]
    stacked = {name: _share_rows(layers, name) for name in names}
    bias = stacked.get("bias")
    if isinstance(first, Int4GridLinear):
        return Int4GridLinear(stacked["weight"], stacked["offset"], bias)
    linear = nn.Linear(first.in_features, stacked["weight"].shape[0], bias=False, device="meta")
    linear.weight = nn.Parameter(stacked["weight"], requires_grad=False)
    linear.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
    return linear


def _kind(tensor: torch.Tensor):
    """None for a plain tensor; for torchao's int8/int4 tensor, what must match to stack it with another."""
    from torchao.quantization import IntxUnpackedToInt8Tensor

    if not isinstance(tensor, IntxUnpackedToInt8Tensor):
        return None
    return (tensor.target_dtype, tuple(tensor.block_size), tensor.dtype, tensor.activation_quantization)


def _share_rows(layers: list[nn.Module], name: str) -> torch.Tensor:
    """The layers' ``name`` tensors stacked by rows; each layer's ``name`` becomes a view of its rows."""
    tensors = [getattr(layer, name) for layer in layers]
    kind = _kind(tensors[0])
    stacked = [torch.cat(parts) for parts in zip(*(_parts(t) for t in tensors))]
    start = 0
    for layer, tensor in zip(layers, tensors):
        rows = [part[start : start + tensor.shape[0]] for part in stacked]
        setattr(layer, name, nn.Parameter(_assemble(kind, rows), requires_grad=False))
        start += tensor.shape[0]
    return _assemble(kind, stacked)


def _parts(tensor: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors a weight is made of, each with one row per output channel."""
    return [tensor.detach()] if _kind(tensor) is None else [tensor.qdata, tensor.scale, tensor.zero_point]


def _assemble(kind, parts: list[torch.Tensor]) -> torch.Tensor:
    if kind is None:
        return parts[0]
    from torchao.quantization import IntxUnpackedToInt8Tensor

    target_dtype, block_size, dtype, activations = kind
    return IntxUnpackedToInt8Tensor(qdata=parts[0], scale=parts[1], zero_point=parts[2], target_dtype=target_dtype,
                                    block_size=block_size, dtype=dtype, activation_quantization=activations)


@contextlib.contextmanager
def stacked_projections(model: nn.Module):
    """While tracing, every group of ``GROUPS`` a module has runs as one ``StackedLinear``; the
    model's own layers are put back after."""
    replaced: list[tuple[nn.Module, str, nn.Module]] = []  # (parent, name, what was there: None for a stack)
    for parent in list(model.modules()):
        for names in GROUPS:
            layers = [getattr(parent, name, None) for name in names]
            stacked = None if any(layer is None for layer in layers) else stack_rows(layers)
            if stacked is None:
                continue
            stack = StackedLinear(stacked, [layer.weight.shape[0] for layer in layers])
            replaced.append((parent, f"_kvexport_{'_'.join(names)}", None))
            parent.add_module(replaced[-1][1], stack)
            for index, (name, layer) in enumerate(zip(names, layers)):
                replaced.append((parent, name, layer))
                setattr(parent, name, StackedMember(stack, index))
    try:
        yield
    finally:
        for parent, name, layer in reversed(replaced):
            if layer is None:
                _LAST.pop(parent._modules.pop(name), None)
            else:
                setattr(parent, name, layer)
