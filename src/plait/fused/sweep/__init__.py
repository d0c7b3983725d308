"""Fused hyper-parameter sweeps: Optuna trials trained as fused arrays."""

from __future__ import annotations

from plait.fused.sweep.capacity import largest_fitting, step_memory
from plait.fused.sweep.runner import (
    PrunerKind,
    SamplerKind,
    SweepConfig,
    SweepResult,
    TrialRecord,
    recover_interrupted,
    run_sweep,
    train_array,
)
from plait.fused.sweep.storage import mask_url
from plait.fused.sweep.task import TASK_NAMES, ClassificationTask, SearchSpace, digits_task

__all__ = [
    "TASK_NAMES",
    "ClassificationTask",
    "PrunerKind",
    "SamplerKind",
    "SearchSpace",
    "SweepConfig",
    "SweepResult",
    "TrialRecord",
    "digits_task",
    "largest_fitting",
    "mask_url",
    "recover_interrupted",
    "run_sweep",
    "step_memory",
    "train_array",
]
