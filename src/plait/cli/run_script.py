"""`plait run`: a user's script on an emulated cluster, one torchrun per node."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from plait.cli.common import (
    MODULE_RE,
    add_cluster_args,
    check_cluster_args,
    int_at_least,
    network_spec,
)


def add_parser(sub: Any) -> None:
    r = sub.add_parser("run", help="run a script on an emulated cluster (one torchrun per node)")
    add_cluster_args(r)
    r.add_argument("--max-restarts", type=int, default=0, help="torchrun restarts after a failure")
    r.add_argument("-m", "--module", action="store_true", help="run SCRIPT as a module")
    r.add_argument("script", nargs=argparse.REMAINDER, help="-- SCRIPT ARGS...")


def validate(args: argparse.Namespace) -> None:
    check_cluster_args(args)
    int_at_least("--max-restarts", args.max_restarts, 0)
    script = args.script[1:] if args.script[:1] == ["--"] else args.script
    if not script:
        raise ValueError("give the script after --, e.g. plait run --nodes 2 -- x.py")
    if args.module:
        if not MODULE_RE.fullmatch(script[0]):
            raise ValueError(f"-m {script[0]!r}: expected a dotted module name, e.g. pkg.train")
    elif not Path(script[0]).is_file():
        raise ValueError(f"script {script[0]!r}: no such file (use -m to run a module)")


def run(args: argparse.Namespace) -> int:
    from plait.cluster import Cluster, launch

    script = args.script[1:] if args.script[:1] == ["--"] else args.script
    if not script:
        raise ValueError("plait run: give the script after --, e.g. plait run --nodes 2 -- x.py")
    with Cluster.create(nodes=args.nodes, network=network_spec(args)) as cluster:
        result = launch(
            cluster,
            script,
            module=args.module,
            nproc_per_node=args.nproc_per_node,
            threads=args.threads,
            max_restarts=args.max_restarts,
            timeout_s=args.timeout,
        )
    if not result.ok:
        print(result.tail(), file=sys.stderr)
        print(f"plait run: failed: {result.describe_failure()}", file=sys.stderr)
    return 0 if result.ok else 1
