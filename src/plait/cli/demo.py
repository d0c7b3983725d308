"""`plait demo`: the end-to-end demonstration on an emulated cluster."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from plait.cli.common import DEFAULT_NODES, MAX_NODES, int_at_least, writable_dir


def add_parser(sub: Any) -> None:
    d = sub.add_parser("demo", help="end-to-end demonstration on an emulated 4-node cluster")
    d.add_argument("--nodes", type=int, default=DEFAULT_NODES, help="emulated nodes")
    d.add_argument("--out", default="runs/demo", help="where the demo writes its results")
    d.add_argument("--quick", action="store_true", help="fewer steps (for smoke tests)")


def validate(args: argparse.Namespace) -> None:
    int_at_least("--nodes", args.nodes, 1, MAX_NODES)
    writable_dir("--out", args.out)


def run(args: argparse.Namespace) -> int:
    from plait.demo import run_demo

    return run_demo(nodes=args.nodes, out=Path(args.out), quick=args.quick)
