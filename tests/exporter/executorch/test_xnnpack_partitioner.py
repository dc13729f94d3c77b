"""kvexport's XNNPACK partitioner: what it delegates."""

from __future__ import annotations

import torch

from kvexport.exporter.executorch.xnnpack_partitioner import xnnpack_partitioner


class _LinearThenBatchMatmul(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(64, 32)

    def forward(self, x):
        y = self.linear(x)  # [2, 4, 32]
        return torch.bmm(y, y.transpose(1, 2))


def _calls(bfloat16: bool) -> list[str]:
    from executorch.exir import to_edge_transform_and_lower

    model = _LinearThenBatchMatmul().to(torch.bfloat16).eval()
    program = torch.export.export(model, (torch.randn(2, 4, 64, dtype=torch.bfloat16),))
    edge = to_edge_transform_and_lower(program, partitioner=[xnnpack_partitioner(bfloat16=bfloat16)])
    return [str(n.target) for n in edge.exported_program().graph.nodes if n.op == "call_function"]


def test_bfloat16_linear_layers_are_delegated_and_nothing_else():
    """With ``bfloat16`` a bfloat16 linear layer runs in XNNPACK; a bfloat16 batch matmul, which
    XNNPACK fails to build when the program loads, stays with ExecuTorch's portable kernels, as
    every bfloat16 op does without it."""
    portable, delegated = _calls(bfloat16=False), _calls(bfloat16=True)
    assert not any("executorch_call_delegate" in c for c in portable), portable
    assert any("linear" in c or "addmm" in c for c in portable), portable
    assert any("executorch_call_delegate" in c for c in delegated), delegated
    assert not any("linear" in c or "addmm" in c for c in delegated), delegated
    assert any("bmm" in c for c in delegated), delegated
