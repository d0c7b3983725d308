"""Fused pooling: channel-wise, so B models' channels pool as one [N, B*C, ...] batch."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Self

import torch
from torch import nn

from plait.fused.ops.base import FusedModule, check_same, from_channels, to_channels

#: Pooling layers and their number of spatial dimensions.
POOLS: dict[type[nn.Module], int] = {
    nn.MaxPool1d: 1, nn.MaxPool2d: 2, nn.MaxPool3d: 3,
    nn.AvgPool1d: 1, nn.AvgPool2d: 2, nn.AvgPool3d: 3,
    nn.AdaptiveAvgPool1d: 1, nn.AdaptiveAvgPool2d: 2, nn.AdaptiveAvgPool3d: 3,
    nn.AdaptiveMaxPool1d: 1, nn.AdaptiveMaxPool2d: 2, nn.AdaptiveMaxPool3d: 3,
    nn.LPPool1d: 1, nn.LPPool2d: 2,
}  # fmt: skip


class KeepChannelsLast(torch.autograd.Function):
    """Identity whose backward hands on the gradient in channels-last layout.

    Some kernels' backward (adaptive average pooling to 1x1, for one) returns a
    contiguous gradient for a channels-last input. The element-wise backward before them
    (ReLU's, batch norm's) then mixes the two layouts, and torch's CPU loops for mixed
    layouts are many times slower: 0.67 ms instead of 0.02 ms for a ReLU over a
    [32, 256, 4, 4] batch, about 6% of a fused digits-CNN step (measured). One layout
    conversion of the gradient here keeps every kernel before it on its fast path.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        del ctx
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        del ctx
        return grad.contiguous(memory_format=torch.channels_last)


def per_channel(fn: Any, x: torch.Tensor, spatial: int) -> Any:
    """Apply a per-channel, per-sample op `fn` (pooling, interpolation) to [B, ...] input.

    Batched per-model input [B, N, C, *S] runs as [N, B*C, *S]; unbatched per-model input
    [B, C, *S] is already a batch of B samples. A channels-last input (what fused 2-d
    convolutions produce) gets its gradient back channels-last (`KeepChannelsLast`).
    """
    if x.dim() == spatial + 2:
        return fn(x)
    b = x.shape[0]
    channels = to_channels(x)
    if (
        spatial == 2
        and channels.requires_grad
        and not channels.is_contiguous()
        and channels.is_contiguous(memory_format=torch.channels_last)
    ):
        channels = KeepChannelsLast.apply(channels)
    out = fn(channels)
    if isinstance(out, tuple):  # max pooling with return_indices
        return tuple(from_channels(o, b) for o in out)
    return from_channels(out, b)


class FusedPool(FusedModule):
    """Any stock pooling layer (it has no parameters) applied to B models at once."""

    stock_types = tuple(POOLS)

    def __init__(self, *, pool: nn.Module, num_models: int) -> None:
        super().__init__(num_models=num_models)
        self.pool = pool
        self.spatial = POOLS[type(pool)]

    @classmethod
    def from_modules(cls, modules: Sequence[nn.Module]) -> Self:
        check_same(modules, [])
        if any(m.extra_repr() != modules[0].extra_repr() for m in modules):
            raise ValueError(f"{type(modules[0]).__name__} settings differ between models")
        return cls(pool=modules[0], num_models=len(modules))

    def forward(self, x: torch.Tensor) -> Any:
        return per_channel(self.pool, x, self.spatial)
