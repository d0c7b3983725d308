"""`plait bench`: strategies side by side on one cluster, or a benchmark suite by name.

``plait bench [flags]`` compares data-parallel strategies on an emulated cluster (the
flags below). ``plait bench SUITE [flags]`` runs one of the suites of
`plait.bench.suites` instead, with the suite's own flags: `split_suite` finds the suite's
name before argparse sees the command line, since the suites' flags are not
``plait bench``'s and each suite parses its own (`plait.flags`).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from plait.bench.suites import SUITES
from plait.cli.common import (
    ListingFormatter,
    add_cluster_args,
    add_config_arg,
    check_cluster_args,
    check_strategies,
    check_tensorboard_dir,
    int_at_least,
    workload_list,
    writable_dir,
)
from plait.specs import split_specs


def split_suite(argv: Sequence[str]) -> tuple[list[str], str, list[str]] | None:
    """``plait``'s own flags and ``bench``, the suite's name and its arguments, when
    `argv` (``plait``'s arguments) runs a suite; None otherwise.

    ``plait``'s flags before the command take no value, so the first argument that is not
    a flag is the command; ``plait bench`` itself takes no positional argument, so one
    right after it names a suite.

    Raises:
        ValueError: the argument after ``bench`` names no suite.
    """
    for i, arg in enumerate(argv):
        if arg.startswith("-"):
            continue
        if arg != "bench" or i + 1 == len(argv) or argv[i + 1].startswith("-"):
            return None
        name = argv[i + 1]
        if name not in SUITES:
            raise ValueError(f"no suite {name!r}; the suites: {', '.join(SUITES)}")
        return list(argv[: i + 1]), name, list(argv[i + 2 :])
    return None


def run_suite(name: str, argv: Sequence[str]) -> int:
    """Run the suite `name` on its arguments `argv` (``plait bench NAME ARGV...``)."""
    from plait.bench.suites import main

    return main(name, argv, prog=f"plait bench {name}")


def _epilog() -> str:
    """The list of suites, for ``plait bench --help``."""
    width = max(map(len, SUITES))
    lines = [f"  {name:<{width}}  {suite.help}" for name, suite in SUITES.items()]
    return "\n".join(
        ["benchmark suites, each with its own flags (plait bench SUITE --help):", *lines]
    )


def add_parser(sub: Any) -> None:
    b = sub.add_parser(
        "bench",
        help="benchmark strategies side by side, or run a benchmark suite",
        epilog=_epilog(),
        formatter_class=ListingFormatter,
    )
    add_config_arg(b)
    b.add_argument("--workload", default="resnet18", help="workload(s), comma-separated")
    b.add_argument(
        "--strategies",
        default="ssgd",
        help="strategy specs, comma-separated; use ; between specs whose options contain commas",
    )
    add_cluster_args(b, multi_bandwidth=True)
    b.add_argument("--steps", type=int, default=10, help="measured steps per strategy")
    b.add_argument("--warmup", type=int, default=2, help="discarded steps per strategy")
    b.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="per-worker batch size (default: the workload's benchmark batch)",
    )
    b.add_argument("--out", default=None, help="output directory (results.json/.md/.png)")
    b.add_argument("--trace", action="store_true", help="write a merged trace per job")
    b.add_argument(
        "--tensorboard",
        default=None,
        metavar="DIR",
        help="also write each strategy's scalars (throughput, step time, bytes per step) "
        "as TensorBoard events here",
    )


def validate(args: argparse.Namespace) -> None:
    check_cluster_args(args, multi_bandwidth=True)
    int_at_least("--steps", args.steps, 1)
    int_at_least("--warmup", args.warmup, 0)
    int_at_least("--batch-size", args.batch_size, 1)
    writable_dir("--out", args.out)
    check_tensorboard_dir(args.tensorboard)
    check_strategies(
        split_specs(args.strategies),
        workload_list(args.workload),
        args.nodes * args.nproc_per_node,
        args,
    )


def run(args: argparse.Namespace) -> int:
    from plait.bench.report import write_reports
    from plait.bench.runner import run_bench

    bandwidths: list[str | None] = (
        [b.strip() for b in args.bandwidth.split(",")] if args.bandwidth else [None]
    )
    out = Path(args.out) if args.out else None
    records = run_bench(
        workloads=[w.strip() for w in args.workload.split(",") if w.strip()],
        strategies=split_specs(args.strategies),
        nodes=args.nodes,
        nproc_per_node=args.nproc_per_node,
        bandwidths=bandwidths,
        latency=args.latency,
        loss=args.loss,
        steps=args.steps,
        warmup=args.warmup,
        batch_size=args.batch_size,
        threads=args.threads,
        out=out,
        trace=args.trace,
    )
    from plait.bench.report import markdown_table

    if args.tensorboard:
        from plait.bench.runner import write_scalars

        write_scalars(records, Path(args.tensorboard))

    print(markdown_table(records))
    if out is not None:
        paths = write_reports(records, out)
        print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0
