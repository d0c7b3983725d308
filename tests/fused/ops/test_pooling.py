"""Fidelity of fused pooling.

B fused models must train exactly like B stock models trained one by one.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import plait
from plait.fused.ops import pooling
from tests.fused.helpers import RTOL, build, images, rel_err, seq, train_both

CASES = {
    "pooling2d": (
        lambda: nn.Sequential(
            nn.Conv2d(2, 3, 3, padding=1),
            nn.MaxPool2d(2),
            nn.AvgPool2d(2, ceil_mode=True),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(3, 2),
        ),
        images(2, 8, 8),
    ),
    "pooling1d": (
        lambda: nn.Sequential(
            nn.Conv1d(2, 3, 3), nn.MaxPool1d(2), nn.AdaptiveMaxPool1d(2), nn.LPPool1d(2, 2)
        ),
        seq(2, 9),
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_fused_layer_trains_like_stock(name: str) -> None:
    factory, make_input = CASES[name]
    assert train_both(factory, make_input) <= RTOL


@pytest.mark.parametrize("pool", [nn.AdaptiveAvgPool2d(1), nn.MaxPool2d(2)])
def test_pooling_hands_back_channels_last_gradients(pool: nn.Module) -> None:
    # fused convolutions can run channels-last (set_conv_layout); a pooling backward that
    # answers in the contiguous layout would put the element-wise backward before it on
    # torch's slow mixed-layout loops, so the gradient must come back in the input's layout
    base = torch.randn(4, 3 * 2, 4, 4).contiguous(memory_format=torch.channels_last)
    base.requires_grad_()
    x = base.unflatten(1, (3, -1)).transpose(0, 1)  # [B=3, N=4, C=2, 4, 4] view
    array = plait.fuse(build(lambda: nn.Sequential(pool), 3))
    out = array(x)
    (grad,) = torch.autograd.grad(out, base, torch.randn_like(out))
    assert grad.is_contiguous(memory_format=torch.channels_last)
    for b in range(3):  # the stock layer's values (a 16-term mean may sum in another order)
        assert rel_err(out[b], pool(x[b].detach())) <= RTOL


@pytest.mark.parametrize(
    "settings",
    [((3, 3), (2, 2), (1, 1), (1, 1), False), ((2, 2), (2, 2), (0, 0), (1, 1), True),
     ((3, 2), (1, 2), (1, 0), (2, 1), False)],
)  # fmt: skip
def test_channels_last_max_pool_is_torchs_to_the_bit(settings: tuple) -> None:
    # after a ReLU most windows tie at zero, and the index of a tie is where the two
    # kernels could differ; a NaN and an all -inf plane check the other two cases
    x = torch.relu(torch.randn(2, pooling.CHANNELS_LAST_POOL_MIN, 9, 8, dtype=torch.float64))
    x[0, 1, 3, 3] = float("nan")
    x[1, 2] = -float("inf")
    x.requires_grad_()
    out, index = pooling.max_pool2d_with_indices(x, *settings)
    ref, ref_index = torch.ops.aten.max_pool2d_with_indices(x, *settings)
    assert out.is_contiguous() and index.is_contiguous()
    assert torch.equal(index, ref_index)
    torch.testing.assert_close(out, ref, rtol=0, atol=0, equal_nan=True)
    grad = torch.randn_like(ref)
    (got,) = torch.autograd.grad(out, x, grad)
    (want,) = torch.autograd.grad(ref, x, grad)
    assert got.is_contiguous()
    assert torch.equal(got, want)


def test_max_pool_of_few_channels_stays_on_the_contiguous_kernel() -> None:
    x = torch.randn(2, pooling.CHANNELS_LAST_POOL_MIN - 1, 6, 6, requires_grad=True)
    out, _ = pooling.max_pool2d_with_indices(x, (2, 2), (2, 2))
    assert out.grad_fn is not None and "ChannelsLast" not in type(out.grad_fn).__name__
    assert torch.equal(out, torch.nn.functional.max_pool2d(x, 2))
