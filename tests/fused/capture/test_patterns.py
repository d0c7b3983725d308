"""Graph rewrites before fusion: an operator chain becomes the one kernel it computes."""

from __future__ import annotations

import math

import torch
from torch import nn

from plait.fused.capture.patterns import simplify
from tests.fused.helpers import rel_err


class WrittenOutGelu(nn.Module):
    """GELU with the tanh approximation as transformers' `NewGELUActivation` writes it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        inner = math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))
        return 0.5 * x * (1.0 + torch.tanh(inner))


def test_gelu_tanh_chain_becomes_one_kernel() -> None:
    x = torch.randn(4, 7)
    ep = torch.export.export(WrittenOutGelu(), (x,), strict=False)
    module = ep.graph_module
    assert simplify(module) == 1
    ops = [n.target for n in module.graph.nodes if n.op == "call_function"]
    assert ops == [torch.ops.aten.gelu.default]
    # the kernel computes the same function to float rounding
    assert rel_err(ep.module()(x), WrittenOutGelu()(x)) <= 1e-6
    assert simplify(module) == 0  # nothing left to replace
