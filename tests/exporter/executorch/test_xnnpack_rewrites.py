"""The ExecuTorch target's XNNPACK rewrites compute what the model computes."""

from __future__ import annotations

import pytest
import torch

from kvexport.exporter.executorch.xnnpack_rewrites import _rotation, partitioner_configs


@pytest.mark.parametrize("family", ["llama", "cohere", "gemma3"])
def test_rotation_matrix_is_the_familys_own_rotate_half(family):
    """Llama-style families rotate the two halves; Cohere interleaves even and odd dims."""
    import importlib

    rotate_half = importlib.import_module(f"transformers.models.{family}.modeling_{family}").rotate_half
    weight = _rotation(rotate_half, 16, torch.float32)
    x = torch.randn(5, 16)
    assert torch.equal(torch.nn.functional.linear(x, weight), rotate_half(x))


def test_a_rotate_half_that_is_not_a_signed_permutation_is_left_alone():
    assert _rotation(lambda x: 0.5 * x, 8, torch.float32) is None


def test_softmax_after_a_max_shift_over_a_dynamic_dim_is_exact():
    """Attention sinks (GPT-OSS) shift logits by their max before the softmax; XNNPACK's max.dim gets
    that wrong over a dynamic dim, so the target keeps max.dim out of the delegate."""
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import EdgeCompileConfig, to_edge_transform_and_lower
    from executorch.runtime import Runtime

    class ShiftedSoftmax(torch.nn.Module):
        def forward(self, x):
            return torch.softmax(x - x.max(dim=-1, keepdim=True).values, dim=-1)

    keys = torch.export.Dim("keys", min=2, max=64)
    program = torch.export.export(ShiftedSoftmax(), (torch.randn(1, 4, 3, 10),), dynamic_shapes=({3: keys},))
    edge = to_edge_transform_and_lower(
        program,
        partitioner=[XnnpackPartitioner(configs=partitioner_configs())],
        compile_config=EdgeCompileConfig(_check_ir_validity=False),
    )
    buffer = edge.to_executorch().buffer  # the runtime reads the program from these: keep them alive
    loaded = Runtime.get().load_program(buffer)
    method = loaded.load_method("forward")
    for n in (3, 10, 40):
        x = torch.randn(1, 4, 3, n)
        torch.testing.assert_close(method.execute([x])[0], ShiftedSoftmax()(x), atol=1e-6, rtol=0)


def _with_and_without_rewrites(module: torch.nn.Module, example: torch.Tensor):
    """``module`` exported with a dynamic dim 1 and lowered to XNNPACK without kvexport's
    ``XnnpackFriendlyShapes`` and with it: (edge program without, edge program with)."""
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import EdgeCompileConfig, to_edge_transform_and_lower

    from kvexport.exporter.executorch.xnnpack_rewrites import XnnpackFriendlyShapes

    tokens = torch.export.Dim("tokens", min=1, max=64)
    program = torch.export.export(module, (example,), dynamic_shapes=({1: tokens},))
    return tuple(
        to_edge_transform_and_lower(
            program,
            transform_passes=passes,
            partitioner=[XnnpackPartitioner(configs=partitioner_configs())],
            compile_config=EdgeCompileConfig(_check_ir_validity=False),
        )
        for passes in ([], [XnnpackFriendlyShapes()])
    )


def _ops_outside(edge, name: str) -> int:
    return sum(name in str(n.target) for n in edge.exported_program().graph.nodes)


def _assert_runs_as_eager(edge, module: torch.nn.Module, rest_of_shape: tuple, tolerance: float) -> None:
    """The lowered program computes what ``module`` computes at several lengths of dim 1."""
    from executorch.runtime import Runtime

    buffer = edge.to_executorch().buffer  # the runtime reads the program from these: keep them alive
    method = Runtime.get().load_program(buffer).load_method("forward")
    for n in (1, 7, 64):
        x = torch.randn(1, n, *rest_of_shape)
        torch.testing.assert_close(method.execute([x])[0], module(x), atol=tolerance, rtol=tolerance)


def test_a_reshape_that_infers_a_dim_beside_the_token_count_stays_in_the_delegate():
    """Attention splits heads with ``view(1, T, -1, head_dim)``: a symbolic dim and an inferred one,
    which XNNPACK's reshape refuses. The rewrite computes the inferred dim, so both reshapes join
    the delegate, and it computes what the module computes at every length."""

    class SplitHeads(torch.nn.Module):
        def forward(self, x):
            return (x.view(1, x.shape[1], -1, 16) * 2).view(1, x.shape[1], -1)

    without, with_rewrites = _with_and_without_rewrites(SplitHeads(), torch.randn(1, 5, 64))
    assert _ops_outside(without, "view_copy") == 2
    assert _ops_outside(with_rewrites, "view_copy") == 0
    _assert_runs_as_eager(with_rewrites, SplitHeads(), (64,), tolerance=0)


@pytest.mark.parametrize("shape", [(1, 5, 64), (1, 5, 4, 16)], ids=["rms-norm", "per-head-norm"])
def test_a_last_dim_mean_joins_the_delegate(shape):
    """RMSNorm's ``x.pow(2).mean(-1, keepdim=True)``, over the hidden dim ([1, T, hidden]) or per
    head (Gemma 3's and Qwen 3's q/k norms, [1, T, heads, head_dim]): XNNPACK averages a 4-D tensor's
    two innermost dims only, so the rewrite reads the mean that way; left alone, it runs outside
    the delegate and splits it. The lowered program computes what the module computes at every length."""

    class Norm(torch.nn.Module):
        def forward(self, x):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)

    without, with_rewrites = _with_and_without_rewrites(Norm(), torch.randn(*shape))
    assert _ops_outside(without, "mean") == 1
    assert _ops_outside(with_rewrites, "mean") == 0
    _assert_runs_as_eager(with_rewrites, Norm(), shape[2:], tolerance=1e-5)
