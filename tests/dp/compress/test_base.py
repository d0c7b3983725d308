"""`plait.dp.compress.base`: the registry, byte accounting, parameter names, checks."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from plait.dp.compress import ACPSGD, FP16, SignSGD, TopK
from plait.dp.compress.base import check_positive, compressor_class, compressor_names


def test_registry() -> None:
    assert compressor_class("signsgd") is SignSGD
    assert {"ssgd", "fp16", "acpsgd"} <= set(compressor_names())
    with pytest.raises(ValueError, match="unknown compressor 'sgd'; choose from acpsgd"):
        compressor_class("sgd")


def test_compression_ratios() -> None:
    model = nn.Linear(100, 10)  # 1010 fp32 entries
    assert compressor_class("ssgd")().compression_ratio(model) == 1.0
    assert FP16().compression_ratio(model) == pytest.approx(0.5)
    # 1 bit per entry and a 4-byte scale per tensor
    sign = (1000 / 8 + 4 + 10 / 8 + 4) / (1010 * 4)
    assert SignSGD().compression_ratio(model) == pytest.approx(sign)
    assert TopK(ratio=0.1).compression_ratio(model) < 0.25
    assert ACPSGD(rank=2).compression_ratio(model) < 1.0


def test_parameter_names_bound_or_by_order() -> None:
    layer = nn.Linear(2, 2)
    comp = SignSGD()
    comp.bind(nn.Sequential(layer))
    assert comp.param_name(layer.weight) == "0.weight"
    anonymous = SignSGD()
    t, u = torch.zeros(1), torch.zeros(1)
    assert [anonymous.param_name(t), anonymous.param_name(u), anonymous.param_name(t)] == [
        "param0",
        "param1",
        "param0",
    ]


def test_stateless_state_and_positive_checks() -> None:
    comp = FP16()
    assert comp.state_dict() == {}
    with pytest.raises(ValueError, match="has no state"):
        comp.load_state_dict({"x": 1})
    check_positive("rank", 3, integer=True)
    for value, message in [(0, "must be > 0"), (1.5, "an integer"), (True, "a number")]:
        with pytest.raises(ValueError, match=message):
            check_positive("rank", value, integer=True)
