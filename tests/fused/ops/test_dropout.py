"""Fidelity of fused dropout with per-model masks and probabilities.

B fused models must train exactly like B stock models trained one by one.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import plait
from plait.fused.ops import FusedDropout
from tests.fused.helpers import RTOL, feats, train_both

CASES = {
    "dropout_p0": (
        lambda: nn.Sequential(nn.Linear(4, 5), nn.Dropout(0.0), nn.Linear(5, 2)),
        feats(4),
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_fused_layer_trains_like_stock(name: str) -> None:
    factory, make_input = CASES[name]
    assert train_both(factory, make_input) <= RTOL


def test_dropout_masks_are_independent_per_model_with_per_model_p() -> None:
    drop = FusedDropout.with_p([0.1, 0.5, 0.9], num_models=3)
    x = torch.ones(3, 200, 50, requires_grad=True)
    out = drop(x)
    kept = out != 0
    for b, p in enumerate([0.1, 0.5, 0.9]):
        # each surviving element is scaled by 1 / (1 - p), as in F.dropout
        assert torch.allclose(out[b][kept[b]], torch.full_like(out[b][kept[b]], 1 / (1 - p)))
        assert abs(1 - kept[b].float().mean().item() - p) < 0.02
    assert not torch.equal(kept[0], kept[1])
    out.sum().backward()
    assert torch.equal(x.grad != 0, kept)  # gradients flow through kept elements only
    drop.eval()
    assert torch.equal(drop(x), x)


def test_shared_probability_uses_independent_masks() -> None:
    torch.manual_seed(0)
    array = plait.fuse(lambda: nn.Dropout(0.5), n=2)
    out = array(torch.ones(2, 100, 10))
    assert not torch.equal(out[0] != 0, out[1] != 0)
