"""Fused normalisation: batch norm over B*C channels, group norm over B*G groups, layer norm.

Batch statistics stay per model because model b's channels are channel block b of one
[N, B*C, ...] batch-norm call; running statistics are [B, C] buffers viewed as [B*C], so
the kernel's in-place update writes each model's own statistics.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Self

import torch
import torch.nn.functional as F
from torch import nn

from plait.fused import native
from plait.fused.ops.base import (
    FusedModule,
    check_same,
    from_channels,
    model_view,
    stack,
    stack_parameter,
    to_channels,
)


def batch_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    *,
    training: bool,
    momentum: float,
    eps: float,
) -> torch.Tensor:
    """B models' `F.batch_norm` over [B, N, C, ...]: affine and running statistics [B, C].

    The statistics of model b are those of its own channel block; running statistics are
    updated in place through [B*C] views, so each model's own buffers move.
    """
    b = x.shape[0]

    def flat(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.view(-1)

    y = F.batch_norm(
        to_channels(x), flat(running_mean), flat(running_var), flat(weight), flat(bias),
        training, momentum, eps,
    )  # fmt: skip
    return from_channels(y, b)


def layer_norm(
    x: torch.Tensor,
    shape: Sequence[int],
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
) -> torch.Tensor:
    """B models' `F.layer_norm` over [B, ..., *shape] with affine [B, *shape].

    Narrow float32 rows on a CPU take the native kernel (see `FusedLayerNorm`).
    """
    shape = tuple(shape)
    width = math.prod(shape)
    lib = native.layer_norm_kernels(x, width=width, weight=weight, bias=bias)
    if lib is not None:
        return native.layer_norm(x, width=width, weight=weight, bias=bias, eps=eps, lib=lib)
    y = F.layer_norm(x, shape, None, None, eps)
    if weight is None:
        return y if bias is None else y + model_view(bias, x.dim(), len(shape))
    w = model_view(weight, x.dim(), len(shape))
    if bias is None:
        return y * w
    return torch.addcmul(model_view(bias, x.dim(), len(shape)), y, w)


def rms_norm(
    x: torch.Tensor, shape: Sequence[int], weight: torch.Tensor | None, eps: float | None
) -> torch.Tensor:
    """B models' `F.rms_norm` over [B, ..., *shape] with scale [B, *shape].

    Narrow float32 rows on a CPU take the layer-norm kernel without centring: torch's
    CPU RMSNorm is a chain of six operators forward and more backward, 4.5 ms a step in a
    fused Llama of 16 models (measured), which the kernel does in one pass each way.
    """
    shape = tuple(shape)
    width = math.prod(shape)
    eps = torch.finfo(x.dtype).eps if eps is None else float(eps)
    lib = native.layer_norm_kernels(x, width=width, weight=weight, bias=None)
    if lib is not None:
        return native.layer_norm(x, width=width, weight=weight, bias=None, eps=eps, lib=lib,
                                 centred=False)  # fmt: skip
    y = F.rms_norm(x, shape, None, eps)
    return y if weight is None else y * model_view(weight, x.dim(), len(shape))


def group_norm(
    x: torch.Tensor,
    groups: int,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
) -> torch.Tensor:
    """B models' `F.group_norm` over [B, N, C, ...]: B*G groups over B*C channels."""
    b = x.shape[0]
    y = F.group_norm(
        to_channels(x), b * groups,
        None if weight is None else weight.view(-1), None if bias is None else bias.view(-1), eps,
    )  # fmt: skip
    return from_channels(y, b)


class FusedBatchNorm(FusedModule):
    """B `nn.BatchNorm1d/2d/3d` layers; weight, bias, running stats [B, C]."""

    stock_types = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)

    def __init__(self, *, template: nn.Module, modules: Sequence[nn.Module]) -> None:
        super().__init__(num_models=len(modules))
        self.num_features = int(template.num_features)  # type: ignore[arg-type]
        self.eps = float(template.eps)  # type: ignore[arg-type]
        self.momentum: float | None = template.momentum  # type: ignore[assignment]
        self.track_running_stats = bool(template.track_running_stats)
        self.weight = stack_parameter(modules, "weight")
        self.bias = stack_parameter(modules, "bias")
        self.running_mean: torch.Tensor | None
        self.running_var: torch.Tensor | None
        self.num_batches_tracked: torch.Tensor | None
        for name in ("running_mean", "running_var", "num_batches_tracked"):
            self.register_buffer(name, stack(modules, name))

    @classmethod
    def from_modules(cls, modules: Sequence[nn.Module]) -> Self:
        check_same(modules, ["num_features", "eps", "momentum", "affine", "track_running_stats"])
        return cls(template=modules[0], modules=modules)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # cumulative average; every model counts the same batches
                factor = 1.0 / float(self.num_batches_tracked[0])
        use_batch_stats = self.training or self.running_mean is None
        track = not self.training or self.track_running_stats
        return batch_norm(
            x, self.weight, self.bias,
            self.running_mean if track else None, self.running_var if track else None,
            training=use_batch_stats, momentum=factor, eps=self.eps,
        )  # fmt: skip

    def extra_repr(self) -> str:
        return f"models={self.num_models}, num_features={self.num_features}, eps={self.eps}"


class FusedLayerNorm(FusedModule):
    """B `nn.LayerNorm` layers: one normalisation, then each model's affine as [B, 1, ..].

    Narrow float32 rows on a CPU take the native kernel (`plait.fused.native`), which
    does both in one pass: torch's kernel costs about 25 ns per row whatever its width,
    which on 16-wide rows is most of a Transformer layer's normalisation time.
    """

    stock_types = (nn.LayerNorm,)

    def __init__(self, *, template: nn.LayerNorm, modules: Sequence[nn.Module]) -> None:
        super().__init__(num_models=len(modules))
        self.normalized_shape = tuple(template.normalized_shape)
        self.eps = float(template.eps)
        self.weight = stack_parameter(modules, "weight")
        self.bias = stack_parameter(modules, "bias")

    @classmethod
    def from_modules(cls, modules: Sequence[nn.Module]) -> Self:
        check_same(modules, ["normalized_shape", "eps", "elementwise_affine"])
        if any((m.bias is None) != (modules[0].bias is None) for m in modules):
            raise ValueError("some LayerNorm layers have a bias and others not")
        assert isinstance(modules[0], nn.LayerNorm)
        return cls(template=modules[0], modules=modules)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"models={self.num_models}, normalized_shape={self.normalized_shape}"


class FusedGroupNorm(FusedModule):
    """B `nn.GroupNorm` layers as one group norm with B*G groups over B*C channels."""

    stock_types = (nn.GroupNorm,)

    def __init__(self, *, template: nn.GroupNorm, modules: Sequence[nn.Module]) -> None:
        super().__init__(num_models=len(modules))
        self.num_groups = int(template.num_groups)
        self.num_channels = int(template.num_channels)
        self.eps = float(template.eps)
        self.weight = stack_parameter(modules, "weight")
        self.bias = stack_parameter(modules, "bias")

    @classmethod
    def from_modules(cls, modules: Sequence[nn.Module]) -> Self:
        check_same(modules, ["num_groups", "num_channels", "eps", "affine"])
        assert isinstance(modules[0], nn.GroupNorm)
        return cls(template=modules[0], modules=modules)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return group_norm(x, self.num_groups, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"models={self.num_models}, groups={self.num_groups}, channels={self.num_channels}"
