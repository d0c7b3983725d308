"""`plait sweep`: an Optuna sweep trained as horizontally fused arrays."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from plait.cli.common import (
    check_device,
    check_number,
    floats_arg,
    int_at_least,
    ints_arg,
    size_arg,
    writable_dir,
)
from plait.flags import add_options, build, option

#: The range flags a search space (``--space``) replaces.
_RANGE_FLAGS = ("lr", "weight_decay", "momentum", "batch_sizes", "widths")


@dataclass(frozen=True, kw_only=True)
class SweepCommandConfig:
    """What `plait sweep` sweeps and how: the schema of its flags (`plait.flags`).

    The study's own settings become `plait.fused.sweep.SweepConfig` in `run_config`;
    this config is the command line's (the search space's ranges, the report folder,
    the process's malloc and threads besides). The constructor checks what the values
    alone decide (ValueError naming the flag); `validate` resolves the device, the
    workload and the space.

    Attributes:
        workload: the workload swept (a registry name or a factory).
        space: a search space function or spec file, replacing the range flags.
        optimizer: the fused optimizer of every trial.
        fusible: model options that may differ inside one array, comma-separated.
        trials: trials in the study.
        epochs: epochs per trial.
        study: the Optuna study's name (default: the workload's).
        storage: the Optuna storage URL (default: a local SQLite file).
        restart: delete an existing study of that name first.
        max_models: the largest array to try.
        memory_budget: bytes one array may use (default: half of the free memory).
        pruner: the Optuna pruner.
        sampler: the Optuna sampler.
        lr: the learning-rate range LO,HI (default: the optimizer's).
        weight_decay: the weight-decay range LO,HI.
        momentum: the fixed momentum of sgd or rmsprop.
        batch_sizes: batch-size choices.
        widths: model-width choices (default: the workload's own).
        seed: seed of the sampler and the models.
        device: cpu, cuda or cuda:N.
        threads: intra-op threads (default: torch's).
        out: the report folder (default: runs/sweeps/STUDY).
        progress: draw a progress bar.
        default_malloc: keep glibc's malloc thresholds.
    """

    workload: str = option(
        "digits-cnn",
        "the workload to sweep: a registry name (digits-cnn, digits-mlp, "
        "digits-transformer, ...) or a factory pkg.module:factory or "
        "path/to/file.py:factory (--task is the earlier name)",
        aliases=("--task",),
    )
    space: str | None = option(
        None,
        "the search space: a suggest(trial) -> dict function "
        "(pkg.module:func or path/to/file.py:func) or a .json/.toml spec "
        "file; replaces --lr, --weight-decay, --momentum, --batch-sizes "
        "and --widths",
    )
    optimizer: Literal["sgd", "adam", "adamw", "rmsprop", "adagrad"] = option(
        "sgd",
        "the fused optimizer of every trial; its options (lr, momentum, "
        "betas, eps, ...) come per trial from the space",
    )
    fusible: str = option(
        "",
        "model options that may differ inside one array because they "
        "change no shape, comma-separated (e.g. dropout)",
    )
    trials: int = option(32, "trials in the study (all processes)")
    epochs: int = option(10, "epochs per trial")
    study: str | None = option(None, "Optuna study name (default: the workload's)")
    storage: str | None = option(
        None,
        "Optuna storage URL (default sqlite:///runs/plait-sweeps.db; "
        "e.g. postgresql://... to share a sweep between machines)",
    )
    restart: bool = option(False, "delete an existing study of that name first (a fresh run)")
    max_models: int = option(64, "largest array to try")
    memory_budget: int | None = option(
        None,
        "memory one array may use: 2GiB = 2*2^30 bytes, 2GB = 2*10^9 (default: half of free)",
        parse=size_arg,
    )
    pruner: Literal["median", "asha", "none"] = option(
        "median", "Optuna pruner that stops poor trials early"
    )
    sampler: Literal["tpe", "random"] = option("tpe", "Optuna sampler that proposes trials")
    lr: tuple[float, ...] | None = option(
        None,
        "learning-rate range LO,HI (default: 1e-3,1 for sgd and adagrad, "
        "1e-4,0.1 for adam, adamw and rmsprop)",
        parse=floats_arg,
    )
    weight_decay: tuple[float, ...] | None = option(
        None, "weight-decay range LO,HI (default 1e-6,1e-2)", parse=floats_arg
    )
    momentum: float | None = option(
        None, "fixed momentum of sgd (default 0.9) or rmsprop (default 0)"
    )
    batch_sizes: tuple[int, ...] | None = option(
        None,
        "batch-size choices (non-fusible: one array per value; default 32)",
        parse=ints_arg,
    )
    widths: tuple[int, ...] | None = option(
        None,
        "model-width choices (non-fusible: one array per value; default: the workload's own width)",
        parse=ints_arg,
    )
    seed: int = option(0, "seed of the sampler and the models")
    device: str = option("cpu", "cpu or cuda")
    threads: int | None = option(None, "intra-op threads")
    out: str | None = option(None, "report directory (default runs/sweeps/STUDY)")
    progress: bool = option(True, "no progress bar")
    default_malloc: bool = option(False, "keep glibc's malloc thresholds (default: raised)")

    def __post_init__(self) -> None:
        from plait.fused.sweep import OptimizerKind

        given = [f"--{n.replace('_', '-')}" for n in _RANGE_FLAGS if getattr(self, n) is not None]
        if self.space is not None and given:
            raise ValueError(
                f"--space describes the whole search space: drop {', '.join(given)} "
                "(or write them into the space)"
            )
        optimizer = OptimizerKind(self.optimizer)
        if self.momentum is not None and "momentum" not in optimizer.options():
            raise ValueError(
                f"--momentum: the {optimizer.value} optimizer has no momentum; "
                "use --optimizer sgd or rmsprop, or drop --momentum"
            )
        for flag in ("trials", "epochs", "max_models", "threads"):
            int_at_least(f"--{flag.replace('_', '-')}", getattr(self, flag), 1)
        for name in ("lr", "weight_decay"):
            lo_hi = getattr(self, name)
            flag = f"--{name.replace('_', '-')}"
            if lo_hi is not None and (len(lo_hi) != 2 or not 0 < lo_hi[0] <= lo_hi[1]):
                raise ValueError(
                    f"{flag} takes a range LO,HI with 0 < LO <= HI, got {','.join(map(str, lo_hi))}"
                )
        check_number("--momentum", self.momentum, low=0)
        for flag, values in (("--batch-sizes", self.batch_sizes), ("--widths", self.widths)):
            if values is not None and any(v < 1 for v in values):
                raise ValueError(f"{flag} {','.join(map(str, values))}: expected integers >= 1")
        if self.study is not None and not self.study.strip():
            raise ValueError("--study: empty name")
        if self.storage is not None and "://" not in self.storage:
            raise ValueError(
                "--storage: expected a database URL such as sqlite:///runs/sweeps.db or "
                "postgresql://host/db"
            )


def add_parser(sub: Any) -> None:
    s = sub.add_parser(
        "sweep",
        help="hyper-parameter sweep with Optuna, trials trained as fused arrays",
        description="Ask Optuna for trials, train them N at a time as one fused array, "
        "report each trial's validation accuracy per epoch (pruned trials leave their "
        "array), tell Optuna the results.",
    )
    add_options(s, SweepCommandConfig)


def _sweep_space(cfg: SweepCommandConfig) -> Any:
    """The sweep's search space: --space, or the one the range flags describe."""
    from plait.fused.sweep import DEFAULT_LR, OptimizerKind, SearchSpace, load_space

    if cfg.space is not None:
        return load_space(cfg.space)
    optimizer = OptimizerKind(cfg.optimizer)
    momentum = cfg.momentum
    if momentum is None and optimizer is OptimizerKind.SGD:
        momentum = 0.9
    lr_lo, lr_hi = cfg.lr or DEFAULT_LR[optimizer]  # two values: the constructor checked
    wd_lo, wd_hi = cfg.weight_decay or (1e-6, 1e-2)
    return SearchSpace(
        lr=(lr_lo, lr_hi),
        weight_decay=(wd_lo, wd_hi),
        momentum=momentum,
        batch_sizes=cfg.batch_sizes or (32,),
        widths=cfg.widths,
    )


def _sweep_task(cfg: SweepCommandConfig) -> Any:
    from plait.fused.sweep import sweep_task

    fusible = tuple(f.strip() for f in cfg.fusible.split(",") if f.strip())
    return sweep_task(cfg.workload, _sweep_space(cfg), fusible=fusible)


def validate(args: argparse.Namespace) -> None:
    from plait.fused.sweep import OptimizerKind, check_space

    cfg = build(args, SweepCommandConfig)
    check_device("--device", cfg.device)
    writable_dir("--out", cfg.out)
    # The workload and the space resolve here, in the parent, before any storage or
    # model exists: an unknown name, a factory that does not import, a space file that
    # does not parse or a hyper-parameter nothing takes fails with its name.
    from plait.workloads import WORKLOADS, is_factory_spec

    if not is_factory_spec(cfg.workload) and cfg.workload not in WORKLOADS:
        raise ValueError(
            f"--workload {cfg.workload!r}: unknown sweep task or workload; choose from "
            f"{', '.join(WORKLOADS)}, or give a factory pkg.module:factory or "
            "path/to/file.py:factory"
        )
    check_space(_sweep_task(cfg), OptimizerKind(cfg.optimizer))


def run(args: argparse.Namespace) -> int:
    return run_config(build(args, SweepCommandConfig))


def run_config(command: SweepCommandConfig) -> int:
    """Run the sweep `command` describes (as the study's `SweepConfig`) and write its
    report."""
    import torch

    from plait.fused.sweep import OptimizerKind, PrunerKind, SamplerKind, SweepConfig
    from plait.fused.sweep import run_sweep as run
    from plait.fused.sweep.report import write_reports

    if command.threads:
        torch.set_num_threads(command.threads)
    if not command.default_malloc:
        from plait.fused.malloc import tune_malloc

        tune_malloc()
    task = _sweep_task(command)
    cfg = SweepConfig(
        trials=command.trials,
        epochs=command.epochs,
        study=command.study,
        storage=command.storage,
        max_models=command.max_models,
        memory_budget=command.memory_budget,
        pruner=PrunerKind(command.pruner),
        sampler=SamplerKind(command.sampler),
        optimizer=OptimizerKind(command.optimizer),
        seed=command.seed,
        device=command.device,
        progress=command.progress,
    )
    if command.restart:
        from plait.fused.sweep.runner import delete_study

        delete_study(cfg.study or task.name, cfg.storage)
    result = run(task, cfg)
    out = Path(command.out or f"runs/sweeps/{result.study}")
    paths = write_reports(result, cfg, task.name, out)
    best = result.best
    states = [r.state for r in result.records]
    print(
        f"plait sweep: {len(states)} trials in {result.elapsed_s:.0f} s "
        f"({states.count('COMPLETE')} complete, {states.count('PRUNED')} pruned, "
        f"{states.count('FAIL')} failed); study {result.study!r} in {result.storage}"
    )
    if best is not None:
        print(f"best: trial #{best.number}, validation accuracy {best.value:.4f}, {best.params}")
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0
