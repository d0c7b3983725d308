"""Fidelity of fused batch, layer and group norm.

B fused models must train exactly like B stock models trained one by one.
"""

from __future__ import annotations

import pytest
from torch import nn

from tests.fused.helpers import RTOL, feats, images, seq, train_both

CASES = {
    "batchnorm1d": (
        lambda: nn.Sequential(nn.Linear(5, 4), nn.BatchNorm1d(4), nn.ReLU(), nn.Linear(4, 2)),
        feats(5, n=6),
    ),
    "batchnorm1d_seq": (lambda: nn.BatchNorm1d(3, momentum=None), seq(3, 5)),
    "batchnorm2d": (
        lambda: nn.Sequential(nn.Conv2d(2, 3, 3), nn.BatchNorm2d(3), nn.ReLU()),
        images(2, 5, 5),
    ),
    "layernorm": (lambda: nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.GELU()), feats(3, 6)),
    "layernorm_2d_shape": (lambda: nn.LayerNorm([3, 4], bias=False), feats(2, 3, 4)),
    "layernorm_no_affine": (
        lambda: nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8, elementwise_affine=False)),
        feats(3, 6),
    ),
    "groupnorm": (
        lambda: nn.Sequential(nn.Conv2d(2, 4, 3), nn.GroupNorm(2, 4), nn.SiLU()),
        images(2, 5, 5),
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_fused_layer_trains_like_stock(name: str) -> None:
    factory, make_input = CASES[name]
    assert train_both(factory, make_input) <= RTOL
