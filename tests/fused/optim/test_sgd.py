"""FusedSGD (momentum, dampening, Nesterov, weight decay).

Checked against torch.optim: B models with per-model hyper-parameters.
"""

from __future__ import annotations

import pytest
import torch

from plait.fused import FusedSGD
from tests.fused.helpers import RTOL, B, OptimizerCase, cnn, run_optimizers

CASES: dict[str, OptimizerCase] = {
    "sgd": (FusedSGD, torch.optim.SGD, {"lr": [0.1, 0.2, 0.05, 0.3]}),
    "sgd_momentum_dampening_wd": (FusedSGD, torch.optim.SGD, {
        "lr": [0.1, 0.2, 0.05, 0.3], "momentum": [0.9, 0.0, 0.5, 0.8],
        "dampening": [0.1, 0.0, 0.0, 0.2], "weight_decay": [0.0, 1e-2, 1e-3, 0.1]}),
    "sgd_nesterov": (FusedSGD, torch.optim.SGD, {
        "lr": [0.1, 0.2, 0.05, 0.3], "momentum": [0.9, 0.7, 0.5, 0.8], "nesterov": True,
        "weight_decay": 1e-3}),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(CASES))
def test_fused_optimizer_matches_stock(name: str) -> None:
    fused_cls, stock_cls, kwargs = CASES[name]
    assert run_optimizers(fused_cls, stock_cls, kwargs) <= RTOL


@pytest.mark.parametrize("name", ["sgd_nesterov"])
def test_fused_optimizer_matches_stock_on_a_cnn(name: str) -> None:
    fused_cls, stock_cls, kwargs = CASES[name]
    x = torch.randn(B, 5, 2, 5, 5)
    assert run_optimizers(fused_cls, stock_cls, kwargs, factory=cnn, x=x) <= RTOL
