"""The training loop, its checkpoints and the strategy registry.

`Trainer` (or `train`) runs a `TrainConfig` under any registered strategy; the adapters
in `plait.train.strategies` register the five systems' strategies by name.

The names below are imported on first use: the command line reads `plait.train.config`
and `plait.train.args` to build its flags, and importing them must not import torch
(``plait --help`` would wait 1.3 s for it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from plait._lazy import lazy_getattr
from plait.specs import parse_spec
from plait.train.config import StrategyChoice, TrainConfig

if TYPE_CHECKING:
    from plait.train.checkpoint import Checkpointer
    from plait.train.loop import Trainer, train
    from plait.train.strategy import (
        Strategy,
        available_strategies,
        make_strategy,
        register_strategy,
    )

__all__ = [
    "Checkpointer",
    "Strategy",
    "StrategyChoice",
    "TrainConfig",
    "Trainer",
    "available_strategies",
    "make_strategy",
    "parse_spec",
    "register_strategy",
    "train",
]

_LAZY = {
    "Checkpointer": "plait.train.checkpoint",
    "Trainer": "plait.train.loop",
    "train": "plait.train.loop",
    "Strategy": "plait.train.strategy",
    "available_strategies": "plait.train.strategy",
    "make_strategy": "plait.train.strategy",
    "register_strategy": "plait.train.strategy",
}

__getattr__ = lazy_getattr(__name__, _LAZY)
