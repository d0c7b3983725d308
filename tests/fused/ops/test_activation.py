"""Fidelity of fused element-wise layers, softmax and flatten.

B fused models must train exactly like B stock models trained one by one.
"""

from __future__ import annotations

import pytest
from torch import nn

from plait.fused.ops import ELEMENTWISE
from tests.fused.helpers import RTOL, feats, train_both

CASES = {
    "softmax_flatten": (
        lambda: nn.Sequential(
            nn.Linear(4, 6),
            nn.Unflatten(1, (2, 3)),
            nn.LogSoftmax(dim=-1),
            nn.Flatten(),
            nn.Softmax(dim=1),
        ),
        feats(4),
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_fused_layer_trains_like_stock(name: str) -> None:
    factory, make_input = CASES[name]
    assert train_both(factory, make_input) <= RTOL


def test_every_elementwise_layer() -> None:
    for cls in ELEMENTWISE:
        layer = cls(0.5, 0.1) if cls is nn.Threshold else cls()
        factory = lambda layer=layer: nn.Sequential(nn.Linear(4, 4), layer, nn.Linear(4, 2))  # noqa: E731
        make = feats(4, 4) if cls is nn.Softmax2d else feats(4)
        assert train_both(factory, make) <= RTOL, cls.__name__
