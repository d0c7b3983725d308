"""Fidelity of fused Linear layers.

B fused models must train exactly like B stock models trained one by one.
"""

from __future__ import annotations

import pytest
from torch import nn

from tests.fused.helpers import RTOL, feats, train_both

CASES = {
    "linear": (
        lambda: nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3, bias=False)),
        feats(6),
    ),
    "linear_3d_input": (lambda: nn.Linear(6, 4), feats(3, 6)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_fused_layer_trains_like_stock(name: str) -> None:
    factory, make_input = CASES[name]
    assert train_both(factory, make_input) <= RTOL
