"""Fused Linear: B matrix products as one batched matmul."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Self

import torch
import torch.nn.functional as F
from torch import nn

from plait.fused.ops.base import FusedModule, check_same, is_shared, stack_parameter


class _BatchedLinear(torch.autograd.Function):
    """y[b] = x[b] @ w[b]^T + bias[b] with a hand-written backward.

    Autograd's own backward of `baddbmm(bias, x, w.transpose(1, 2))` returns the weight
    gradient as a transposed view, which accumulating into the contiguous parameter
    copies, and reduces the bias gradient through expand/unsqueeze steps; here each
    gradient is one kernel in the parameter's own layout.
    """

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        w = weight.transpose(1, 2)
        return torch.bmm(x, w) if bias is None else torch.baddbmm(bias.unsqueeze(1), x, w)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(
        ctx: Any, grad: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        x, weight = ctx.saved_tensors
        gx = torch.bmm(grad, weight) if ctx.needs_input_grad[0] else None
        gw = torch.bmm(grad.transpose(1, 2), x) if ctx.needs_input_grad[1] else None
        gb = grad.sum(1) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return gx, gw, gb


def batched_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """[B, M, in] x [B, out, in] (+ [B, out]) -> [B, M, out]."""
    out: torch.Tensor = _BatchedLinear.apply(x, weight, bias)
    return out


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """B models' `F.linear`: [B, ..., in] x [B, out, in] (+ [B, out]) -> [B, ..., out].

    An input shared by all models (stride 0 on B) takes one matmul against all B weight
    matrices; otherwise one batched matmul adds each model's bias as it goes.
    """
    b, out_features, in_features = weight.shape
    if is_shared(x):
        flat_bias = None if bias is None else bias.flatten()
        y = F.linear(x[0], weight.flatten(0, 1), flat_bias)
        shared: torch.Tensor = y.unflatten(-1, (b, out_features)).movedim(-2, 0)
        return shared
    y = batched_linear(x.reshape(b, -1, in_features), weight, bias)
    return y.view(*x.shape[:-1], out_features)


class _BatchedAddmm(torch.autograd.Function):
    """y[b] = bias[b] + x[b] @ w[b] for weights stored [in, out] (transformers' Conv1D).

    As `_BatchedLinear`, each gradient comes out as one kernel in its parameter's own
    layout: autograd's backward of `baddbmm` would hand the [B, in, out] weight a
    transposed product to copy.
    """

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return torch.bmm(x, weight) if bias is None else torch.baddbmm(bias.unsqueeze(1), x, weight)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(
        ctx: Any, grad: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        x, weight = ctx.saved_tensors
        gx = torch.bmm(grad, weight.transpose(1, 2)) if ctx.needs_input_grad[0] else None
        gw = torch.bmm(x.transpose(1, 2), grad) if ctx.needs_input_grad[1] else None
        gb = grad.sum(1) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return gx, gw, gb


def addmm(bias: torch.Tensor | None, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """B models' `bias + x @ weight` with weight [B, in, out] and bias [B, out]:
    [B, ..., in] -> [B, ..., out]."""
    b, in_features, out_features = weight.shape
    if bias is not None and bias.dim() == 1:  # one bias for all models
        bias = bias.expand(b, out_features)
    y: torch.Tensor = _BatchedAddmm.apply(x.reshape(b, -1, in_features), weight, bias)
    return y.view(*x.shape[:-1], out_features)


class FusedLinear(FusedModule):
    """B `nn.Linear` layers: weight [B, out, in], bias [B, out]; input [B, ..., in].

    One `baddbmm` computes every model's product and adds its bias, so the kernel count
    is that of a single model whatever B is.
    """

    stock_types = (nn.Linear,)

    def __init__(self, *, weight: nn.Parameter, bias: nn.Parameter | None) -> None:
        super().__init__(num_models=int(weight.shape[0]))
        self.in_features = int(weight.shape[2])
        self.out_features = int(weight.shape[1])
        self.weight = weight
        self.bias = bias

    @classmethod
    def from_modules(cls, modules: Sequence[nn.Module]) -> Self:
        check_same(modules, ["in_features", "out_features"])
        if (modules[0].bias is None) != any(m.bias is None for m in modules):
            raise ValueError("some Linear layers have a bias and others not")
        weight = stack_parameter(modules, "weight")
        assert weight is not None
        return cls(weight=weight, bias=stack_parameter(modules, "bias"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return (
            f"models={self.weight.shape[0]}, in_features={self.in_features}, "
            f"out_features={self.out_features}, bias={self.bias is not None}"
        )
