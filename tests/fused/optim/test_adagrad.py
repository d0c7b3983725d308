"""FusedAdagrad.

Checked against torch.optim: B models with per-model hyper-parameters.
"""

from __future__ import annotations

import pytest
import torch

from plait.fused import FusedAdagrad
from tests.fused.helpers import RTOL, OptimizerCase, run_optimizers

CASES: dict[str, OptimizerCase] = {
    "adagrad": (FusedAdagrad, torch.optim.Adagrad, {
        "lr": [0.1, 0.2, 0.05, 0.3], "lr_decay": [0.0, 0.1, 0.01, 0.0],
        "initial_accumulator_value": [0.0, 0.1, 0.5, 0.0], "weight_decay": [0.0, 0.1, 0.0, 0.0]}),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(CASES))
def test_fused_optimizer_matches_stock(name: str) -> None:
    fused_cls, stock_cls, kwargs = CASES[name]
    assert run_optimizers(fused_cls, stock_cls, kwargs) <= RTOL
