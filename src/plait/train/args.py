"""The flags of a training run, shared by `plait train` and the worker entry point.

`plait train` validates them in the parent and hands the resulting `TrainConfig` to every
node as JSON; ``python -m plait.train`` under a plain torchrun parses the same flags.
"""

from __future__ import annotations

import argparse

from plait.flags import add_options, values_of
from plait.train.config import TrainConfig


def add_train_args(p: argparse.ArgumentParser) -> None:
    """`TrainConfig`'s flags (`plait.flags`), and the launcher's restart budget."""
    add_options(p, TrainConfig)
    p.add_argument("--max-restarts", type=int, default=3, help="torchrun restarts after a failure")


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The `TrainConfig` the parsed flags describe (validated by its constructor)."""
    values = values_of(args, TrainConfig)
    values["progress"] = values.get("progress", True) and not getattr(args, "quiet", False)
    return TrainConfig(**values)
