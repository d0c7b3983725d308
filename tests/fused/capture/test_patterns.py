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


class WrittenOutRMSNorm(nn.Module):
    """RMSNorm as transformers' `LlamaRMSNorm` writes it (float32 round trip included)."""

    def __init__(self, width: int, *, reuse_variance: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.rand(width) + 0.5)
        self.reuse_variance = reuse_variance

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to(torch.float32)
        variance = h.pow(2).mean(-1, keepdim=True)
        h = h * torch.rsqrt(variance + 1e-6)
        out = self.weight * h.to(dtype)
        return out + variance if self.reuse_variance else out


def test_rms_norm_chain_becomes_one_operator() -> None:
    x = torch.randn(4, 3, 8)
    model = WrittenOutRMSNorm(8)
    ep = torch.export.export(model, (x,), strict=False)
    module = ep.graph_module
    assert simplify(module) == 1
    ops = [n.target for n in module.graph.nodes if n.op == "call_function"]
    assert torch.ops.aten.rms_norm.default in ops
    assert not {torch.ops.aten.pow.Tensor_Scalar, torch.ops.aten.rsqrt.default} & set(ops)
    assert rel_err(ep.module()(x), model(x)) <= 1e-6
    assert simplify(module) == 0


def test_rms_norm_chain_whose_pieces_are_reused_is_left_alone() -> None:
    """The variance feeds something else too: replacing the chain would drop it."""
    x = torch.randn(4, 3, 8)
    model = WrittenOutRMSNorm(8, reuse_variance=True)
    ep = torch.export.export(model, (x,), strict=False)
    assert simplify(ep.graph_module) == 0
    assert rel_err(ep.module()(x), model(x)) <= 1e-6
