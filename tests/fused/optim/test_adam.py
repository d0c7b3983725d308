"""FusedAdam and FusedAdamW (amsgrad, shared values, native and flat steps).

Checked against torch.optim: B models with per-model hyper-parameters.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from plait.fused import FusedAdam, FusedAdamW, native
from tests.fused.helpers import RTOL, B, OptimizerCase, cnn, run_optimizers

CASES: dict[str, OptimizerCase] = {
    "adam": (FusedAdam, torch.optim.Adam, {
        "lr": [0.01, 0.02, 0.005, 0.03], "betas": [(0.9, 0.999), (0.8, 0.99), (0.95, 0.9),
                                                   (0.9, 0.999)],
        "eps": [1e-8, 1e-6, 1e-8, 1e-7], "weight_decay": [0.0, 0.1, 0.01, 0.0]}),
    "adam_shared_values": (FusedAdam, torch.optim.Adam, {"lr": 0.01, "weight_decay": 0.01}),
    "adam_amsgrad": (FusedAdam, torch.optim.Adam, {
        "lr": [0.01, 0.02, 0.005, 0.03], "amsgrad": True}),
    "adamw": (FusedAdamW, torch.optim.AdamW, {
        "lr": [0.01, 0.02, 0.005, 0.03], "weight_decay": [0.0, 0.1, 0.01, 0.5]}),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(CASES))
def test_fused_optimizer_matches_stock(name: str) -> None:
    fused_cls, stock_cls, kwargs = CASES[name]
    assert run_optimizers(fused_cls, stock_cls, kwargs) <= RTOL


@pytest.mark.parametrize("name", ["adam", "adam_shared_values"])
def test_fused_optimizer_matches_stock_on_a_cnn(name: str) -> None:
    fused_cls, stock_cls, kwargs = CASES[name]
    x = torch.randn(B, 5, 2, 5, 5)
    assert run_optimizers(fused_cls, stock_cls, kwargs, factory=cnn, x=x) <= RTOL


@pytest.mark.parametrize("use_native", [False, True])
def test_gradients_with_any_strides_give_the_same_step(use_native: bool) -> None:
    # the flat step gathers gradients into one buffer through cached views, the native
    # one reads them in place; a gradient laid out differently from its parameter (set
    # by hand, or by a custom backward) must give the same step either way, and cached
    # views must stay valid across steps
    grads = [torch.randn(B, 3, 5), torch.randn(B, 4)]
    results = []
    native_before = native.set_enabled(use_native)
    for layout in ("contiguous", "strided"):
        params = [nn.Parameter(torch.ones(B, 3, 5)), nn.Parameter(torch.ones(B, 4))]
        opt = FusedAdam(params, lr=[0.1, 0.2, 0.3, 0.4])
        for step in range(3):
            for p, g0 in zip(params, grads, strict=True):
                g = g0 * (step + 1)
                strided = g.transpose(0, -1).contiguous().transpose(0, -1)  # same values
                p.grad = g if layout == "contiguous" else strided
            opt.step()
        results.append([p.detach().clone() for p in params])
    native.set_enabled(native_before)
    last = params[0].grad
    assert last is not None and not last.is_contiguous()  # the strided case is strided
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)
