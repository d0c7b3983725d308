"""`KFACConfig`: every value checked when built, enums from their names, schedules."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from plait.kfac.config import KFACConfig, check_value
from plait.kfac.factors import Method
from plait.kfac.layers import Approximation
from plait.kfac.pipeline import FactorComm
from plait.kfac.placement import Distribution, PlacementPolicy


def test_names_become_enums_and_dtypes() -> None:
    cfg = KFACConfig(
        method="EIGEN",
        comm="static",
        placement="greedy",
        distribution="auto",
        comm_dtype="bf16",
        skip_layers=("head*",),
        approximation="Reduce",
    )
    assert cfg.approximation is Approximation.REDUCE
    assert KFACConfig().approximation is Approximation.EXPAND
    assert cfg.method is Method.EIGEN and cfg.comm is FactorComm.STATIC
    assert cfg.placement is PlacementPolicy.GREEDY and cfg.distribution is Distribution.AUTO
    assert cfg.comm_dtype is torch.bfloat16 and cfg.skip_layers == ("head*",)
    assert KFACConfig(comm_dtype="fp32").comm_dtype is None


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"damping": 0.0}, "damping must be > 0"),
        ({"factor_decay": 1.0}, "factor_decay"),
        ({"kl_clip": -1.0}, "kl_clip"),
        ({"lr": -0.1}, "lr"),
        ({"factor_interval": 0}, "factor_interval"),
        ({"inv_interval": 2.5}, "inv_interval"),
        ({"inv_interval": True}, "inv_interval"),
        ({"method": "svd"}, "unknown method 'svd'; choose from inverse, eigen"),
        ({"approximation": "mean"}, "unknown approximation 'mean'; choose from expand, reduce"),
        ({"comm_dtype": "int8"}, "comm_dtype"),
        ({"bucket_cap_mb": 0}, "bucket_cap_mb"),
        ({"grad_workers": 0}, "grad_workers"),
        ({"replan_every": 0}, "replan_every"),
    ],
)
def test_bad_values_name_themselves(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        KFACConfig(**kwargs)


def test_callable_schedules_are_checked_when_evaluated() -> None:
    cfg = KFACConfig(damping=lambda s: 0.1 / (s + 1), inv_interval=lambda s: 1 + s // 10)
    assert check_value("damping", cfg.damping, 9, low=0.0, low_open=True) == pytest.approx(0.01)
    assert check_value("inv_interval", cfg.inv_interval, 25) == 3
    with pytest.raises(ValueError, match="damping"):
        check_value("damping", lambda s: -1.0, 0, low=0.0, low_open=True)
    with pytest.raises(ValueError, match="inv_interval"):
        check_value("inv_interval", lambda s: 0, 0)


def test_constants_leave_out_callables_and_name_dtypes() -> None:
    out = KFACConfig(damping=lambda s: 0.1, comm_dtype="fp16").constants()
    assert "damping" not in out and out["comm_dtype"] == "torch.float16"
    assert out["method"] == "inverse" and out["inv_interval"] == 1
