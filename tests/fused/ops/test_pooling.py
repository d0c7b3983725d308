"""Fidelity of fused pooling.

B fused models must train exactly like B stock models trained one by one.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import plait
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
