"""`plait race`: time to a held-out target, strategies interleaved on one cluster."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from plait.bench.protocol import DEFAULT_SEEDS, METRICS
from plait.cli.common import (
    CLUSTER_GROUP,
    ClusterConfig,
    check_backend,
    check_number,
    int_at_least,
    ints_arg,
    workload_list,
    writable_dir,
)
from plait.flags import add_options, build, nested, option
from plait.specs import split_specs
from plait.train.config import OPTIMIZERS


@dataclass(frozen=True, kw_only=True)
class RaceConfig:
    """What `plait race` races, or which finished race it reports: the schema of its
    flags (`plait.flags`).

    The constructor checks what the values alone decide (ValueError naming the flag);
    `validate` checks the rest (the entries, the workload, the folders). With `report`
    nothing trains, so the training flags go unchecked, as they go unused.

    Attributes:
        workload: the workload raced (one, with a held-out split).
        strategies: the entries, ``SPEC[+OPTIMIZER][@LR]``, comma-separated.
        target: the held-out value to reach (required unless `report`).
        metric: ``accuracy`` (reach at least `target`) or ``loss`` (at most).
        seeds: one run per entry per seed.
        max_steps: step budget per run.
        eval_every: steps between held-out evaluations.
        chunk: steps an entry trains before the next entry's turn.
        batch_size: per-worker batch size (default: the workload's).
        optimizer: optimizer of entries without ``+OPTIMIZER`` (default: the workload's).
        lr: learning rates of entries without ``@LR``: ``LR`` or ``LABEL=LR`` each.
        full_budget: train on to the budget after the target.
        out: output directory, None for none.
        progress: draw a progress bar.
        compare: ratios of entries' times to report, ``A/B;C/D``.
        report: train nothing: re-read this finished race and rewrite its report.
        merge: finished races pooled into `report`'s.
        cluster: the emulated cluster the race runs on.
    """

    workload: str = option(
        "mlp",
        "a workload with a held-out split (mlp, digits-cnn, resnet18, gpt, ...) "
        "or a factory pkg.module:factory",
    )
    strategies: str = option(
        "ssgd+sgd,ssgd+adamw",
        "entries SPEC[+OPTIMIZER][@LR], comma-separated (; between entries "
        "whose options hold commas), e.g. 'ssgd+sgd@0.1,acpsgd:rank=4+sgd@0.1,"
        "ssgd+muon@0.01,spd-kfac+sgd@0.05'",
    )
    target: float | None = option(
        None,
        "held-out value to reach: accuracy 0.95, or a loss with --metric loss "
        "(required, except with --report)",
    )
    metric: str = option(
        "accuracy",
        "accuracy (reach at least --target) or loss (at most --target)",
        choices=tuple(METRICS),
    )
    seeds: tuple[int, ...] = option(
        DEFAULT_SEEDS,
        "one run per entry per seed, medians over them and bootstrap intervals on "
        "every ratio (default: five seeds, the fewest that make a verdict)",
        parse=ints_arg,
    )
    max_steps: int = option(500, "step budget per run")
    eval_every: int = option(10, "steps between held-out evaluations (excluded from the time)")
    chunk: int = option(10, "steps an entry trains before the next entry's turn")
    batch_size: int | None = option(None, "per-worker batch size")
    optimizer: str | None = option(
        None,
        "optimizer of entries without +OPTIMIZER (default: the workload's); "
        "muon: torch.optim.Muon for the matrices, AdamW for the rest; "
        "muon-fp32: the same in float32 (CPUs without bf16)",
        choices=OPTIMIZERS,
    )
    lr: tuple[str, ...] = option(
        (),
        "learning rate of entries without @LR: a number for all, or "
        "SPEC[+OPTIMIZER]=LR for one (repeatable); default: the workload's",
        metavar="LR|LABEL=LR",
    )
    full_budget: bool = option(
        False,
        "train on to the budget after the target (final metrics at equal "
        "steps); by default a run stops at its target",
    )
    out: str | None = option(None, "output directory (results.json/.md/.png)")
    progress: bool = option(True, "no progress bar")
    compare: str = option(
        "",
        "also report these ratios of entries' median times to target, each with its "
        "bootstrap interval and verdict (labels as the table names them)",
        metavar="A/B;C/D",
    )
    report: str | None = option(
        None,
        "train nothing: re-read DIR/results.json, add the intervals and verdicts (and "
        "--compare's ratios) and rewrite DIR/results.md",
        metavar="DIR",
    )
    merge: tuple[str, ...] = option(
        (),
        "with --report: pool DIR's runs (the same entries and settings, other seeds) "
        "into --report's race, and rewrite it (repeatable)",
        metavar="DIR",
    )
    cluster: ClusterConfig = nested(ClusterConfig, group=CLUSTER_GROUP)

    def __post_init__(self) -> None:
        if self.report:
            return
        if self.merge:
            raise ValueError("--merge pools finished races: it needs --report DIR")
        if self.target is None:
            raise ValueError(
                "--target is required (a held-out accuracy, or a loss with --metric loss)"
            )
        for flag in ("max_steps", "eval_every", "chunk", "batch_size"):
            int_at_least(f"--{flag.replace('_', '-')}", getattr(self, flag), 1)
        check_number("--target", self.target, low=-math.inf)
        if self.metric == "accuracy":
            check_number("--target", self.target, low=0, high=1, low_open=True)
        if len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"--seeds {','.join(map(str, self.seeds))}: a seed given twice")


def add_parser(sub: Any) -> None:
    ra = sub.add_parser(
        "race",
        help="time to a held-out target: strategies and optimizers raced on one cluster",
        description="Train every entry from the same seed and initial weights on the "
        "workload's real data to a held-out target, interleaved a chunk of steps at a time "
        "in one job on the emulated cluster; report training time (evaluation excluded) and "
        "steps to the target, the final metric and the bytes sent, median over seeds "
        "[min-max]; write results.json, results.md and results.png to --out.",
    )
    add_options(ra, RaceConfig)


def _race_spec(cfg: RaceConfig) -> Any:
    """The `plait.bench.race.RaceSpec` the flags describe (entries, optimizers and rates
    parsed, every strategy spec checked by `TrainConfig`)."""
    from plait.bench.race import RaceSpec, parse_entry, parse_lr_map

    default_lr, lrs = parse_lr_map(cfg.lr)
    texts = split_specs(cfg.strategies)
    if not texts:
        raise ValueError("--strategies: no entry given; e.g. ssgd+sgd@0.1,ssgd+adamw@1e-3")
    entries = [parse_entry(t, optimizer=cfg.optimizer, lrs=lrs, lr=default_lr) for t in texts]
    labels = {e.label for e in entries} | {e.spec for e in entries}
    unknown = sorted(set(lrs) - labels)
    if unknown:
        raise ValueError(
            f"--lr {unknown[0]}=...: no such entry; entries are "
            + ", ".join(e.label for e in entries)
        )
    assert cfg.target is not None  # the constructor requires one, --report aside
    return RaceSpec(
        workload=cfg.workload,
        entries=entries,
        target=cfg.target,
        metric=cfg.metric,
        seeds=list(cfg.seeds),
        max_steps=cfg.max_steps,
        eval_every=cfg.eval_every,
        chunk=cfg.chunk,
        batch_size=cfg.batch_size,
        full_budget=cfg.full_budget,
        bandwidth=cfg.cluster.bandwidth or "",
    )


def validate(args: argparse.Namespace) -> None:
    from plait.bench.race import compare, merge, parse_pairs, read_results

    cfg = build(args, RaceConfig)
    pairs = parse_pairs(cfg.compare)
    if cfg.report:
        results = Path(cfg.report) / "results.json"
        if not results.is_file():
            raise ValueError(f"--report {cfg.report!r}: no results.json there")
        old = read_results(results)
        parts = [old]
        for d in cfg.merge:
            other = Path(d) / "results.json"
            if not other.is_file():
                raise ValueError(f"--merge {d!r}: no results.json there")
            parts.append(read_results(other))
        if cfg.merge:
            old = merge(parts)  # other entries or settings, or a seed twice, fail here
        for a, b in pairs:
            compare(old, a, b)  # unknown labels fail here, in one line
        return
    args.placement = cfg.cluster.placement()  # the entries' backend, checked below
    writable_dir("--out", cfg.out)
    workload_list(cfg.workload)
    if "," in cfg.workload:
        raise ValueError(f"--workload {cfg.workload!r}: a race takes one workload")
    spec = _race_spec(cfg)
    labels = {e.label for e in spec.entries}
    for pair in pairs:
        unknown = [x for x in pair if x not in labels]
        if unknown:
            raise ValueError(
                f"--compare: no entry {unknown[0]!r}; entries: {', '.join(sorted(labels))}"
            )
    from plait.train.strategy import Strategy, make_strategy
    from plait.workloads import get_workload

    wl = get_workload(spec.workload)
    if wl.real().test is None:
        raise ValueError(f"--workload {spec.workload!r}: its real data has no held-out split")
    model = None
    for e in spec.entries:  # plan degrees against the world and the real model
        strategy = make_strategy(e.spec)
        try:
            check_backend(strategy, args)
            if type(strategy).check is not Strategy.check:
                model = model or wl.model(wl.real().info)
                strategy.check(model, world=cfg.cluster.world)
        finally:
            strategy.close()


def run(args: argparse.Namespace) -> int:
    return run_config(build(args, RaceConfig))


def run_config(cfg: RaceConfig) -> int:
    """Run the race `cfg` describes, or rewrite the report of the finished one it names."""
    from plait.bench.race import (
        annotate,
        markdown,
        merge,
        parse_pairs,
        read_results,
        run_race,
        write_reports,
    )

    pairs = parse_pairs(cfg.compare)
    if cfg.report:
        folder = Path(cfg.report)
        old = annotate(read_results(folder / "results.json"))
        if cfg.merge:
            old = merge([old, *(read_results(Path(d) / "results.json") for d in cfg.merge)])
        write_reports(old, folder, pairs)
        print(markdown(old, pairs), end="")
        print(f"rewrote {folder / 'results.md'} and {folder / 'results.png'}")
        return 0
    spec = _race_spec(cfg)
    cluster = cfg.cluster
    out = Path(cfg.out) if cfg.out else None
    print(
        f"plait race: {spec.workload} on {cluster.nodes} node(s) x {cluster.nproc_per_node}, "
        f"{cluster.bandwidth or 'unshaped'}: {', '.join(e.label for e in spec.entries)}; "
        f"seeds {', '.join(map(str, spec.seeds))}",
        flush=True,
    )
    results = run_race(
        spec,
        nodes=cluster.nodes,
        nproc_per_node=cluster.nproc_per_node,
        latency=cluster.latency,
        loss=cluster.loss,
        threads=cluster.threads,
        out=out,
        timeout_s=cluster.timeout or 6 * 3600,
        progress=cfg.progress,
        compare_pairs=pairs,
    )
    print(markdown(results, pairs), end="")
    if out is not None:
        print(f"wrote {out / 'results.json'}, {out / 'results.md'}, {out / 'results.png'}")
    return 0
