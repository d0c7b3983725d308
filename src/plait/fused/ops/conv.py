"""Fused convolutions: B models' filters as the groups of one grouped convolution.

Model b's input channels become channel block b of an [N, B*C, ...] input, and its
filters become group block b, so `groups = B * groups` reproduces every model exactly.

2-d convolutions run in the contiguous (NCHW) layout by default, chosen for accuracy:
channels-last is faster on a CPU (oneDNN's grouped kernels, measured 1.2-1.5x per
forward+backward of the fused CNNs in docs/guide/fused.md), but its output keeps batch
norm on torch's channels-last CPU kernel, whose statistics round about 10x worse than
the contiguous kernel's (2e-6 instead of 2e-7 relative to float64 after one
Conv+BatchNorm). After 10 SGD steps of 16 fused CNNs that is 8e-6 from float64 in
channels-last against 1.6e-6 in NCHW, the same 1.6e-6 that stock fp32 modules show:
NCHW keeps fused training as close to exact arithmetic as stock training, channels-last
uses most of the 1e-5 fidelity budget. `set_conv_layout("channels_last")` opts in to the
faster layout for arrays built afterwards.

Two kernel choices are made per call on CPUs whatever the layout: a convolution with one
output position runs as a batched product (`_WindowProduct`), and a stem (`_stem`) runs
channels-last with its output handed on contiguous, so the batch norm after it keeps the
accurate kernel.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, Self

import torch
import torch.nn.functional as F
from torch import nn

from plait.fused.errors import UnsupportedLayerError
from plait.fused.ops.base import (
    FusedModule,
    check_same,
    from_channels,
    is_shared,
    stack_parameter,
    to_channels,
)

_CONV: dict[type[nn.Module], tuple[int, Callable[..., torch.Tensor]]] = {
    nn.Conv1d: (1, F.conv1d),
    nn.Conv2d: (2, F.conv2d),
    nn.Conv3d: (3, F.conv3d),
}
_TRANSPOSED: dict[type[nn.Module], tuple[int, Callable[..., torch.Tensor]]] = {
    nn.ConvTranspose1d: (1, F.conv_transpose1d),
    nn.ConvTranspose2d: (2, F.conv_transpose2d),
}
_SETTINGS = [
    "in_channels", "out_channels", "kernel_size", "stride", "padding", "dilation", "groups",
    "padding_mode", "output_padding",
]  # fmt: skip

#: Memory layouts a fused 2-d convolution can run in.
CONV_LAYOUTS = ("nchw", "channels_last")
_layout = {"conv2d": "nchw"}


def set_conv_layout(layout: str) -> str:
    """Set the layout of the fused 2-d convolutions built from now on; the previous one.

    "nchw" (the default) is the accurate choice, "channels_last" the faster one on a
    CPU (see the module docstring for the measured trade). Arrays already built keep
    theirs; an array's layers can be switched with their `channels_last` attribute.
    """
    if layout not in CONV_LAYOUTS:
        raise ValueError(f"unknown convolution layout {layout!r}; expected one of {CONV_LAYOUTS}")
    previous = _layout["conv2d"]
    _layout["conv2d"] = layout
    return previous


def _one_output(
    size: Sequence[int], kernel: Sequence[int], stride: Any, padding: Any, dilation: Any
) -> list[tuple[slice, slice]] | None:
    """Where a convolution has one output position: per spatial dim, the input rows its
    window reads and the kernel taps that read them (taps over padding are left out);
    None when the output is larger or a setting is not numeric."""
    if isinstance(padding, str):
        return None
    dims = len(kernel)
    s, p, d = (_per_dim(v, dims) for v in (stride, padding, dilation))
    windows = []
    for n, k, st, pad, dil in zip(size, kernel, s, p, d, strict=True):
        if (n + 2 * pad - dil * (k - 1) - 1) // st != 0:
            return None
        taps = [t for t in range(k) if 0 <= t * dil - pad < n]
        if not taps:
            return None
        first, last = taps[0], taps[-1]
        windows.append(
            (slice(first * dil - pad, last * dil - pad + 1, dil), slice(first, last + 1))
        )
    return windows


def _per_dim(value: Any, dims: int) -> list[int]:
    if isinstance(value, int):
        return [value] * dims
    values = [int(v) for v in value]
    return values * dims if len(values) == 1 else values


def _window_product(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    windows: list[tuple[slice, slice]],
    *,
    shared: bool,
) -> torch.Tensor:
    """A convolution with one output position as one batched product (`_WindowProduct`):
    [N, B*C, *S] with filters [B, out, C, *k] -> [N, B*out, 1, ...]; `shared` when the
    input [N, C, *S] feeds all B*out filters."""
    if shared:  # one product of the input against every model's filters
        weight = weight.flatten(0, 1).unsqueeze(0)
        bias = None if bias is None else bias.flatten().unsqueeze(0)
    out: torch.Tensor = _WindowProduct.apply(x, weight, bias, tuple(windows))
    return out


class _WindowProduct(torch.autograd.Function):
    """y[n, g*out] = x[n, g's window] . w[g, out, taps] + bias[g, out] for G filter groups.

    A convolution whose output has one position reads one window of its input, and only
    the kernel taps over the input (not over padding) contribute: ResNet-18's last stage
    on 32x32 inputs runs 3x3 kernels over 1x1 maps, where the centre tap alone does.
    oneDNN's grouped kernel computes all nine taps and its backward is slow at this size;
    as products, forward and backward take 0.70 against 1.48 ms a layer over 1x1 maps and
    0.79 against 1.26 ms for the stride-2 layer over 2x2 maps (16 fused members, 64
    channels, batch 8, one thread). The weight gradient is written once in its full shape
    by a product with a 0/1 tap-placement matrix (exact: each entry is one gradient value
    times 1 plus zeros): zeros and a strided copy, padding, or a broadcast one-hot multiply
    took 1.5-1.6x as long for one tap (6x for zeros and a copy of four).
    """

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        windows: tuple[tuple[slice, slice], ...],
    ) -> torch.Tensor:
        n, g, out_ch = x.shape[0], weight.shape[0], weight.shape[1]
        rows: tuple[Any, ...] = (..., *(r for r, _ in windows))
        taps = tuple((t.start, t.stop) for _, t in windows)
        xw = x[rows].reshape(n, g, -1).transpose(0, 1).contiguous()  # [G, N, C*T]
        index, place = _taps(tuple(weight.shape[3:]), taps)
        ws = weight.flatten(3) if place is None else weight.flatten(3).index_select(3, index)
        ws = ws.reshape(g, out_ch, -1)  # [G, out, C*T]
        wt = ws.transpose(1, 2)
        y = torch.bmm(xw, wt) if bias is None else torch.baddbmm(bias.unsqueeze(1), xw, wt)
        ctx.save_for_backward(xw, ws)
        ctx.shapes = (x.shape, weight.shape, rows, taps)
        ctx.has_bias = bias is not None
        return y.transpose(0, 1).reshape(n, g * out_ch, *[1] * len(windows))

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        xw, ws = ctx.saved_tensors
        x_shape, w_shape, rows, taps = ctx.shapes
        n, g = x_shape[0], w_shape[0]
        gy = grad.reshape(n, g, -1).transpose(0, 1).contiguous()  # [G, N, out]
        gx = gw = gb = None
        if ctx.needs_input_grad[0]:
            window = torch.bmm(gy, ws).transpose(0, 1)  # [N, G, C*T]
            inner = (
                x_shape[1],
                *(len(range(*r.indices(s))) for r, s in zip(rows[1:], x_shape[2:], strict=True)),
            )
            gx = window.reshape(n, *inner)
            if tuple(gx.shape) != tuple(x_shape):  # the window is part of the input
                full = gx.new_zeros(x_shape)
                full[rows] = gx
                gx = full
        if ctx.needs_input_grad[1]:
            gw = torch.bmm(gy.transpose(1, 2), xw)  # [G, out, C*T]
            _, place = _taps(tuple(w_shape[3:]), taps)
            if place is not None:
                gw = gw.reshape(-1, place.shape[0]) @ place.to(gw.dtype)
            gw = gw.reshape(w_shape)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            gb = gy.sum(1)
        return gx, gw, gb, None


@functools.cache
def _taps(
    kernel: tuple[int, ...], taps: tuple[tuple[int, int], ...]
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A window's T taps in the flattened kernel: their positions (for the weight's
    gather, one `index_select`: 96 against 551 us for a strided copy of 4 of 9 taps of a
    [16, 64, 32, 3, 3] weight, level for one tap) and the 0/1 matrix [T, prod(kernel)]
    placing them back (None when the window is the whole kernel)."""
    index = torch.arange(math.prod(kernel)).view(kernel)[tuple(slice(a, b) for a, b in taps)]
    index = index.flatten()
    if index.numel() == math.prod(kernel):
        return index, None
    place = torch.zeros(index.numel(), math.prod(kernel))
    place[torch.arange(index.numel()), index] = 1.0
    return index, place


def _grouped(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    stride: Any,
    padding: Any,
    dilation: Any,
    groups: int,
    channels_last: bool,
) -> torch.Tensor:
    """One convolution over channels [N, C', *S] with B models' filters [B, out, in/g, *k]
    flattened to [B*out, ...] (`groups` counts the groups of all models)."""
    spatial = weight.dim() - 3
    windows = None
    if x.device.type == "cpu" and groups in (1, weight.shape[0]):  # measured on CPUs only
        windows = _one_output(x.shape[2:], weight.shape[3:], stride, padding, dilation)
    if windows is not None:
        return _window_product(x, weight, bias, windows, shared=groups == 1)
    flat = None if bias is None else bias.flatten()
    w = weight.flatten(0, 1)
    stem = spatial == 2 and not channels_last and _stem(w, stride)
    if spatial == 2:  # see the module docstring; the kernel follows the input's layout
        fmt = torch.channels_last if channels_last or stem else torch.contiguous_format
        x = x.contiguous(memory_format=fmt)
        w = w.contiguous(memory_format=fmt)
    fn = (F.conv1d, F.conv2d, F.conv3d)[spatial - 1]
    out: torch.Tensor = fn(x, w, flat, stride, padding, dilation, groups)
    return out.contiguous() if stem else out


def _stem(w: torch.Tensor, stride: Any) -> bool:
    """Whether a 2-d convolution is a network's stem (large strided kernel over a few
    input channels per group), which oneDNN runs 1.4-2.8x faster forward and backward in
    channels-last, layout conversions included (measured: 7x7 stride-2 kernels over 1-3
    channels per group, 4-16 members). Smaller kernels over few channels were as often
    slower (0.8-1.2x), so the rule stops at the stem; the output is handed on contiguous,
    so the batch norm after it keeps its accurate kernel."""
    return (
        w.device.type == "cpu"
        and w.shape[1] <= 3
        and min(w.shape[2:]) >= 5
        and min(_per_dim(stride, 2)) >= 2
    )


def conv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    stride: Any = 1,
    padding: Any = 0,
    dilation: Any = 1,
    groups: int = 1,
    channels_last: bool | None = None,
) -> torch.Tensor:
    """B models' zero-padded convolutions: input [B, N, C, *S] (or [B, C, *S], one sample
    per model), filters [B, out, in/groups, *k], bias [B, out] -> [B, N, out, *S'].

    `channels_last` defaults to the layout `set_conv_layout` chose for 2-d kernels.
    """
    b = weight.shape[0]
    spatial = weight.dim() - 3
    cl = _layout["conv2d"] == "channels_last" if channels_last is None else channels_last
    cl = cl and spatial == 2
    kw = {"stride": stride, "padding": padding, "dilation": dilation, "channels_last": cl}
    if groups == 1 and is_shared(x):  # one input for all models: all B*out filters at once
        return from_channels(_grouped(x[0], weight, bias, groups=1, **kw), b)
    if x.dim() == spatial + 2:  # each model's input is one unbatched sample [C, *S]
        single = _grouped(x.flatten(0, 1).unsqueeze(0), weight, bias, groups=b * groups, **kw)
        out: torch.Tensor = single.unflatten(1, (b, -1))[0]
        return out
    return from_channels(_grouped(to_channels(x), weight, bias, groups=b * groups, **kw), b)


class _FusedConvBase(FusedModule):
    transposed: ClassVar[bool] = False

    def __init__(
        self, *, template: nn.Module, weight: nn.Parameter, bias: nn.Parameter | None
    ) -> None:
        super().__init__(num_models=int(weight.shape[0]))
        self.stock_name = type(template).__name__
        self.spatial, self._fn = (_CONV | _TRANSPOSED)[type(template)]
        self.stride: Any = template.stride
        self.padding: Any = template.padding
        self.dilation: Any = template.dilation
        self.groups = int(template.groups)  # type: ignore[arg-type]
        self.padding_mode = str(template.padding_mode)
        self.output_padding: Any = template.output_padding
        self._pad: Any = getattr(template, "_reversed_padding_repeated_twice", None)
        self.weight = weight
        self.bias = bias
        self.channels_last = (
            self.spatial == 2 and not self.transposed and _layout["conv2d"] == "channels_last"
        )

    @classmethod
    def from_modules(cls, modules: Sequence[nn.Module]) -> Self:
        check_same(modules, _SETTINGS)
        if (modules[0].bias is None) != any(m.bias is None for m in modules):
            raise ValueError(f"some {type(modules[0]).__name__} layers have a bias and others not")
        weight = stack_parameter(modules, "weight")
        assert weight is not None
        return cls(template=modules[0], weight=weight, bias=stack_parameter(modules, "bias"))

    def _kernel(self, x: torch.Tensor, b: int, *, groups: int | None = None) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = self.weight.shape[0]
        if self.groups == 1 and not self.transposed and is_shared(x):
            # one input for all models: an ordinary convolution with all B*out filters
            return from_channels(self._kernel(x[0], b, groups=1), b)
        if x.dim() == self.spatial + 2:  # each model's input is one unbatched sample [C, *S]
            out: torch.Tensor = self._kernel(x.flatten(0, 1).unsqueeze(0), b)
            single: torch.Tensor = out.unflatten(1, (b, -1))[0]
            return single
        return from_channels(self._kernel(to_channels(x), b), b)

    def extra_repr(self) -> str:
        w = self.weight.shape
        return (
            f"{self.stock_name}, models={w[0]}, kernel={tuple(w[3:])}, stride={self.stride}, "
            f"padding={self.padding}, groups={self.groups}"
        )


class FusedConv(_FusedConvBase):
    """B `nn.Conv1d/2d/3d` layers as one grouped convolution; weight [B, out, in/g, *k]."""

    stock_types = tuple(_CONV)

    def _kernel(self, x: torch.Tensor, b: int, *, groups: int | None = None) -> torch.Tensor:
        padding = self.padding
        if self.padding_mode != "zeros":
            x = F.pad(x, self._pad, mode=self.padding_mode)
            padding = 0
        return _grouped(
            x, self.weight, self.bias, stride=self.stride, padding=padding,
            dilation=self.dilation, groups=b * self.groups if groups is None else groups,
            channels_last=self.channels_last,
        )  # fmt: skip


class FusedConvTranspose(_FusedConvBase):
    """B `nn.ConvTranspose1d/2d` layers as one grouped transposed convolution.

    The stock weight is [in, out/g, *k]; stacked it is [B, in, out/g, *k] and flattens to
    the [B*in, out/g, *k] weight of a transposed convolution with B*g groups.
    """

    stock_types = tuple(_TRANSPOSED)
    transposed = True

    @classmethod
    def from_modules(cls, modules: Sequence[nn.Module]) -> Self:
        if modules[0].padding_mode != "zeros":
            raise UnsupportedLayerError(
                f"{type(modules[0]).__name__} with padding_mode={modules[0].padding_mode!r} "
                "cannot be fused (only 'zeros' is supported)"
            )
        return super().from_modules(modules)

    def _kernel(self, x: torch.Tensor, b: int, *, groups: int | None = None) -> torch.Tensor:
        del groups
        bias = None if self.bias is None else self.bias.flatten()
        return self._fn(
            x, self.weight.flatten(0, 1), bias, self.stride, self.padding,
            self.output_padding, b * self.groups, self.dilation,
        )  # fmt: skip

    def forward(self, x: torch.Tensor, output_size: Any = None) -> torch.Tensor:
        if output_size is not None:
            raise UnsupportedLayerError(
                f"fused {self.stock_name} does not take output_size; set output_padding instead"
            )
        return super().forward(x)
