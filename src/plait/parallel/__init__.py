"""n-D parallelism: one `Plan` over data, tensor, sequence and pipeline axes, and a planner.

`parallelize(model, optimizer, plan)` applies a plan (`plait.parallel.entry`, over the
mechanism of `plait.parallel.api`); models join through adapters (`plait.parallel.adapters`,
chosen by `plait.parallel.resolve`); `plait.parallel.planner` chooses plans and
`plait.parallel.checkpoint` saves and reloads them across plans. The engines (DTensor,
FSDP2, pipelining) load on first use of those, so importing the plan types stays cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from plait._lazy import lazy_getattr
from plait.parallel.plan import Plan, Schedule, ZeroStage

if TYPE_CHECKING:
    from plait.parallel.adapters import ModelAdapter, ModelDims, register_adapter
    from plait.parallel.api import ParallelModel, cross_entropy
    from plait.parallel.entry import parallelize
    from plait.parallel.resolve import adapter_for

__all__ = [
    "ModelAdapter",
    "ModelDims",
    "ParallelModel",
    "Plan",
    "Schedule",
    "ZeroStage",
    "adapter_for",
    "cross_entropy",
    "parallelize",
    "register_adapter",
]

_LAZY = {
    "ModelAdapter": "plait.parallel.adapters",
    "ModelDims": "plait.parallel.adapters",
    "adapter_for": "plait.parallel.resolve",
    "register_adapter": "plait.parallel.adapters",
    "ParallelModel": "plait.parallel.api",
    "cross_entropy": "plait.parallel.api",
    "parallelize": "plait.parallel.entry",
}

__getattr__ = lazy_getattr(__name__, _LAZY)
