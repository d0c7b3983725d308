"""`KFACConfig`: every value checked when built, enums from their names, schedules."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from plait.kfac.config import DEFAULT_INTERVALS, KFACConfig
from plait.kfac.eigenbasis import Graft, Mode
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
        ({"rest_lr_scale": 0.0}, "rest_lr_scale must be > 0"),
    ],
)
def test_bad_values_name_themselves(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        KFACConfig(**kwargs)


def test_constants_leave_out_callables_and_name_dtypes() -> None:
    out = KFACConfig(damping=lambda s: 0.1, comm_dtype="fp16").constants()
    assert "damping" not in out and out["comm_dtype"] == "torch.float16"
    # unset: the mode's (K-FAC: Cholesky inverses, every step)
    assert out["method"] is None and out["inv_interval"] is None


def test_the_mode_sets_the_decomposition_and_the_default_intervals() -> None:
    kfac, ekfac, soap = (KFACConfig(mode=m) for m in ("kfac", "EKFAC", "soap"))
    assert soap.mode is Mode.SOAP and ekfac.mode is Mode.EKFAC
    assert kfac.decomposition is Method.INVERSE
    assert ekfac.decomposition is soap.decomposition is Method.EIGEN
    assert KFACConfig(method="eigen").decomposition is Method.EIGEN
    assert (kfac.factor_every, kfac.inv_every) == DEFAULT_INTERVALS[Mode.KFAC] == (1, 1)
    assert (soap.factor_every, soap.inv_every) == DEFAULT_INTERVALS[Mode.SOAP] == (5, 10)
    assert KFACConfig(mode="soap", inv_interval=3).inv_every == 3
    # an unset field stays unset, so a preset's copy may change the mode
    from dataclasses import replace

    assert replace(kfac, mode="soap").decomposition is Method.EIGEN
    assert KFACConfig(graft="ADAM").graft is Graft.ADAM


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"mode": "shampoo"}, "unknown mode 'shampoo'; choose from kfac, ekfac, soap"),
        ({"mode": "soap", "method": "inverse"}, "needs method=eigen"),
        ({"mode": "ekfac", "distribution": "mem-opt"}, "comm-opt"),
        ({"mode": "ekfac", "distribution": "hybrid"}, "comm-opt"),
        ({"mode": "soap", "graft": "adam"}, "graft applies to kfac and ekfac"),
        ({"graft": "sgd"}, "unknown graft"),
        ({"beta1": 1.0}, "beta1"),
        ({"beta2": -0.1}, "beta2"),
        ({"eps": 0.0}, "eps"),
    ],
)
def test_bad_mode_settings_name_themselves(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        KFACConfig(**kwargs)
