"""Sweep tasks: which hyper-parameters are fusible, and the fused optimizer they build."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from plait.fused.optim import FusedAdam, FusedRMSprop, FusedSGD
from plait.fused.sweep.space import SearchSpace
from plait.fused.sweep.task import OptimizerKind, SweepTask, sweep_task
from plait.workloads import WORKLOADS


def test_every_fused_optimizer_takes_per_model_values() -> None:
    models = [nn.Linear(2, 2) for _ in range(2)]
    from plait.fused import fuse

    for kind in OptimizerKind:
        opt = kind.make(fuse(models).parameters(), [{"lr": 0.1}, {"lr": 0.2}])
        assert isinstance(opt, kind.cls)
        assert opt.param_groups[0]["lr"] == [0.1, 0.2]
    opt = OptimizerKind.ADAM.make(
        fuse(models).parameters(),
        [{"lr": 0.1, "betas": (0.9, 0.99), "amsgrad": True}, {"lr": 0.2, "amsgrad": True}],
    )
    assert isinstance(opt, FusedAdam)
    group = opt.param_groups[0]
    # a model without an option gets the optimizer's default; switches hold array-wide
    assert list(map(tuple, group["betas"])) == [(0.9, 0.99), (0.9, 0.999)]
    assert group["amsgrad"] is True
    assert OptimizerKind("rmsprop").cls is FusedRMSprop and OptimizerKind.SGD.cls is FusedSGD


def test_non_fusible_values_make_the_partition_key() -> None:
    task = sweep_task("digits-mlp", fusible=("dropout",))
    params = {"lr": 0.1, "momentum": 0.9, "batch_size": 32, "width": 16, "dropout": 0.1}
    key = task.partition_key(params, OptimizerKind.SGD)
    assert key == (("batch_size", 32), ("width", 16))  # dropout listed fusible
    adam = {"lr": 0.1, "amsgrad": True, "betas": [0.9, 0.99], "width": 8}
    assert task.partition_key(adam, OptimizerKind.ADAM) == (("width", 8), ("amsgrad", True))
    assert task.model_options(params, OptimizerKind.SGD) == {"width": 16, "dropout": 0.1}


def test_names_nothing_takes_are_refused() -> None:
    task = sweep_task("digits-mlp")
    task.check({"lr": 0.1, "momentum": 0.9, "width": 8, "batch_size": 4}, OptimizerKind.SGD)
    with pytest.raises(ValueError, match="'momentum' is not an option of the adam optimizer"):
        task.check({"lr": 0.1, "momentum": 0.9}, OptimizerKind.ADAM)
    with pytest.raises(ValueError, match=r"'widht'.*workload 'digits-mlp' \(width\)"):
        task.check({"widht": 8}, OptimizerKind.SGD)
    with pytest.raises(ValueError, match="batch_size must be an integer >= 1"):
        task.check({"batch_size": 0}, OptimizerKind.SGD)


def test_a_task_builds_its_workload_model_at_the_trial_width() -> None:
    task = SweepTask(workload=WORKLOADS["digits-mlp"], space=SearchSpace(widths=(16,)))
    info = task.workload.bench_data(4).info
    model = task.build(info, {"lr": 0.1, "width": 16, "batch_size": 8}, OptimizerKind.SGD)
    assert sum(p.numel() for p in model.parameters()) == 64 * 16 + 16 + 16 * 16 + 16 + 16 * 10 + 10
    assert model(torch.randn(2, 64)).shape == (2, 10)
    assert sweep_task(task) is task and sweep_task(task, SearchSpace()).space == SearchSpace()
    with pytest.raises(ValueError, match="unknown workload 'imagenet'"):
        sweep_task("imagenet")
