"""The training loop, its checkpoints and the strategy registry.

`Trainer` (or `train`) runs a `TrainConfig` under any registered strategy; the adapters
in `plait.train.strategies` register the five systems' strategies by name.
"""

from __future__ import annotations

from plait.specs import parse_spec
from plait.train.checkpoint import Checkpointer
from plait.train.loop import TrainConfig, Trainer, train
from plait.train.strategy import (
    Strategy,
    available_strategies,
    make_strategy,
    register_strategy,
)

__all__ = [
    "Checkpointer",
    "Strategy",
    "TrainConfig",
    "Trainer",
    "available_strategies",
    "make_strategy",
    "parse_spec",
    "register_strategy",
    "train",
]
