"""`plait train`: train a workload with a strategy, on an emulated cluster or under torchrun."""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict
from typing import Any

from plait._proc import scratch_dir
from plait.cli.common import (
    ClusterConfig,
    add_cluster_args,
    add_config_arg,
    check_backend,
    check_cluster_args,
    check_group,
    check_number,
    check_tensorboard_dir,
    check_token_dir,
    int_at_least,
    writable_dir,
    writable_file,
)
from plait.flags import build
from plait.units import parse_size


def add_parser(sub: Any) -> None:
    from plait.train.args import add_train_args

    t = sub.add_parser("train", help="train a workload with a strategy")
    add_config_arg(t)
    add_train_args(t)
    add_cluster_args(t)


def validate(args: argparse.Namespace) -> None:
    check_cluster_args(args)
    for flag in ("epochs", "steps", "batch_size", "accumulate"):
        int_at_least(f"--{flag.replace('_', '-')}", getattr(args, flag), 1)
    for flag in ("checkpoint_every", "max_restarts", "eval_every"):
        int_at_least(f"--{flag.replace('_', '-')}", getattr(args, flag), 0)
    check_number("--lr", args.lr, low=0, low_open=True)
    check_number("--momentum", args.momentum, low=0)
    check_number("--weight-decay", args.weight_decay, low=0)
    writable_dir("--checkpoint", args.checkpoint)
    writable_file("--out", args.out)
    writable_file("--trace", args.trace)
    check_tensorboard_dir(args.tensorboard)
    check_group("--crossover", args.crossover)
    if args.crossover is not None:
        check_token_dir("--crossover")
    if args.memory is not None:
        parse_size(args.memory, what="--memory size")
    from plait.train.args import config_from_args

    cfg = config_from_args(args)  # workload, strategy spec and its options
    if "RANK" in os.environ:
        return  # a worker: the parent checked the rest before launching
    from plait.train.strategy import Strategy
    from plait.workloads import get_workload

    world = args.nodes * args.nproc_per_node
    wl = get_workload(cfg.workload)
    data = wl.real() if cfg.data == "real" else wl.bench_data(cfg.synthetic_samples)
    samples = len(data.train)  # type: ignore[arg-type]
    batch = cfg.batch_size or wl.train_batch
    if batch * cfg.accumulate * world > samples:
        raise ValueError(
            f"--batch-size {batch} x --accumulate {cfg.accumulate} x {world} rank(s): one "
            f"step needs {batch * cfg.accumulate * world} samples, the {cfg.data} data of "
            f"{cfg.workload!r} has {samples}; at most --batch-size "
            f"{max(1, samples // (cfg.accumulate * world))}"
        )
    strategy = cfg.strategy_choice.build()
    try:
        check_backend(strategy, args)
        if type(strategy).check is not Strategy.check:  # plan degrees against world, model
            strategy.check(wl.model(data.info), world=world)
    finally:
        strategy.close()


def run(args: argparse.Namespace) -> int:
    from plait.train.args import config_from_args

    cfg = config_from_args(args)
    if "RANK" in os.environ:  # already launched by torchrun: train in this process
        from plait.train.loop import train

        train(cfg)
        return 0
    from plait.cluster import Cluster, launch

    cfg_path = scratch_dir("plait-train-") / "config.json"
    cfg_path.write_text(json.dumps(asdict(cfg)))
    network = build(args, ClusterConfig).network()
    with Cluster.create(nodes=args.nodes, network=network) as cluster:
        print(
            f"plait train: {cfg.workload} / {cfg.strategy_spec()} on {args.nodes} node(s) x "
            f"{args.nproc_per_node} ({cluster.network.describe()})",
            flush=True,
        )
        result = launch(
            cluster,
            ["plait.train", "--config-json", str(cfg_path)],
            module=True,
            nproc_per_node=args.nproc_per_node,
            threads=args.threads,
            max_restarts=args.max_restarts if cfg.checkpoint else 0,
            timeout_s=args.timeout,
        )
    if not result.ok:
        print(result.tail(), file=sys.stderr)
        print(f"plait train: failed: {result.describe_failure()}", file=sys.stderr)
        return 1
    return 0
