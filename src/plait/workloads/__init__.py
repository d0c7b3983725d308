"""Workloads: a model family with its data, loss, metric and defaults, in ONE registry.

Every command (`train`, `bench`, `crossover`, `plan`, `sweep`, `bench-fused`) takes
``--workload NAME`` or a user factory, ``pkg.module:factory`` or ``path/to/file.py:factory``,
returning a `Workload`. The built-ins are registered instances of the same class.
"""

from __future__ import annotations

from plait.workloads.base import (
    Batch,
    DataInfo,
    DataSplit,
    Task,
    Workload,
    accuracy,
    default_loss,
    logits_of,
)
from plait.workloads.registry import (
    WORKLOADS,
    get_workload,
    is_factory_spec,
    load_factory,
    register,
)

__all__ = [
    "WORKLOADS",
    "Batch",
    "DataInfo",
    "DataSplit",
    "Task",
    "Workload",
    "accuracy",
    "default_loss",
    "get_workload",
    "is_factory_spec",
    "load_factory",
    "logits_of",
    "register",
]
