"""Fidelity of what every fused layer shares (one input shared by all models).

B fused models must train exactly like B stock models trained one by one.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import plait
from tests.fused.helpers import RTOL, build, rel_err


@pytest.mark.parametrize(
    ("factory", "shape"),
    [
        (lambda: nn.Sequential(nn.Linear(6, 4), nn.ReLU(), nn.Linear(4, 2)), (5, 6)),
        # no bias before batch norm: its true gradient is 0, so any rounding fails 1e-5
        (
            lambda: nn.Sequential(nn.Conv2d(2, 3, 3, padding=1, bias=False), nn.BatchNorm2d(3)),
            (4, 2, 5, 5),
        ),
        (lambda: nn.Conv1d(2, 4, 3, padding=1, padding_mode="replicate"), (3, 2, 7)),
    ],
)
def test_input_shared_by_all_models(factory: object, shape: tuple[int, ...]) -> None:
    # a batch expanded to every model (stride 0) takes the one-copy path of the first layer
    stock = build(factory, 3)  # type: ignore[arg-type]
    array = plait.fuse(build(factory, 3))  # type: ignore[arg-type]
    x = torch.randn(shape)
    out = array(x.expand(3, *shape))
    # a random linear loss: sum(y**2) after batch norm is constant up to eps, so its
    # gradient would be all cancellation and no kernel order could match it to 1e-5
    g = torch.randn(out.shape[1:])
    (out * g).sum().backward()
    for b, m in enumerate(stock):
        ref = m(x)
        (ref * g).sum().backward()
        assert rel_err(out[b], ref) <= RTOL
        for name, p in m.named_parameters():
            assert rel_err(array.get_parameter(name).grad[b], p.grad) <= RTOL
