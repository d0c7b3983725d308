"""`plait run`: a user's script on an emulated cluster, one torchrun per node."""

from __future__ import annotations

import argparse
import sys
from dataclasses import MISSING, dataclass
from pathlib import Path
from typing import Any

from plait.cli.common import CLUSTER_GROUP, MODULE_RE, ClusterConfig, int_at_least
from plait.flags import add_options, build, nested, option


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """What `plait run` launches: the schema of its flags (`plait.flags`).

    The constructor checks what the values decide; `validate` checks the script against
    this machine (the file, or the module's name).

    Attributes:
        cluster: the emulated cluster the script runs on.
        max_restarts: torchrun's restarts after a failure.
        module: run `script`'s first word as a module (``python -m``).
        script: the script and its arguments, after ``--``.
    """

    cluster: ClusterConfig = nested(ClusterConfig, group=CLUSTER_GROUP)
    max_restarts: int = option(0, "torchrun restarts after a failure")
    module: bool = option(False, "run SCRIPT as a module", aliases=("-m",))
    script: tuple[str, ...] = option(MISSING, "-- SCRIPT ARGS...", positional=True, nargs="...")

    def __post_init__(self) -> None:
        int_at_least("--max-restarts", self.max_restarts, 0)
        if self.script[:1] == ("--",):
            object.__setattr__(self, "script", self.script[1:])
        if not self.script:
            raise ValueError("give the script after --, e.g. plait run --nodes 2 -- x.py")


def add_parser(sub: Any) -> None:
    r = sub.add_parser("run", help="run a script on an emulated cluster (one torchrun per node)")
    add_options(r, RunConfig)


def validate(args: argparse.Namespace) -> None:
    cfg = build(args, RunConfig)
    args.placement = cfg.cluster.placement()
    first = cfg.script[0]
    if cfg.module:
        if not MODULE_RE.fullmatch(first):
            raise ValueError(f"-m {first!r}: expected a dotted module name, e.g. pkg.train")
    elif not Path(first).is_file():
        raise ValueError(f"script {first!r}: no such file (use -m to run a module)")


def run(args: argparse.Namespace) -> int:
    return run_config(build(args, RunConfig))


def run_config(cfg: RunConfig) -> int:
    """Launch `cfg.script` on every node of a fresh emulated cluster; 0 when it succeeded."""
    from plait.cluster import Cluster, launch

    net = cfg.cluster
    with Cluster.create(nodes=net.nodes, network=net.network()) as cluster:
        result = launch(
            cluster,
            list(cfg.script),
            module=cfg.module,
            nproc_per_node=net.nproc_per_node,
            threads=net.threads,
            max_restarts=cfg.max_restarts,
            timeout_s=net.timeout,
        )
    if not result.ok:
        print(result.tail(), file=sys.stderr)
        print(f"plait run: failed: {result.describe_failure()}", file=sys.stderr)
    return 0 if result.ok else 1
