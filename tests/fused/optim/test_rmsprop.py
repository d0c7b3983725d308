"""FusedRMSprop (centred, momentum).

Checked against torch.optim: B models with per-model hyper-parameters.
"""

from __future__ import annotations

import pytest
import torch

from plait.fused import FusedRMSprop
from tests.fused.helpers import RTOL, OptimizerCase, run_optimizers

CASES: dict[str, OptimizerCase] = {
    "rmsprop": (FusedRMSprop, torch.optim.RMSprop, {
        "lr": [0.01, 0.02, 0.005, 0.03], "alpha": [0.9, 0.99, 0.8, 0.95],
        "momentum": [0.0, 0.9, 0.5, 0.0], "weight_decay": [0.0, 0.1, 0.0, 0.01]}),
    "rmsprop_centered": (FusedRMSprop, torch.optim.RMSprop, {
        "lr": [0.01, 0.02, 0.005, 0.03], "centered": True, "momentum": 0.5}),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(CASES))
def test_fused_optimizer_matches_stock(name: str) -> None:
    fused_cls, stock_cls, kwargs = CASES[name]
    assert run_optimizers(fused_cls, stock_cls, kwargs) <= RTOL
