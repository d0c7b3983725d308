"""What a sweep trains: a registry workload, a search space and a fused optimizer.

A trial's hyper-parameters split in three by their names:

- optimizer options (``lr``, ``momentum``, ``weight_decay``, ``betas``, ``eps``, ``alpha``,
  ... whatever the chosen fused optimizer takes): fusible, they become per-model
  coefficients of one fused optimizer; its on/off switches (``nesterov``, ``amsgrad``,
  ``centered``) hold for a whole array and are non-fusible;
- ``batch_size``: non-fusible, every model of an array sees the same batches;
- every other name is a model option passed to the workload's builder
  (``workload.model(info, **options)``, e.g. ``width``): non-fusible, since it may change
  shapes, unless the task lists it in `SweepTask.fusible` (a per-model dropout
  probability, say, which a fused array holds per model).

Trials are partitioned by their non-fusible values and each part trains as its own arrays.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from functools import cache
from typing import Any

import optuna
from torch import nn

from plait.fused.optim import (
    FusedAdagrad,
    FusedAdam,
    FusedAdamW,
    FusedOptimizer,
    FusedRMSprop,
    FusedSGD,
)
from plait.fused.sweep.space import SearchSpace, Space
from plait.workloads import DataInfo, Workload, get_workload

#: The data hyper-parameter: how many samples each model sees per step.
BATCH_SIZE = "batch_size"


class OptimizerKind(StrEnum):
    """The fused optimizers a sweep trains with (`plait.fused.optim`)."""

    SGD = "sgd"
    ADAM = "adam"
    ADAMW = "adamw"
    RMSPROP = "rmsprop"
    ADAGRAD = "adagrad"

    @property
    def cls(self) -> type[FusedOptimizer]:
        return _OPTIMIZERS[self]

    def options(self) -> dict[str, Any]:
        """The optimizer's hyper-parameters with their defaults."""
        return _options(self)

    def make(self, params: Any, per_model: Sequence[Mapping[str, Any]]) -> FusedOptimizer:
        """The optimizer of an array whose model b has hyper-parameters `per_model[b]`.

        Options no trial sets keep the optimizer's defaults; a trial without an option
        another trial sets gets the default for its model.
        """
        kwargs: dict[str, Any] = {}
        for name, default in self.options().items():
            if not any(name in p for p in per_model):
                continue
            values = [p.get(name, default) for p in per_model]
            if isinstance(default, bool):
                assert len(set(values)) == 1, f"{name} differs inside one array"
                kwargs[name] = values[0]
            else:
                kwargs[name] = values
        return self.cls(params, **kwargs)


_OPTIMIZERS: dict[OptimizerKind, type[FusedOptimizer]] = {
    OptimizerKind.SGD: FusedSGD,
    OptimizerKind.ADAM: FusedAdam,
    OptimizerKind.ADAMW: FusedAdamW,
    OptimizerKind.RMSPROP: FusedRMSprop,
    OptimizerKind.ADAGRAD: FusedAdagrad,
}

#: Learning-rate ranges of the flag-built space when none is given: SGD and Adagrad take
#: steps near 0.1, the adaptive optimizers near 1e-3.
DEFAULT_LR: dict[OptimizerKind, tuple[float, float]] = {
    OptimizerKind.SGD: (1e-3, 1.0),
    OptimizerKind.ADAM: (1e-4, 1e-1),
    OptimizerKind.ADAMW: (1e-4, 1e-1),
    OptimizerKind.RMSPROP: (1e-4, 1e-1),
    OptimizerKind.ADAGRAD: (1e-3, 1.0),
}


@cache
def _options(kind: OptimizerKind) -> dict[str, Any]:
    sig = inspect.signature(kind.cls.__init__)
    return {
        n: p.default
        for n, p in sig.parameters.items()
        if p.kind is inspect.Parameter.KEYWORD_ONLY and n != "num_models"
    }


def _hashable(value: Any) -> Any:
    if isinstance(value, list | tuple):
        return tuple(_hashable(v) for v in value)
    return value


def _builder_options(workload: Workload) -> set[str] | None:
    """Named options of the workload's model builder (None: it takes any keyword)."""
    try:
        sig = inspect.signature(workload.build)
    except (TypeError, ValueError):
        return None
    names = set(workload.arch)
    params = list(sig.parameters.values())
    for i, p in enumerate(params):
        if i == 0 and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            continue  # the DataInfo
        if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD):
            names.add(p.name)
    # A builder with **kwargs (the built-ins ignore unknown options) still only takes
    # the options it declares: anything else is a misspelt name, not a model option.
    return names


@dataclass(frozen=True, kw_only=True)
class SweepTask:
    """A registry workload with the space a sweep samples for it.

    Attributes:
        workload: the model, data, loss and metric (`plait.workloads`).
        space: ``space(trial) -> dict`` (default: `SearchSpace()`).
        fusible: model options that may differ inside one array because they change no
            shape (e.g. ``dropout`` when the workload's builder takes one).
    """

    workload: Workload
    space: Space = field(default_factory=SearchSpace)
    fusible: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return self.workload.name

    def suggest(self, trial: optuna.Trial) -> dict[str, Any]:
        """One trial's hyper-parameters, as a plain dict."""
        params = self.space(trial)
        if not isinstance(params, Mapping):
            raise ValueError(
                f"the search space returned {type(params).__name__}, not a dict of hyper-parameters"
            )
        return dict(params)

    def model_options(self, params: Mapping[str, Any], optimizer: OptimizerKind) -> dict[str, Any]:
        """The hyper-parameters the model builder takes."""
        opt = optimizer.options()
        return {k: v for k, v in params.items() if k not in opt and k != BATCH_SIZE}

    def check(self, params: Mapping[str, Any], optimizer: OptimizerKind) -> None:
        """ValueError naming a hyper-parameter no part of the sweep would use."""
        allowed = _builder_options(self.workload)
        if allowed is None:
            return
        opt = optimizer.options()
        for key, value in params.items():
            if not isinstance(key, str):
                raise ValueError(f"the search space returned a non-string name {key!r}")
            if key == BATCH_SIZE:
                if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                    raise ValueError(f"batch_size must be an integer >= 1, got {value!r}")
            elif key not in opt and key not in allowed:
                raise ValueError(
                    f"hyper-parameter {key!r} is not an option of the {optimizer.value} "
                    f"optimizer ({', '.join(opt)}), nor batch_size, nor a model option of "
                    f"workload {self.name!r} ({', '.join(sorted(allowed)) or 'none'})"
                )

    def partition_key(
        self, params: Mapping[str, Any], optimizer: OptimizerKind = OptimizerKind.SGD
    ) -> tuple[tuple[str, Any], ...]:
        """The non-fusible values: trials with equal keys can share an array."""
        opt = optimizer.options()
        switches = [k for k in params if k in opt and isinstance(opt[k], bool)]
        model = sorted(k for k in self.model_options(params, optimizer) if k not in self.fusible)
        keys = ([BATCH_SIZE] if BATCH_SIZE in params else []) + model + sorted(switches)
        return tuple((k, _hashable(params[k])) for k in keys)

    def build(
        self, info: DataInfo, params: Mapping[str, Any], optimizer: OptimizerKind
    ) -> nn.Module:
        """One trial's model."""
        return self.workload.model(info, **self.model_options(params, optimizer))


def sweep_task(
    workload: str | Workload | SweepTask,
    space: Space | None = None,
    *,
    fusible: Sequence[str] = (),
) -> SweepTask:
    """A `SweepTask` for a registry name, a factory spec or a `Workload`.

    Args:
        workload: ``digits-cnn``, ``pkg.module:factory``, ``file.py:factory``, a
            `Workload`, or a `SweepTask` (returned as is unless `space` replaces its space).
        space: the search space (default: `SearchSpace()`).
        fusible: model options that may differ inside one array.
    """
    if isinstance(workload, SweepTask):
        if space is None:
            return workload
        return SweepTask(workload=workload.workload, space=space, fusible=workload.fusible)
    return SweepTask(
        workload=get_workload(workload), space=space or SearchSpace(), fusible=tuple(fusible)
    )


def digits_task(name: str, space: Space | None = None) -> SweepTask:
    """`sweep_task` under its earlier name (any registry workload, not only digits)."""
    return sweep_task(name, space)


#: The earlier name of `SweepTask`.
ClassificationTask = SweepTask
