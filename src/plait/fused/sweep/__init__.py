"""Fused hyper-parameter sweeps: Optuna trials trained as fused arrays.

A sweep takes a registry workload (`plait.workloads`: a built-in name or a user factory),
a search space (`SearchSpace`, a `SpecSpace` file, or any ``suggest(trial) -> dict``),
one of plait's fused optimizers and an Optuna sampler and pruner (by name or as objects).
"""

from __future__ import annotations

from plait.fused.sweep.capacity import largest_fitting, step_memory
from plait.fused.sweep.runner import (
    PrunerKind,
    SamplerKind,
    SweepConfig,
    SweepResult,
    TrialRecord,
    check_space,
    recover_interrupted,
    run_sweep,
    train_array,
)
from plait.fused.sweep.space import SearchSpace, Space, SpecSpace, load_space, read_spec
from plait.fused.sweep.storage import mask_url
from plait.fused.sweep.task import (
    DEFAULT_LR,
    ClassificationTask,
    OptimizerKind,
    SweepTask,
    digits_task,
    sweep_task,
)

__all__ = [
    "DEFAULT_LR",
    "ClassificationTask",
    "OptimizerKind",
    "PrunerKind",
    "SamplerKind",
    "SearchSpace",
    "Space",
    "SpecSpace",
    "SweepConfig",
    "SweepResult",
    "SweepTask",
    "TrialRecord",
    "check_space",
    "digits_task",
    "largest_fitting",
    "load_space",
    "mask_url",
    "read_spec",
    "recover_interrupted",
    "run_sweep",
    "step_memory",
    "sweep_task",
    "train_array",
]
