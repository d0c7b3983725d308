"""`plait sweep`: an Optuna sweep trained as horizontally fused arrays."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from plait.cli.common import (
    check_device,
    check_number,
    floats_arg,
    int_at_least,
    ints_arg,
    size_arg,
    writable_dir,
)


def add_parser(sub: Any) -> None:
    s = sub.add_parser(
        "sweep",
        help="hyper-parameter sweep with Optuna, trials trained as fused arrays",
        description="Ask Optuna for trials, train them N at a time as one fused array, "
        "report each trial's validation accuracy per epoch (pruned trials leave their "
        "array), tell Optuna the results.",
    )
    s.add_argument(
        "--workload",
        "--task",
        dest="workload",
        default="digits-cnn",
        help="the workload to sweep: a registry name (digits-cnn, digits-mlp, "
        "digits-transformer, ...) or a factory pkg.module:factory or "
        "path/to/file.py:factory (--task is the earlier name)",
    )
    s.add_argument(
        "--space",
        default=None,
        help="the search space: a suggest(trial) -> dict function "
        "(pkg.module:func or path/to/file.py:func) or a .json/.toml spec "
        "file; replaces --lr, --weight-decay, --momentum, --batch-sizes "
        "and --widths",
    )
    s.add_argument(
        "--optimizer",
        default="sgd",
        choices=["sgd", "adam", "adamw", "rmsprop", "adagrad"],
        help="the fused optimizer of every trial; its options (lr, momentum, "
        "betas, eps, ...) come per trial from the space",
    )
    s.add_argument(
        "--fusible",
        default="",
        help="model options that may differ inside one array because they "
        "change no shape, comma-separated (e.g. dropout)",
    )
    s.add_argument("--trials", type=int, default=32, help="trials in the study (all processes)")
    s.add_argument("--epochs", type=int, default=10, help="epochs per trial")
    s.add_argument("--study", default=None, help="Optuna study name (default: the workload's)")
    s.add_argument(
        "--storage",
        default=None,
        help="Optuna storage URL (default sqlite:///runs/plait-sweeps.db; "
        "e.g. postgresql://... to share a sweep between machines)",
    )
    s.add_argument(
        "--restart",
        action="store_true",
        help="delete an existing study of that name first (a fresh run)",
    )
    s.add_argument("--max-models", type=int, default=64, help="largest array to try")
    s.add_argument(
        "--memory-budget",
        type=size_arg,
        default=None,
        help="memory one array may use: 2GiB = 2*2^30 bytes, 2GB = 2*10^9 (default: half of free)",
    )
    s.add_argument(
        "--pruner",
        default="median",
        choices=["median", "asha", "none"],
        help="Optuna pruner that stops poor trials early",
    )
    s.add_argument(
        "--sampler",
        default="tpe",
        choices=["tpe", "random"],
        help="Optuna sampler that proposes trials",
    )
    s.add_argument(
        "--lr",
        type=floats_arg,
        default=None,
        help="learning-rate range LO,HI (default: 1e-3,1 for sgd and adagrad, "
        "1e-4,0.1 for adam, adamw and rmsprop)",
    )
    s.add_argument(
        "--weight-decay",
        type=floats_arg,
        default=None,
        help="weight-decay range LO,HI (default 1e-6,1e-2)",
    )
    s.add_argument(
        "--momentum",
        type=float,
        default=None,
        help="fixed momentum of sgd (default 0.9) or rmsprop (default 0)",
    )
    s.add_argument(
        "--batch-sizes",
        type=ints_arg,
        default=None,
        help="batch-size choices (non-fusible: one array per value; default 32)",
    )
    s.add_argument(
        "--widths",
        type=ints_arg,
        default=None,
        help="model-width choices (non-fusible: one array per value; default: "
        "the workload's own width)",
    )
    s.add_argument("--seed", type=int, default=0, help="seed of the sampler and the models")
    s.add_argument("--device", default="cpu", help="cpu or cuda")
    s.add_argument("--threads", type=int, default=None, help="intra-op threads")
    s.add_argument("--out", default=None, help="report directory (default runs/sweeps/STUDY)")
    s.add_argument("--no-progress", action="store_true", help="no progress bar")
    s.add_argument(
        "--default-malloc",
        action="store_true",
        help="keep glibc's malloc thresholds (default: raised)",
    )


def _sweep_space(args: argparse.Namespace) -> Any:
    """The sweep's search space: --space, or the one the range flags describe."""
    from plait.fused.sweep import DEFAULT_LR, OptimizerKind, SearchSpace, load_space

    if args.space is not None:
        return load_space(args.space)
    optimizer = OptimizerKind(args.optimizer)
    momentum = args.momentum
    if momentum is None and optimizer is OptimizerKind.SGD:
        momentum = 0.9
    return SearchSpace(
        lr=tuple(args.lr or DEFAULT_LR[optimizer]),
        weight_decay=tuple(args.weight_decay or (1e-6, 1e-2)),
        momentum=momentum,
        batch_sizes=args.batch_sizes or (32,),
        widths=args.widths,
    )


def _sweep_task(args: argparse.Namespace) -> Any:
    from plait.fused.sweep import sweep_task

    fusible = tuple(f.strip() for f in args.fusible.split(",") if f.strip())
    return sweep_task(args.workload, _sweep_space(args), fusible=fusible)


def validate(args: argparse.Namespace) -> None:
    from plait.fused.sweep import OptimizerKind, check_space

    given = [
        f"--{n.replace('_', '-')}"
        for n in ("lr", "weight_decay", "momentum", "batch_sizes", "widths")
        if getattr(args, n) is not None
    ]
    if args.space is not None and given:
        raise ValueError(
            f"--space describes the whole search space: drop {', '.join(given)} "
            "(or write them into the space)"
        )
    optimizer = OptimizerKind(args.optimizer)
    if args.momentum is not None and "momentum" not in optimizer.options():
        raise ValueError(
            f"--momentum: the {optimizer.value} optimizer has no momentum; "
            "use --optimizer sgd or rmsprop, or drop --momentum"
        )
    for flag in ("trials", "epochs", "max_models", "threads"):
        int_at_least(f"--{flag.replace('_', '-')}", getattr(args, flag), 1)
    for name in ("lr", "weight_decay"):
        lo_hi = getattr(args, name)
        flag = f"--{name.replace('_', '-')}"
        if lo_hi is not None and (len(lo_hi) != 2 or not 0 < lo_hi[0] <= lo_hi[1]):
            raise ValueError(
                f"{flag} takes a range LO,HI with 0 < LO <= HI, got {','.join(map(str, lo_hi))}"
            )
    check_number("--momentum", args.momentum, low=0)
    for flag, values in (("--batch-sizes", args.batch_sizes), ("--widths", args.widths)):
        if values is not None and any(v < 1 for v in values):
            raise ValueError(f"{flag} {','.join(map(str, values))}: expected integers >= 1")
    if args.study is not None and not args.study.strip():
        raise ValueError("--study: empty name")
    if args.storage is not None and "://" not in args.storage:
        raise ValueError(
            "--storage: expected a database URL such as sqlite:///runs/sweeps.db or "
            "postgresql://host/db"
        )
    check_device("--device", args.device)
    writable_dir("--out", args.out)
    # The workload and the space resolve here, in the parent, before any storage or
    # model exists: an unknown name, a factory that does not import, a space file that
    # does not parse or a hyper-parameter nothing takes fails with its name.
    from plait.workloads import WORKLOADS, is_factory_spec

    if not is_factory_spec(args.workload) and args.workload not in WORKLOADS:
        raise ValueError(
            f"--workload {args.workload!r}: unknown sweep task or workload; choose from "
            f"{', '.join(WORKLOADS)}, or give a factory pkg.module:factory or "
            "path/to/file.py:factory"
        )
    check_space(_sweep_task(args), optimizer)


def run(args: argparse.Namespace) -> int:
    import torch

    from plait.fused.sweep import OptimizerKind, PrunerKind, SamplerKind, SweepConfig
    from plait.fused.sweep import run_sweep as run
    from plait.fused.sweep.report import write_reports

    if args.threads:
        torch.set_num_threads(args.threads)
    if not args.default_malloc:
        from plait.fused.malloc import tune_malloc

        tune_malloc()
    task = _sweep_task(args)
    cfg = SweepConfig(
        trials=args.trials,
        epochs=args.epochs,
        study=args.study,
        storage=args.storage,
        max_models=args.max_models,
        memory_budget=args.memory_budget,
        pruner=PrunerKind(args.pruner),
        sampler=SamplerKind(args.sampler),
        optimizer=OptimizerKind(args.optimizer),
        seed=args.seed,
        device=args.device,
        progress=not args.no_progress,
    )
    if args.restart:
        from plait.fused.sweep.runner import delete_study

        delete_study(cfg.study or task.name, cfg.storage)
    result = run(task, cfg)
    out = Path(args.out or f"runs/sweeps/{result.study}")
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
