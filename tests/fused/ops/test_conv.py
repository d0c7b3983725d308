"""Fidelity of fused convolutions (grouped, transposed, padded).

B fused models must train exactly like B stock models trained one by one.
"""

from __future__ import annotations

import pytest
from torch import nn

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
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_fused_layer_trains_like_stock(name: str) -> None:
    factory, make_input = CASES[name]
    assert train_both(factory, make_input) <= RTOL
