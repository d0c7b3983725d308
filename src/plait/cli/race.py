"""`plait race`: time to a held-out target, strategies interleaved on one cluster."""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

from plait.cli.common import (
    add_cluster_args,
    check_backend,
    check_cluster_args,
    check_number,
    int_at_least,
    ints_arg,
    workload_list,
    writable_dir,
)
from plait.specs import split_specs


def add_parser(sub: Any) -> None:
    from plait.bench.protocol import DEFAULT_SEEDS, METRICS
    from plait.train.config import OPTIMIZERS

    ra = sub.add_parser(
        "race",
        help="time to a held-out target: strategies and optimizers raced on one cluster",
        description="Train every entry from the same seed and initial weights on the "
        "workload's real data to a held-out target, interleaved a chunk of steps at a time "
        "in one job on the emulated cluster; report training time (evaluation excluded) and "
        "steps to the target, the final metric and the bytes sent, median over seeds "
        "[min-max]; write results.json, results.md and results.png to --out.",
    )
    ra.add_argument(
        "--workload",
        default="mlp",
        help="a workload with a held-out split (mlp, digits-cnn, resnet18, gpt, ...) "
        "or a factory pkg.module:factory",
    )
    ra.add_argument(
        "--strategies",
        default="ssgd+sgd,ssgd+adamw",
        help="entries SPEC[+OPTIMIZER][@LR], comma-separated (; between entries "
        "whose options hold commas), e.g. 'ssgd+sgd@0.1,acpsgd:rank=4+sgd@0.1,"
        "ssgd+muon@0.01,spd-kfac+sgd@0.05'",
    )
    ra.add_argument(
        "--target",
        type=float,
        default=None,
        help="held-out value to reach: accuracy 0.95, or a loss with --metric loss "
        "(required, except with --report)",
    )
    ra.add_argument(
        "--metric",
        default="accuracy",
        choices=list(METRICS),
        help="accuracy (reach at least --target) or loss (at most --target)",
    )
    ra.add_argument(
        "--seeds",
        type=ints_arg,
        default=DEFAULT_SEEDS,
        help="one run per entry per seed, medians over them and bootstrap intervals on "
        "every ratio (default: five seeds, the fewest that make a verdict)",
    )
    ra.add_argument("--max-steps", type=int, default=500, help="step budget per run")
    ra.add_argument(
        "--eval-every",
        type=int,
        default=10,
        help="steps between held-out evaluations (excluded from the time)",
    )
    ra.add_argument(
        "--chunk", type=int, default=10, help="steps an entry trains before the next entry's turn"
    )
    ra.add_argument("--batch-size", type=int, default=None, help="per-worker batch size")
    ra.add_argument(
        "--optimizer",
        default=None,
        choices=list(OPTIMIZERS),
        help="optimizer of entries without +OPTIMIZER (default: the workload's); "
        "muon: torch.optim.Muon for the matrices, AdamW for the rest; "
        "muon-fp32: the same in float32 (CPUs without bf16)",
    )
    ra.add_argument(
        "--lr",
        action="append",
        default=[],
        metavar="LR|LABEL=LR",
        help="learning rate of entries without @LR: a number for all, or "
        "SPEC[+OPTIMIZER]=LR for one (repeatable); default: the workload's",
    )
    ra.add_argument(
        "--full-budget",
        action="store_true",
        help="train on to the budget after the target (final metrics at equal "
        "steps); by default a run stops at its target",
    )
    ra.add_argument("--out", default=None, help="output directory (results.json/.md/.png)")
    ra.add_argument("--no-progress", action="store_true", help="no progress bar")
    ra.add_argument(
        "--compare",
        default="",
        metavar="A/B;C/D",
        help="also report these ratios of entries' median times to target, each with its "
        "bootstrap interval and verdict (labels as the table names them)",
    )
    ra.add_argument(
        "--report",
        default=None,
        metavar="DIR",
        help="train nothing: re-read DIR/results.json, add the intervals and verdicts (and "
        "--compare's ratios) and rewrite DIR/results.md",
    )
    ra.add_argument(
        "--merge",
        action="append",
        default=[],
        metavar="DIR",
        help="with --report: pool DIR's runs (the same entries and settings, other seeds) "
        "into --report's race, and rewrite it (repeatable)",
    )
    add_cluster_args(ra)
    ra.set_defaults(nodes=4)


def _race_spec(args: argparse.Namespace) -> Any:
    """The `plait.bench.race.RaceSpec` the flags describe (entries, optimizers and rates
    parsed, every strategy spec checked by `TrainConfig`)."""
    from plait.bench.race import RaceSpec, parse_entry, parse_lr_map

    default_lr, lrs = parse_lr_map(args.lr)
    texts = split_specs(args.strategies)
    if not texts:
        raise ValueError("--strategies: no entry given; e.g. ssgd+sgd@0.1,ssgd+adamw@1e-3")
    entries = [parse_entry(t, optimizer=args.optimizer, lrs=lrs, lr=default_lr) for t in texts]
    labels = {e.label for e in entries} | {e.spec for e in entries}
    unknown = sorted(set(lrs) - labels)
    if unknown:
        raise ValueError(
            f"--lr {unknown[0]}=...: no such entry; entries are "
            + ", ".join(e.label for e in entries)
        )
    return RaceSpec(
        workload=args.workload,
        entries=entries,
        target=args.target,
        metric=args.metric,
        seeds=list(args.seeds),
        max_steps=args.max_steps,
        eval_every=args.eval_every,
        chunk=args.chunk,
        batch_size=args.batch_size,
        full_budget=args.full_budget,
        bandwidth=args.bandwidth or "",
    )


def validate(args: argparse.Namespace) -> None:
    from plait.bench.race import compare, merge, parse_pairs, read_results

    pairs = parse_pairs(args.compare)
    if args.report:
        results = Path(args.report) / "results.json"
        if not results.is_file():
            raise ValueError(f"--report {args.report!r}: no results.json there")
        old = read_results(results)
        parts = [old]
        for d in args.merge:
            other = Path(d) / "results.json"
            if not other.is_file():
                raise ValueError(f"--merge {d!r}: no results.json there")
            parts.append(read_results(other))
        if args.merge:
            old = merge(parts)  # other entries or settings, or a seed twice, fail here
        for a, b in pairs:
            compare(old, a, b)  # unknown labels fail here, in one line
        return
    if args.merge:
        raise ValueError("--merge pools finished races: it needs --report DIR")
    if args.target is None:
        raise ValueError("--target is required (a held-out accuracy, or a loss with --metric loss)")
    check_cluster_args(args)
    for flag in ("max_steps", "eval_every", "chunk", "batch_size"):
        int_at_least(f"--{flag.replace('_', '-')}", getattr(args, flag), 1)
    check_number("--target", args.target, low=-math.inf)
    if args.metric == "accuracy":
        check_number("--target", args.target, low=0, high=1, low_open=True)
    if len(set(args.seeds)) != len(args.seeds):
        raise ValueError(f"--seeds {','.join(map(str, args.seeds))}: a seed given twice")
    writable_dir("--out", args.out)
    workload_list(args.workload)
    if "," in args.workload:
        raise ValueError(f"--workload {args.workload!r}: a race takes one workload")
    spec = _race_spec(args)
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
                strategy.check(model, world=args.nodes * args.nproc_per_node)
        finally:
            strategy.close()


def run(args: argparse.Namespace) -> int:
    from plait.bench.race import (
        annotate,
        markdown,
        merge,
        parse_pairs,
        read_results,
        run_race,
        write_reports,
    )

    pairs = parse_pairs(args.compare)
    if args.report:
        folder = Path(args.report)
        old = annotate(read_results(folder / "results.json"))
        if args.merge:
            old = merge([old, *(read_results(Path(d) / "results.json") for d in args.merge)])
        write_reports(old, folder, pairs)
        print(markdown(old, pairs), end="")
        print(f"rewrote {folder / 'results.md'} and {folder / 'results.png'}")
        return 0
    spec = _race_spec(args)
    out = Path(args.out) if args.out else None
    print(
        f"plait race: {spec.workload} on {args.nodes} node(s) x {args.nproc_per_node}, "
        f"{args.bandwidth or 'unshaped'}: {', '.join(e.label for e in spec.entries)}; "
        f"seeds {', '.join(map(str, spec.seeds))}",
        flush=True,
    )
    results = run_race(
        spec,
        nodes=args.nodes,
        nproc_per_node=args.nproc_per_node,
        latency=args.latency,
        loss=args.loss,
        threads=args.threads,
        out=out,
        timeout_s=args.timeout or 6 * 3600,
        progress=not args.no_progress,
        compare_pairs=pairs,
    )
    print(markdown(results, pairs), end="")
    if out is not None:
        print(f"wrote {out / 'results.json'}, {out / 'results.md'}, {out / 'results.png'}")
    return 0
