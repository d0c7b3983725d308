"""`plait demo`: the end-to-end demonstration on an emulated cluster."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from plait.cli.common import DEFAULT_NODES, MAX_NODES, int_at_least, writable_dir
from plait.flags import add_options, build, option


@dataclass(frozen=True, kw_only=True)
class DemoConfig:
    """What `plait demo` runs: the schema of its flags (`plait.flags`).

    Attributes:
        nodes: emulated nodes.
        out: where the demo writes its results.
        quick: fewer steps (for smoke tests).
    """

    nodes: int = option(DEFAULT_NODES, "emulated nodes")
    out: str = option("runs/demo", "where the demo writes its results")
    quick: bool = option(False, "fewer steps (for smoke tests)")

    def __post_init__(self) -> None:
        int_at_least("--nodes", self.nodes, 1, MAX_NODES)


def add_parser(sub: Any) -> None:
    d = sub.add_parser("demo", help="end-to-end demonstration on an emulated 4-node cluster")
    add_options(d, DemoConfig)


def validate(args: argparse.Namespace) -> None:
    cfg = build(args, DemoConfig)
    writable_dir("--out", cfg.out)


def run(args: argparse.Namespace) -> int:
    from plait.demo import run_demo

    cfg = build(args, DemoConfig)
    return run_demo(nodes=cfg.nodes, out=Path(cfg.out), quick=cfg.quick)
