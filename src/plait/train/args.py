"""The flags of a training run, shared by `plait train` and the worker entry point.

`plait train` validates them in the parent and hands the resulting `TrainConfig` to every
node as JSON; ``python -m plait.train`` under a plain torchrun parses the same flags.
"""

from __future__ import annotations

import argparse
from dataclasses import fields

from plait.train.config import OPTIMIZERS, TrainConfig


def add_train_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--workload",
        default="mlp",
        help="a registered workload (mlp, resnet18, vgg, gpt, digits-mlp, ...) or a "
        "factory, pkg.module:factory or path/to/file.py:factory",
    )
    p.add_argument("--strategy", default="ssgd", help="strategy spec, e.g. ssgd or acpsgd:rank=4")
    p.add_argument(
        "--data",
        default="real",
        choices=["real", "synthetic"],
        help="the workload's bundled real data, or synthetic data of its shapes",
    )
    n = p.add_mutually_exclusive_group()
    n.add_argument(
        "--epochs", type=int, default=None, help="passes over the data (default: the workload's)"
    )
    n.add_argument("--steps", type=int, default=None, help="optimizer steps (instead of epochs)")
    p.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="per-worker batch size (default: the workload's)",
    )
    p.add_argument("--accumulate", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--lr", type=float, default=None, help="learning rate (default: the workload's)")
    p.add_argument(
        "--optimizer",
        default=None,
        choices=list(OPTIMIZERS),
        help="optimizer (default: the workload's); muon: torch.optim.Muon for the weight "
        "matrices, AdamW for the rest; muon-fp32: the same in float32 (CPUs without bf16)",
    )
    p.add_argument("--momentum", type=float, default=0.9, help="SGD momentum")
    p.add_argument("--weight-decay", type=float, default=0.0, help="weight decay")
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of the initial weights, data order and compressors",
    )
    p.add_argument("--checkpoint", default=None, help="checkpoint directory (resumes from it)")
    p.add_argument("--checkpoint-every", type=int, default=0, help="steps between checkpoints")
    p.add_argument("--max-restarts", type=int, default=3, help="torchrun restarts after a failure")
    p.add_argument("--trace", default=None, help="write a merged Chrome trace here")
    p.add_argument("--out", default=None, help="write the run's metrics (JSON) here")
    p.add_argument(
        "--tensorboard",
        default=None,
        metavar="DIR",
        help="also write rank 0's scalars (loss, held-out metrics, throughput, bytes per "
        "step) as TensorBoard events here",
    )
    p.add_argument(
        "--eval-every",
        type=int,
        default=0,
        help="also evaluate every K steps (a learning curve in --out)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(
        "--crossover",
        default=None,
        metavar="GROUP",
        help="share each device's compute token with co-located jobs of GROUP",
    )
    p.add_argument(
        "--plan",
        default=None,
        help="n-D parallel plan, e.g. dp=2,tp=2,zero=3 or pp=4,schedule=interleaved, or auto "
        "(--strategy then names the data axis's compressor)",
    )
    p.add_argument(
        "--memory",
        default=None,
        help="memory per device for --plan auto: 2GiB = 2*2^30 bytes, 2GB = 2*10^9",
    )


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The `TrainConfig` the parsed flags describe (validated by its constructor)."""
    names = {f.name for f in fields(TrainConfig)}
    values = {k: v for k, v in vars(args).items() if k in names}
    values["progress"] = not args.no_progress and not getattr(args, "quiet", False)
    return TrainConfig(**values)
