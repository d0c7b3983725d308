"""A fused Optuna sweep of your own model, with your own search space.

The model, its data and the search space are all defined in this file; plait trains the
trials N at a time as one fused array (one forward/backward pass for N models), with
per-model learning rates, betas and dropout, and reports each trial to Optuna.

    python examples/fused_sweep.py --trials 16 --epochs 5
    python examples/fused_sweep.py --trials 16 --optimizer sgd
    plait sweep --workload examples/fused_sweep.py:workload \
        --space examples/fused_sweep.py:suggest --optimizer adam --trials 16

A sweep is one process: under ``torchrun`` or ``plait run --nodes N`` only rank 0 sweeps
(the others would share its study through a database storage such as PostgreSQL; with
the default SQLite file, one process is the safe choice).
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import optuna
import torch
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import TensorDataset

from plait.fused.sweep import OptimizerKind, SweepConfig, run_sweep, sweep_task
from plait.workloads import DataInfo, DataSplit, Workload


class SmallConvNet(nn.Module):
    """The user's model: two convolutions and a classifier, with a width and a dropout."""

    def __init__(self, *, channels: int, dropout: float, num_classes: int) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, channels, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(channels, 2 * channels, 3, padding=1, stride=2),
            nn.ReLU(),
            nn.Flatten(),
        )
        self.drop = nn.Dropout(dropout)
        self.head = nn.Linear(2 * channels * 4 * 4, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.drop(self.features(x)))  # type: ignore[no-any-return]


def digits() -> DataSplit:
    """scikit-learn's 8x8 digits (bundled with scikit-learn: nothing downloads)."""
    x, y = load_digits(return_X_y=True)
    images = torch.tensor(x, dtype=torch.float32).view(-1, 1, 8, 8) / 16.0
    labels = torch.tensor(y, dtype=torch.long)
    cut = int(0.8 * len(labels))
    return DataSplit(
        train=TensorDataset(images[:cut], labels[:cut]),
        test=TensorDataset(images[cut:], labels[cut:]),
        info=DataInfo(input_shape=(1, 8, 8), num_classes=10),
        name="digits",
    )


def build(info: DataInfo, *, channels: int = 8, dropout: float = 0.0) -> nn.Module:
    return SmallConvNet(channels=channels, dropout=dropout, num_classes=info.num_classes)


def workload() -> Workload:
    """The workload factory: ``plait sweep --workload examples/fused_sweep.py:workload``."""
    return Workload(name="digits-convnet", build=build, real=digits, arch={"channels": 8})


def suggest(trial: optuna.Trial) -> dict[str, Any]:
    """The search space: one trial's hyper-parameters.

    ``lr``, ``betas`` (optimizer options) and ``dropout`` (listed as fusible below) may
    differ between the models of one array; ``channels`` and ``batch_size`` change shapes,
    so trials are grouped by them and each group trains as its own arrays.
    """
    return {
        "lr": trial.suggest_float("lr", 1e-4, 3e-2, log=True),
        "betas": (trial.suggest_float("beta1", 0.8, 0.95), 0.999),
        "dropout": trial.suggest_float("dropout", 0.0, 0.4),
        "channels": trial.suggest_categorical("channels", [8, 16]),
        "batch_size": 64,
    }


def suggest_sgd(trial: optuna.Trial) -> dict[str, Any]:
    """The same space for SGD, whose options are a momentum instead of betas."""
    params = suggest(trial)
    del params["betas"]
    params["lr"] = trial.suggest_float("lr_sgd", 1e-2, 0.5, log=True)
    params["momentum"] = 0.9
    return params


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=16)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--optimizer", default="adam", choices=["adam", "adamw", "sgd"])
    parser.add_argument("--storage", default=None, help="Optuna storage URL (default: SQLite)")
    parser.add_argument("--study", default=None, help="Optuna study (default: one per optimizer)")
    parser.add_argument("--max-models", type=int, default=16)
    args = parser.parse_args()
    if int(os.environ.get("RANK", "0")) != 0:
        return  # one sweeping process (see the module docstring)

    optimizer = OptimizerKind(args.optimizer)
    cfg = SweepConfig(
        trials=args.trials,
        epochs=args.epochs,
        study=args.study or f"fused-sweep-example-{args.optimizer}",
        storage=args.storage,
        max_models=args.max_models,
        optimizer=optimizer,
        sampler=optuna.samplers.TPESampler(seed=0, n_startup_trials=4),
        pruner=optuna.pruners.MedianPruner(n_startup_trials=4, n_warmup_steps=1),
        progress=False,
    )
    space = suggest_sgd if optimizer is OptimizerKind.SGD else suggest
    task = sweep_task(workload(), space, fusible=("dropout",))
    result = run_sweep(task, cfg)
    done = [r for r in result.records if r.state == "COMPLETE"]
    largest = max(result.capacities.values(), default=0)
    print(
        f"{len(result.records)} trials ({len(done)} complete) in {result.elapsed_s:.1f} s, "
        f"arrays of up to {largest} models"
    )
    best = result.best
    if best is not None:
        print(f"best: trial #{best.number}, held-out accuracy {best.value:.4f}, {best.params}")


if __name__ == "__main__":
    main()
