"""`plait.models.mlp`: flattening, widths, dropout placement."""

from __future__ import annotations

import torch
from torch import nn

from plait.models.mlp import MLP


def test_flattens_input_and_counts_parameters() -> None:
    model = MLP(in_features=64, hidden=(32, 16), num_classes=10)
    assert model(torch.randn(5, 1, 8, 8)).shape == (5, 10)
    assert sum(p.numel() for p in model.parameters()) == (64 * 32 + 32) + (32 * 16 + 16) + (
        16 * 10 + 10
    )


def test_dropout_only_when_asked() -> None:
    def dropouts(model: nn.Module) -> int:
        return sum(isinstance(m, nn.Dropout) for m in model.modules())

    assert dropouts(MLP(in_features=4, hidden=(8, 8))) == 0
    assert dropouts(MLP(in_features=4, hidden=(8, 8), dropout=0.1)) == 2
    assert MLP(in_features=4, hidden=()).net[-1].in_features == 4  # a linear classifier
