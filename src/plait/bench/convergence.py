"""Iterations to a target test accuracy: strategies compared on a workload's real data.

Each run is a `Trainer` (the loop of `plait train`) evaluated every few steps; runs are
grouped by strategy, each strategy's learning rates are swept, and every strategy is
judged at its best learning rate (the median over seeds of the steps it needs to reach
the target accuracy), so a second-order method is compared with a tuned first-order one at
the same batch size, not with a strawman.

    plait bench convergence --workload mlp --target 0.95 --steps 300 \\
        --run ssgd@0.03,0.1,0.3 --run spd-kfac:damping=0.01@0.01,0.03,0.1 --out DIR

Runs in one process on a process group of one (iterations, not time, are compared, and
the distributed K-FAC is tested to precondition exactly like a single process).
"""

from __future__ import annotations

import contextlib
import io
import sys
import warnings
from collections.abc import Sequence
from dataclasses import MISSING, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from plait.bench import suites
from plait.bench.core import Stats
from plait.bench.records import (
    ConvergenceReport,
    ConvergenceRun,
    ConvergenceSetting,
    ConvergenceSummary,
    RunMeta,
)
from plait.flags import option
from plait.records import pyplot, save_figure, write_report
from plait.train.config import TrainConfig
from plait.train.loop import Trainer
from plait.workloads import get_workload


@dataclass(frozen=True, kw_only=True)
class Run:
    """One training run of the comparison."""

    strategy: str
    lr: float
    seed: int

    @property
    def family(self) -> str:
        return self.strategy.partition(":")[0]


def steps_to(curve: list[dict[str, Any]], target: float) -> int | None:
    """The first evaluated step whose test accuracy reaches `target` (None: never)."""
    for point in curve:
        if point["test_accuracy"] >= target:
            return int(point["step"])
    return None


def run_one(
    run: Run, *, workload: str, steps: int, eval_every: int, batch_size: int | None
) -> list[dict[str, Any]]:
    cfg = TrainConfig(
        workload=workload,
        strategy=run.strategy,
        steps=steps,
        lr=run.lr,
        seed=run.seed,
        eval_every=eval_every,
        batch_size=batch_size,
        progress=False,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "modules left unpreconditioned", once per run
        trainer = Trainer(cfg)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            trainer.run()
        return trainer.state.curve
    finally:
        trainer.close()


def summarise(records: Sequence[ConvergenceRun], target: float) -> ConvergenceSummary:
    """Per (strategy, lr): median steps to target over seeds; per family: the best lr."""
    by_setting: dict[tuple[str, float], list[int | None]] = {}
    for r in records:
        by_setting.setdefault((r.strategy, r.lr), []).append(r.steps_to_target)
    settings = []
    for (strategy, lr), hits in by_setting.items():
        reached = [h for h in hits if h is not None]
        median = Stats.of(reached).median if reached and len(reached) == len(hits) else None
        settings.append(
            ConvergenceSetting(strategy=strategy, lr=lr, steps_to_target=hits, median=median)
        )
    best: dict[str, ConvergenceSetting] = {}
    for s in settings:
        if s.median is None:
            continue
        held = best.get(s.family)
        if held is None or held.median is None or s.median < held.median:
            best[s.family] = s
    return ConvergenceSummary(target=target, settings=settings, best=best)


def markdown(summary: ConvergenceSummary, *, baseline: str) -> str:
    lines = [
        f"Target test accuracy {summary.target:.2f}; steps to reach it per seed, median.",
        "",
        "| strategy | lr | steps per seed | median |",
        "|---|---|---|---|",
    ]
    for s in summary.settings:
        hits = ", ".join("-" if h is None else str(h) for h in s.steps_to_target)
        med = "not reached" if s.median is None else f"{s.median:g}"
        lines.append(f"| {s.strategy} | {s.lr:g} | {hits} | {med} |")
    best = summary.best
    base = best.get(baseline)
    if base is not None and base.median:
        head = f"| best per strategy | lr | median steps | vs {baseline} |"
        lines += ["", head, "|---|---|---|---|"]
        for s in best.values():
            assert s.median is not None  # only settings that reached the target are best
            ratio = s.median / base.median
            lines.append(f"| {s.strategy} | {s.lr:g} | {s.median:g} | {ratio:.2f}x |")
    return "\n".join(lines) + "\n"


def plot(records: Sequence[ConvergenceRun], summary: ConvergenceSummary, path: Path) -> None:
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for fam, best in summary.best.items():
        curves = [r.curve for r in records if r.strategy == best.strategy and r.lr == best.lr]
        steps = [p["step"] for p in curves[0]]
        acc = torch.tensor([[p["test_accuracy"] for p in c] for c in curves])
        mean = acc.mean(0)
        (line,) = ax.plot(steps, mean, label=f"{fam} (lr {best.lr:g}), mean of {len(curves)}")
        ax.fill_between(
            steps, acc.min(0).values, acc.max(0).values, alpha=0.2, color=line.get_color()
        )
        ax.axvline(best.median or 0.0, color=line.get_color(), linestyle=":", linewidth=1)
    ax.axhline(summary.target, color="grey", linestyle="--", linewidth=1, label="target")
    ax.set_xlabel("iteration")
    ax.set_ylabel("test accuracy")
    ax.set_ylim(max(0.0, summary.target - 0.35), 1.0)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    save_figure(fig, path, dpi=120)


def _parse_runs(specs: Sequence[str], seeds: list[int]) -> list[Run]:
    runs = []
    for spec in specs:
        strategy, at, lrs = spec.rpartition("@")
        if not at or not strategy:
            raise ValueError(f"--run {spec!r}: expected STRATEGY@LR[,LR...]")
        for lr in lrs.split(","):
            runs += [Run(strategy=strategy, lr=float(lr), seed=s) for s in seeds]
    return runs


def _init_single_process_group() -> None:
    if dist.is_initialized():
        return
    from plait.cluster.launch import free_port

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )


@dataclass(frozen=True, kw_only=True)
class ConvergenceConfig:
    """The command line of ``plait bench convergence`` (`plait.flags`).

    Attributes:
        workload: the workload trained on its real data.
        run: a strategy and its learning rates, ``STRATEGY@LR[,LR...]``; one per flag.
        target: the test accuracy each run is timed to.
        steps: training steps of every run.
        eval_every: steps between evaluations.
        batch_size: samples per step (default: the workload's training batch).
        seeds: the seeds of every (strategy, learning rate), comma-separated.
        baseline: the strategy the others are compared with.
        out: the report's folder (default: print the table only).
    """

    workload: str = option("mlp")
    run: tuple[str, ...] = option(MISSING, "STRATEGY@LR[,LR...]")
    target: float = option(0.95, "test accuracy to reach")
    steps: int = option(300)
    eval_every: int = option(5)
    batch_size: int | None = option(None)
    seeds: str = option("0,1,2")
    baseline: str = option("ssgd", "strategy the others are compared with")
    out: str | None = option(None)


def run_parsed(cfg: ConvergenceConfig, call: suites.Call) -> int:
    """Train every run, print the comparison and, with ``--out``, write the report."""
    seeds = [int(s) for s in cfg.seeds.split(",")]
    batch = cfg.batch_size or get_workload(cfg.workload).train_batch
    runs = _parse_runs(cfg.run, seeds)
    torch.set_num_threads(1)
    _init_single_process_group()
    records: list[ConvergenceRun] = []
    try:
        from tqdm import tqdm

        for run in tqdm(runs, desc="convergence", unit="run", file=sys.stdout):
            curve = run_one(
                run,
                workload=cfg.workload,
                steps=cfg.steps,
                eval_every=cfg.eval_every,
                batch_size=batch,
            )
            hit = steps_to(curve, cfg.target)
            records.append(
                ConvergenceRun(
                    strategy=run.strategy,
                    lr=run.lr,
                    seed=run.seed,
                    steps_to_target=hit,
                    curve=curve,
                )
            )
    finally:
        dist.destroy_process_group()
    summary = summarise(records, cfg.target)
    table = markdown(summary, baseline=cfg.baseline)
    print(table, end="")
    if cfg.out:
        command = call.command
        meta = RunMeta(workload=cfg.workload, batch_size=batch).stamped(command=command)
        report = ConvergenceReport(meta=meta, summary=summary, runs=records)
        write_report(
            Path(cfg.out),
            report.to_dict(),
            title="Convergence",
            command=command,
            body=table,
            plot=lambda path: plot(records, summary, path),
            indent=1,
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m plait.bench.convergence``: the suite ``convergence``
    (`plait.bench.suites`)."""
    return suites.main("convergence", argv)


if __name__ == "__main__":
    sys.exit(main())
