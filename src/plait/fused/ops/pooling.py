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


#: Fewest channels at which `max_pool2d` takes the channels-last kernel: measured
#: 2.8-3.9x faster than the contiguous one with 8 to 1024 channels (conversions
#: included), 1.5x at 4, and slower at 3 (0.8x).
CHANNELS_LAST_POOL_MIN = 8


class _MaxPool2dChannelsLast(torch.autograd.Function):
    """2-d max pooling of a contiguous CPU batch on torch's channels-last kernel.

    torch's contiguous-layout CPU max-pool visits one output at a time (27 ns an output
    on [8, 128, 16, 16], ResNet-18's stem pool in a fused array of 16, 1.8 ms a step),
    where the channels-last kernel runs along the channels; with the layout conversions
    the pool is 3.5x faster. Both kernels scan a window in the same order with the same
    test (a larger value or a NaN takes over), so values and indices are bit-identical,
    and the backward is torch's own, contiguous, from those indices.
    """

    @staticmethod
    def forward(  # noqa: PLR0917 (autograd passes the inputs positionally)
        ctx: Any, x: torch.Tensor, kernel: Any, stride: Any, padding: Any, dilation: Any,
        ceil_mode: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        out, index = torch.ops.aten.max_pool2d_with_indices(
            x.contiguous(memory_format=torch.channels_last), kernel, stride, padding,
            dilation, ceil_mode,
        )  # fmt: skip
        index = index.contiguous()
        ctx.save_for_backward(x, index)
        ctx.settings = (kernel, stride, padding, dilation, ceil_mode)
        ctx.mark_non_differentiable(index)
        return out.contiguous(), index

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: torch.Tensor, _: Any) -> tuple[torch.Tensor | None, ...]:
        x, index = ctx.saved_tensors
        gx = torch.ops.aten.max_pool2d_with_indices_backward(
            grad.contiguous(), x, *ctx.settings, index
        )
        return gx, None, None, None, None, None


def max_pool2d_with_indices(  # noqa: PLR0917 (the operator's schema is positional)
    x: torch.Tensor,
    kernel_size: Any,
    stride: Any = (),
    padding: Any = 0,
    dilation: Any = 1,
    ceil_mode: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`aten.max_pool2d_with_indices`, on the channels-last kernel where that is faster
    (a contiguous 4-d CPU batch of at least `CHANNELS_LAST_POOL_MIN` channels)."""
    args = (kernel_size, stride, padding, dilation, ceil_mode)
    if (
        x.dim() == 4
        and x.device.type == "cpu"
        and x.shape[1] >= CHANNELS_LAST_POOL_MIN
        and x.is_contiguous()
    ):
        out, index = _MaxPool2dChannelsLast.apply(x, *args)
        return out, index
    result: tuple[torch.Tensor, torch.Tensor] = torch.ops.aten.max_pool2d_with_indices(x, *args)
    return result


def max_pool2d(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """`aten.max_pool2d` through `max_pool2d_with_indices`: the values only."""
    return max_pool2d_with_indices(x, *args, **kwargs)[0]


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
        pool = self.pool
        if type(pool) is nn.MaxPool2d:
            indices = pool.return_indices
            settings = (pool.kernel_size, pool.stride, pool.padding, pool.dilation, pool.ceil_mode)

            def fn(t: torch.Tensor) -> Any:
                out = max_pool2d_with_indices(t, *settings)
                return out if indices else out[0]

            return per_channel(fn, x, self.spatial)
        return per_channel(pool, x, self.spatial)
