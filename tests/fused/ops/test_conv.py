"""Fidelity of fused convolutions (grouped, transposed, padded).

B fused models must train exactly like B stock models trained one by one.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from plait.fused.ops import conv as fused_conv
from tests.fused.helpers import RTOL, images, seq, train_both

CASES = {
    "conv1d": (
        lambda: nn.Sequential(
            nn.Conv1d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv1d(4, 2, 2, stride=2)
        ),
        seq(3, 8),
    ),
    "conv2d": (
        lambda: nn.Sequential(
            nn.Conv2d(2, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 4, 3, groups=2, bias=False)
        ),
        images(2, 6, 6),
    ),
    "conv2d_reflect_dilated": (
        lambda: nn.Conv2d(2, 3, 3, padding=2, dilation=2, padding_mode="reflect"),
        images(2, 6, 6),
    ),
    "conv_transpose2d": (
        lambda: nn.Sequential(
            nn.ConvTranspose2d(3, 4, 3, stride=2, padding=1, output_padding=1), nn.Tanh()
        ),
        images(3, 4, 4),
    ),
    "conv_transpose1d": (lambda: nn.ConvTranspose1d(2, 3, 4, stride=2, groups=1), seq(2, 5)),
    # ResNet-18's last stage on small images: 3x3 kernels over 2x2 and 1x1 maps, one
    # output position each (the window product), then a 7x7 stride-2 stem (channels-last)
    "one_output_position": (
        lambda: nn.Sequential(
            nn.Conv2d(2, 4, 3, stride=2, padding=1), nn.ReLU(), nn.Conv2d(4, 3, 3, padding=1)
        ),
        images(2, 2, 2),
    ),
    "stem": (
        lambda: nn.Sequential(nn.Conv2d(1, 4, 7, stride=2, padding=3), nn.BatchNorm2d(4)),
        images(1, 12, 12),
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_fused_layer_trains_like_stock(name: str) -> None:
    factory, make_input = CASES[name]
    assert train_both(factory, make_input) <= RTOL


# (size, kernel, stride, padding, dilation): one output position each, over the centre
# tap alone, a 2x2 window of a 3x3 kernel, a 1x1 kernel, a whole kernel, dilated taps
ONE_OUTPUT = [(1, 3, 1, 1, 1), (2, 3, 2, 1, 1), (2, 1, 2, 0, 1), (3, 3, 1, 0, 1),
              (5, 3, 1, 0, 2), (3, 3, 1, 1, 2)]  # fmt: skip


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("case", ONE_OUTPUT)
def test_window_product_matches_the_grouped_convolution(
    case: tuple[int, ...], bias: bool, shared: bool
) -> None:
    size, k, stride, padding, dilation = case
    b, n, c, out = 3, 4, 5, 6
    gen = torch.Generator().manual_seed(0)

    def make(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64).requires_grad_()

    x = make(n, c if shared else b * c, size, size)
    w = make(b, out, c, k, k)
    bb = make(b, out) if bias else None
    groups = 1 if shared else b
    settings = {"stride": stride, "padding": padding, "dilation": dilation}
    assert fused_conv._one_output(x.shape[2:], w.shape[3:], stride, padding, dilation)
    y = fused_conv._grouped(x, w, bb, groups=groups, channels_last=False, **settings)
    ref = F.conv2d(x, w.flatten(0, 1), None if bb is None else bb.flatten(), groups=groups,
                   **settings)  # fmt: skip
    grad = torch.randn(ref.shape, generator=gen, dtype=torch.float64)
    inputs = [x, w] + ([bb] if bb is not None else [])
    got = torch.autograd.grad(y, inputs, grad)
    want = torch.autograd.grad(ref, inputs, grad)
    # float64 sums of at most 45 products in another order: rounding far below 1e-12
    torch.testing.assert_close(y, ref, rtol=1e-12, atol=1e-12)
    for g, r in zip(got, want, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-12, atol=1e-12)


def test_one_output_is_none_where_the_output_is_larger() -> None:
    assert fused_conv._one_output((4, 4), (3, 3), 1, 1, 1) is None
    assert fused_conv._one_output((2, 2), (3, 3), 1, 1, 1) is None  # 2x2 output
    assert fused_conv._one_output((1, 1), (3, 3), 1, "same", 1) is None
    assert fused_conv._one_output((1, 2), (3, 3), 1, 1, 1) is None  # 1x2 output


def test_the_stem_rule() -> None:
    stem = torch.empty(8, 1, 7, 7)
    assert fused_conv._stem(stem, 2)
    assert fused_conv._stem(stem, (2, 2))
    assert not fused_conv._stem(stem, 1)  # not strided
    assert not fused_conv._stem(torch.empty(8, 1, 3, 3), 2)  # a small kernel
    assert not fused_conv._stem(torch.empty(8, 8, 7, 7), 2)  # many input channels
