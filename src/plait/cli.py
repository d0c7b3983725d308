"""The `plait` command line; flag spellings are a public contract (see the README)."""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import secrets
import sys
import tomllib
import traceback
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any, NoReturn

from plait._proc import interrupts_held, scratch_dir
from plait.cluster.network import NAMED_RATES, NetworkSpec, parse_duration, resolve_bandwidth
from plait.log import check_tensorboard, configure, level_from
from plait.specs import split_specs
from plait.units import parse_size

#: Emulated nodes when ``--nodes`` is not given, the same in every command: the size of the
#: cluster the demo and the committed benchmarks use.
DEFAULT_NODES = 4


class _Formatter(argparse.ArgumentDefaultsHelpFormatter):
    """Help that shows each flag's default, unless it has none or its help already says.

    Defaults of None (decided later, e.g. "the workload's") and of on/off switches say
    nothing a reader needs; tuples print as they are typed (``1,2,4``).
    """

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if (
            not action.option_strings
            or "default" in text
            or default is None
            or default is argparse.SUPPRESS
            or isinstance(default, bool)
        ):
            return text
        shown = ",".join(map(str, default)) if isinstance(default, tuple | list) else str(default)
        return f"{text} (default: {shown.replace('%', '%%')})"


class _Parser(argparse.ArgumentParser):
    """argparse whose usage errors are one line: the flag, the bad value, what it takes.

    Every parser and subparser it makes shows the flags' defaults in ``--help``.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", _Formatter)
        super().__init__(*args, **kwargs)
        # a value starting with a dash and a digit is a value (`--latency -5ms` reaches its
        # check, which says what is wrong), not an unknown flag ("expected one argument")
        self._negative_number_matcher = re.compile(r"^-\.?\d")

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _add_cluster_args(p: argparse.ArgumentParser, *, multi_bandwidth: bool = False) -> None:
    g = p.add_argument_group("emulated cluster")
    g.add_argument(
        "--nodes", type=int, default=DEFAULT_NODES, help="emulated nodes (network namespaces)"
    )
    g.add_argument("--nproc-per-node", type=int, default=1, help="worker processes per node")
    bw_help = (
        f"egress rate per node: a tc rate from 1kbit to 1tbit (100mbit, 1gbit; bps is bytes/s, "
        f"as in tc) or a named setting "
        f"({', '.join(f'{k}={v}' for k, v in NAMED_RATES.items())})"
    )
    if multi_bandwidth:
        bw_help += "; a comma-separated list runs each"
    bw_help += " (default: unshaped)"
    g.add_argument("--bandwidth", default=None, help=bw_help)
    g.add_argument(
        "--latency",
        default=None,
        help="added one-way delay per link, up to 60s, e.g. 2ms (default: none)",
    )
    g.add_argument(
        "--loss",
        type=float,
        default=None,
        help="packet loss per link, percent in [0, 100) (default: none)",
    )
    g.add_argument("--threads", type=int, default=1, help="intra-op threads per worker process")
    g.add_argument(
        "--timeout", type=float, default=None, help="wall-clock limit in seconds (default: none)"
    )
    g.add_argument(
        "--device",
        default="auto",
        choices=["auto", "cpu", "cuda"],
        help="where the ranks compute: cuda puts every rank on this host's GPUs (ranks "
        "sharing a GPU talk through gloo, a GPU each through NCCL); auto: cuda if present",
    )
    g.add_argument(
        "--link",
        default="auto",
        choices=["auto", "tc", "model"],
        help="how --bandwidth/--latency shape the links: tc on network namespaces (root, "
        "not gVisor), model: plait's collectives take an alpha-beta model's time on "
        "loopback; auto: tc where it works, else model",
    )


def _add_config_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config",
        default=None,
        metavar="TOML",
        help="read this command's flags from a TOML run config: its keys are the flag names "
        "(dashes or underscores); flags given on the command line override it",
    )


def _version_text() -> str:
    """plait's and torch's versions, from their installed metadata: every parse builds
    this text, and importing torch for it would cost ``plait --help`` 1.3 s."""
    from importlib import metadata

    from plait import __version__

    try:
        torch_version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch_version = "not installed"
    return f"plait {__version__} (torch {torch_version})"


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="plait",
        description="Braid computation and communication: faster PyTorch training where "
        "hardware sits idle.",
        epilog=f"Every command that builds an emulated cluster defaults to --nodes "
        f"{DEFAULT_NODES}. `plait train` and `plait bench` also read their flags from a TOML "
        "run config (--config run.toml; examples in configs/).",
    )
    parser.add_argument(
        "--debug", action="store_true", help="show the traceback of an error (also PLAIT_DEBUG=1)"
    )
    _add_verbosity_flags(parser, default=False)
    parser.add_argument("--version", action="version", version=_version_text())
    sub = parser.add_subparsers(dest="command", required=True)

    d = sub.add_parser("demo", help="end-to-end demonstration on an emulated 4-node cluster")
    d.add_argument("--nodes", type=int, default=DEFAULT_NODES, help="emulated nodes")
    d.add_argument("--out", default="runs/demo", help="where the demo writes its results")
    d.add_argument("--quick", action="store_true", help="fewer steps (for smoke tests)")

    from plait.train.args import add_train_args

    t = sub.add_parser("train", help="train a workload with a strategy")
    _add_config_arg(t)
    add_train_args(t)
    _add_cluster_args(t)

    r = sub.add_parser("run", help="run a script on an emulated cluster (one torchrun per node)")
    _add_cluster_args(r)
    r.add_argument("--max-restarts", type=int, default=0, help="torchrun restarts after a failure")
    r.add_argument("-m", "--module", action="store_true", help="run SCRIPT as a module")
    r.add_argument("script", nargs=argparse.REMAINDER, help="-- SCRIPT ARGS...")

    c = sub.add_parser("cluster", help="manage emulated clusters")
    c.add_argument(
        "action",
        choices=["up", "down", "status", "probe"],
        help="up: build one that stays; down: remove clusters; status: list them; probe: "
        "measure all-reduce on a fresh one",
    )
    c.add_argument("--all", action="store_true", help="down: also clusters of running jobs")
    _add_cluster_args(c)

    b = sub.add_parser("bench", help="benchmark strategies side by side")
    _add_config_arg(b)
    b.add_argument("--workload", default="resnet18", help="workload(s), comma-separated")
    b.add_argument(
        "--strategies",
        default="ssgd",
        help="strategy specs, comma-separated; use ; between specs whose options contain commas",
    )
    _add_cluster_args(b, multi_bandwidth=True)
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

    _add_race_parser(sub)

    x = sub.add_parser("crossover", help="co-located jobs that fill each other's communication")
    xs = x.add_subparsers(dest="action", required=True)
    xr = xs.add_parser("run", help="launch co-located jobs on one emulated cluster")
    xr.add_argument(
        "jobs",
        nargs="+",
        help="jobs: workload/strategy (resnet18/ssgd), a JSON file of train settings, or a "
        "quoted command (its script gets PLAIT_CROSSOVER_GROUP)",
    )
    _add_cluster_args(xr, multi_bandwidth=True)
    xr.add_argument("--steps", type=int, default=20, help="steps per built-in job")
    xr.add_argument("--warmup", type=int, default=3, help="steps excluded from rates")
    xr.add_argument("--repeats", type=int, default=1, help="--compare: interleaved repeats")
    xr.add_argument("--group", default=None, help="token group name (default: per cluster)")
    xr.add_argument(
        "--mode",
        default="crossover",
        choices=["crossover", "uncoordinated"],
        help="without --compare: run the jobs gated by the token, or not",
    )
    xr.add_argument(
        "--compare",
        action="store_true",
        help="measure alone (sequential), uncoordinated and crossover",
    )
    xr.add_argument("--trace", default=None, help="merged timeline of the co-located jobs")
    xr.add_argument("--out", default=None, help="output directory (results.json/.md/.png)")
    _add_sweep_parser(sub)
    _add_bench_fused_parser(sub)

    pl = sub.add_parser("plan", help="the automatic parallelism planner's choice and table")
    pl.add_argument(
        "--workload",
        default="gpt",
        help="a registered workload (mlp, resnet18, vgg, gpt) or a factory "
        "pkg.module:factory / path/to/file.py:factory",
    )
    pl.add_argument("--nodes", type=int, default=4, help="nodes of the cluster to plan for")
    pl.add_argument("--nproc-per-node", type=int, default=1, help="ranks per node")
    pl.add_argument(
        "--memory",
        default=None,
        help="memory per device: 2GiB = 2*2^30 bytes, 2GB = 2*10^9 (default: none)",
    )
    pl.add_argument("--bandwidth", default="fast", help="link rate (tc rate or slow/balanced/fast)")
    pl.add_argument(
        "--probe",
        action="store_true",
        help="measure the network on an emulated cluster instead of the nominal rate",
    )
    pl.add_argument(
        "--data",
        default="synthetic",
        choices=["real", "synthetic"],
        help="synthetic: the benchmark model and batch; real: the training ones",
    )
    pl.add_argument("--batch-size", type=int, default=None, help="per-worker batch size")
    pl.add_argument(
        "--slots",
        type=int,
        default=None,
        help="ranks computing at once (default: this machine's cores, as when "
        "the cluster is emulated here)",
    )
    pl.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    pl.add_argument("--all", action="store_true", help="list every candidate plan")
    pl.add_argument("--json", default=None, help="also write the table as JSON here")
    pl.add_argument(
        "--races",
        default="benchmarks/race",
        help="races (folders of plait race results) whose steps to target rank the "
        "data-parallel strategies and optimizers by time to target (with --data real); "
        "'none' ranks them by projected step time",
    )
    _add_debug_flag(parser)
    return parser


def _add_verbosity_flags(parser: argparse.ArgumentParser, *, default: object) -> None:
    g = parser.add_mutually_exclusive_group()
    g.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        default=default,
        help="also log debugging detail, each line naming its logger",
    )
    g.add_argument(
        "-q",
        "--quiet",
        action="store_true",
        default=default,
        help="log warnings and errors only, and draw no progress bar",
    )


def _add_debug_flag(parser: argparse.ArgumentParser) -> None:
    """Accept ``--debug``, ``--verbose`` and ``--quiet`` after any subcommand too
    (``plait train ... --debug``)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                if not any("--debug" in a.option_strings for a in child._actions):
                    child.add_argument(
                        "--debug",
                        action="store_true",
                        default=argparse.SUPPRESS,
                        help="show the traceback of an error",
                    )
                if not any("--verbose" in a.option_strings for a in child._actions):
                    _add_verbosity_flags(child, default=argparse.SUPPRESS)
                _add_debug_flag(child)


def _floats(text: str) -> tuple[float, ...]:
    """Comma-separated finite numbers (``1e-3,1.0``)."""
    try:
        values = tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of numbers (e.g. 1e-3,1.0)"
        ) from None
    if not values or not all(math.isfinite(v) for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: expected finite numbers, e.g. 1e-3,1.0")
    return values


def _ints(text: str) -> tuple[int, ...]:
    """Comma-separated integers (``1,2,4``)."""
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of integers (e.g. 1,2,4)"
        ) from None
    if not values:
        raise argparse.ArgumentTypeError(f"{text!r}: expected at least one integer, e.g. 1,2,4")
    return values


def _bytes(text: str) -> int:
    """A size (``512MiB``, ``2GB`` = 2*10^9, ``2GiB`` = 2*2^30, or bytes): `plait.units`."""
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _add_race_parser(sub: Any) -> None:
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
        type=_ints,
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
        "muon: torch.optim.Muon for the matrices, AdamW for the rest",
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
    _add_cluster_args(ra)
    ra.set_defaults(nodes=4)


def _add_sweep_parser(sub: Any) -> None:
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
        type=_bytes,
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
        type=_floats,
        default=None,
        help="learning-rate range LO,HI (default: 1e-3,1 for sgd and adagrad, "
        "1e-4,0.1 for adam, adamw and rmsprop)",
    )
    s.add_argument(
        "--weight-decay",
        type=_floats,
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
        type=_ints,
        default=None,
        help="batch-size choices (non-fusible: one array per value; default 32)",
    )
    s.add_argument(
        "--widths",
        type=_ints,
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


def _add_bench_fused_parser(sub: Any) -> None:
    f = sub.add_parser(
        "bench-fused",
        help="throughput of N models trained fused vs serially, as processes, with vmap",
    )
    f.add_argument(
        "--workload",
        "--models",
        dest="models",
        default="mlp,cnn,transformer",
        help="models to benchmark, comma-separated: the short names mlp, cnn, "
        "transformer (and -wide: digits-* workloads at fixed widths), any "
        "registry workload, or a factory pkg.module:factory or "
        "path/to/file.py:factory (--models is the earlier name)",
    )
    f.add_argument("--n", type=_ints, default=(1, 2, 4, 8, 16, 32), help="array sizes")
    f.add_argument(
        "--strategies",
        default="fused,serial,concurrent,vmap",
        help="fused, serial, concurrent, vmap (comma-separated)",
    )
    f.add_argument("--steps", type=int, default=5, help="timed steps per round")
    f.add_argument("--rounds", type=int, default=9, help="interleaved rounds per strategy")
    f.add_argument("--warmup", type=int, default=3, help="untimed steps before the rounds")
    f.add_argument(
        "--threads",
        type=_ints,
        default=(1,),
        help="intra-op thread counts of every process, e.g. 1,2: every strategy runs at each",
    )
    f.add_argument("--batch-size", type=int, default=None, help="per-model batch size")
    f.add_argument("--device", default="cpu", help="cpu or cuda")
    f.add_argument("--out", default=None, help="output directory (results.json/.md/.png)")
    f.add_argument(
        "--default-malloc",
        action="store_true",
        help="keep glibc's malloc thresholds (default: raised)",
    )
    f.add_argument(
        "--stock-adam",
        default="fused",
        choices=["fused", "foreach", "for-loop"],
        help="torch.optim.Adam implementation of the serial, concurrent and vmap "
        "strategies (default: fused, the kernel FusedAdam runs too)",
    )
    f.add_argument(
        "--no-native",
        action="store_true",
        help="fused arrays on torch's kernels only, without plait's native CPU "
        "kernels (plait.fused.native)",
    )
    f.add_argument(
        "--conv-layout",
        default="nchw",
        choices=["nchw", "channels_last"],
        help="layout of the fused arrays' 2-d convolutions (default nchw, the accurate "
        "one; channels_last is faster on a CPU, see plait.fused.set_conv_layout)",
    )
    f.add_argument(
        "--fidelity",
        type=int,
        default=None,
        metavar="STEPS",
        help="measure fidelity instead of throughput: each array of --n models trains STEPS "
        "steps of SGD and of Adam fused and one model after another (float32 and float64), "
        "and the report gives each member's largest relative difference "
        "(DIR/fidelity.json, .md)",
    )


def _network(args: argparse.Namespace, bandwidth: str | None = None) -> NetworkSpec:
    return NetworkSpec(
        bandwidth=bandwidth if bandwidth is not None else args.bandwidth,
        latency=args.latency,
        loss=args.loss,
    )


def cmd_train(args: argparse.Namespace) -> int:
    from plait.train.args import config_from_args

    cfg = config_from_args(args)
    if "RANK" in os.environ:  # already launched by torchrun: train in this process
        from plait.train.loop import train

        train(cfg)
        return 0
    from plait.cluster import Cluster, launch

    cfg_path = scratch_dir("plait-train-") / "config.json"
    cfg_path.write_text(json.dumps(asdict(cfg)))
    with Cluster.create(nodes=args.nodes, network=_network(args)) as cluster:
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


def cmd_run(args: argparse.Namespace) -> int:
    from plait.cluster import Cluster, launch

    script = args.script[1:] if args.script[:1] == ["--"] else args.script
    if not script:
        raise ValueError("plait run: give the script after --, e.g. plait run --nodes 2 -- x.py")
    with Cluster.create(nodes=args.nodes, network=_network(args)) as cluster:
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


def cmd_cluster(args: argparse.Namespace) -> int:
    from plait.cluster import Cluster, launch, list_clusters, teardown_all

    if args.action == "status":
        clusters = list_clusters()
        if not clusters:
            print("no plait clusters")
        for c in clusters:
            print(json.dumps(c))
        return 0
    if args.action == "down":
        removed = teardown_all(only_dead=not args.all)
        print(f"removed {len(removed)} cluster(s): {' '.join(removed) or '-'}")
        return 0
    if args.action == "up":
        cluster = Cluster.create(nodes=args.nodes, network=_network(args), persistent=True).up()
        print(f"cluster {cluster.cid}: {args.nodes} node(s), {cluster.network.describe()}")
        for i in range(args.nodes):
            print(
                f"  node {i}: netns {cluster.netns(i)}  {cluster.ifname(i)}  {cluster.address(i)}"
            )
        print("remove with: plait cluster down")
        return 0
    # probe
    nodes = max(2, args.nodes)
    out = scratch_dir("plait-probe-") / "probe.json"
    with Cluster.create(nodes=nodes, network=_network(args)) as cluster:
        print(
            f"probing all-reduce on {nodes} node(s) x {args.nproc_per_node}, "
            f"{cluster.network.describe()} ...",
            flush=True,
        )
        result = launch(
            cluster,
            ["plait.comm.probe", str(out)],
            module=True,
            nproc_per_node=args.nproc_per_node,
            threads=args.threads,
            timeout_s=args.timeout or 600,
            quiet=True,
        )
    if not result.ok or not out.exists():
        print(result.tail(), file=sys.stderr)
        return 1
    print(format_probe(json.loads(out.read_text()), cluster.network.rate_bps))
    return 0


def format_probe(res: dict[str, Any], rate_bps: float | None) -> str:
    lines = [f"{'bytes':>12} {'time ms':>10} {'bus bw Mbit/s':>14}"]
    for n, t, bw in zip(res["sizes"], res["seconds"], res["busbw_bps"], strict=True):
        lines.append(f"{n:>12d} {1000 * t:>10.2f} {bw / 1e6:>14.1f}")
    lines.append(
        f"alpha-beta fit: alpha = {1e6 * res['alpha_s']:.1f} us per message, "
        f"beta = {1e9 * res['beta_s_per_byte']:.3f} ns/byte "
        f"(= {res['bandwidth_bps'] / 1e6:.1f} Mbit/s)"
    )
    if rate_bps:
        big = res["busbw_bps"][-1]  # small messages ride the token bucket's burst
        lines.append(
            f"configured rate {rate_bps / 1e6:.1f} Mbit/s; bus bandwidth at {res['sizes'][-1]} "
            f"bytes {big / 1e6:.1f} Mbit/s ({100 * big / rate_bps:.0f}%)"
        )
    return "\n".join(lines)


def cmd_bench(args: argparse.Namespace) -> int:
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


def cmd_race(args: argparse.Namespace) -> int:
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


def cmd_crossover(args: argparse.Namespace) -> int:
    from plait.bench.colocate import Job, Mode, compare, run_colocated
    from plait.bench.crossover_report import markdown, write
    from plait.cluster import Cluster

    for i, spec in enumerate(args.jobs):
        Job.parse(spec, i)  # bad job specs fail before any cluster is built
    if len(args.jobs) < 2:
        raise ValueError("plait crossover run: give at least two jobs")
    bandwidths = [b.strip() for b in args.bandwidth.split(",")] if args.bandwidth else [None]
    nets = [_network(args, b) for b in bandwidths]
    records = []
    with Cluster.create(nodes=args.nodes, network=nets[0]) as cluster:
        for bandwidth, net in zip(bandwidths, nets, strict=True):
            cluster.shape(net)
            trace = _trace_path(args.trace, bandwidth if len(nets) > 1 else None)
            print(
                f"plait crossover: {len(args.jobs)} jobs on {args.nodes} node(s), {net.describe()}",
                flush=True,
            )
            if not args.compare:
                runs = run_colocated(
                    cluster,
                    args.jobs,
                    mode=Mode(args.mode),
                    steps=args.steps,
                    group=args.group,
                    nproc_per_node=args.nproc_per_node,
                    threads=args.threads,
                    trace=trace,
                )
                total = 0.0
                for r in runs:
                    if not r.ok:
                        print(r.log, file=sys.stderr)
                        raise RuntimeError(f"{r.job} failed")
                    t = r.step_end_unix
                    rate = (len(t) - 1) / (t[-1] - t[0]) if len(t) > 1 else 0.0
                    total += rate * r.samples_per_step
                    print(
                        f"  {r.job}: {rate:.2f} steps/s, {rate * r.samples_per_step:.1f} "
                        f"samples/s, token {r.token}"
                    )
                print(f"  aggregate: {total:.1f} samples/s")
                continue
            comp = compare(
                cluster,
                args.jobs,
                steps=args.steps,
                warmup=args.warmup,
                repeats=args.repeats,
                group=args.group,
                nproc_per_node=args.nproc_per_node,
                threads=args.threads,
                trace=trace,
            )
            records.append(comp.to_dict())
            print(markdown(records[-1:]), flush=True)
            if args.out:
                write(records, Path(args.out), command=_command_line())
    if records:
        print(markdown(records))
    return 0


def _trace_path(trace: str | None, bandwidth: str | None) -> Path | None:
    """One trace per network setting when several run: ``t.json`` -> ``t_slow.json``."""
    if trace is None:
        return None
    path = Path(trace)
    return path if bandwidth is None else path.with_name(f"{path.stem}_{bandwidth}{path.suffix}")


def _command_line() -> str:
    return " ".join(["plait", *sys.argv[1:]])


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


def cmd_sweep(args: argparse.Namespace) -> int:
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


def cmd_bench_fused(args: argparse.Namespace) -> int:
    from plait.bench.fused import ArrayStrategy, BenchConfig, StockAdam, run_bench_fused
    from plait.bench.fused.report import markdown_table, write_reports

    if args.fidelity is not None:
        from plait.bench.fused import fidelity
        from plait.fused.ops.conv import set_conv_layout

        models = [m.strip() for m in args.models.split(",") if m.strip()]
        layout = set_conv_layout(args.conv_layout)
        try:
            results = fidelity.run_fidelity(
                models, sizes=args.n, steps=args.fidelity, batch=args.batch_size
            )
        finally:
            set_conv_layout(layout)
        print(fidelity.markdown(results))
        if args.out:
            written = fidelity.write_reports(results, Path(args.out))
            print("wrote " + ", ".join(map(str, written)))
        return 0
    cfg = BenchConfig(
        models=tuple(m.strip() for m in args.models.split(",") if m.strip()),
        sizes=args.n,
        strategies=tuple(ArrayStrategy(s.strip()) for s in args.strategies.split(",") if s.strip()),
        steps=args.steps,
        rounds=args.rounds,
        warmup=args.warmup,
        threads=args.threads,
        batch_size=args.batch_size,
        device=args.device,
        tune_malloc=not args.default_malloc,
        stock_adam=StockAdam(args.stock_adam),
        native_kernels=not args.no_native,
        conv_layout=args.conv_layout,
    )
    records = run_bench_fused(cfg)
    print(markdown_table(records))
    if args.out:
        paths = write_reports(records, Path(args.out))
        print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from plait.demo import run_demo

    return run_demo(nodes=args.nodes, out=Path(args.out), quick=args.quick)


def cmd_plan(args: argparse.Namespace) -> int:
    from plait.cluster.network import parse_rate, resolve_bandwidth
    from plait.comm import AlphaBeta
    from plait.parallel.memory import parse_bytes
    from plait.parallel.planner import plan_workload

    world = args.nodes * args.nproc_per_node
    if args.probe:
        network = _probe_network(args)
    else:
        network = AlphaBeta.from_rate(parse_rate(resolve_bandwidth(args.bandwidth)))
    choice = plan_workload(
        args.workload,
        world=world,
        network=network,
        memory_bytes=parse_bytes(args.memory) if args.memory else None,
        slots=args.slots or min(world, os.cpu_count() or 1),
        real=args.data == "real",
        batch_size=args.batch_size,
        threads=args.threads,
    )
    print(
        f"plait plan: {args.workload} on {args.nodes} node(s) x {args.nproc_per_node}: "
        f"{choice.plan.describe()}\n\nwhy: {choice.reason}\n"
    )
    print(choice.table(limit=None if args.all else 25))
    advice = _data_parallel_advice(args, world)
    print(f"\n{advice.text()}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        doc = {**choice.to_dict(), "data_parallel": {"best": advice.best, "rows": advice.rows}}
        Path(args.json).write_text(json.dumps(doc, indent=2))
    return 0


def _data_parallel_advice(args: argparse.Namespace, world: int) -> Any:
    """The projection's data-parallel strategy and optimizer for the described cluster
    (`plait.bench.project.recommend`), beside the parallel plan."""
    from plait.bench.project import recommend

    races = []
    if args.races != "none" and Path(args.races).is_dir():
        races = sorted(Path(args.races).glob("*/results.json"))
    return recommend(
        args.workload,
        world=world,
        rate=resolve_bandwidth(args.bandwidth),
        races=races,
        real=args.data == "real",
    )


def _probe_network(args: argparse.Namespace) -> Any:
    from plait.cluster import Cluster, launch
    from plait.comm import CollectiveCosts

    out = scratch_dir("plait-probe-") / "probe.json"
    net = NetworkSpec(bandwidth=args.bandwidth)
    with Cluster.create(nodes=max(2, args.nodes), network=net) as cluster:
        result = launch(
            cluster,
            ["plait.comm.probe", str(out), "--collectives"],
            module=True,
            nproc_per_node=args.nproc_per_node,
            threads=args.threads,
            timeout_s=600,
            quiet=True,
        )
    if not result.ok or not out.exists():
        raise ValueError(f"network probe failed:\n{result.tail()}")
    return CollectiveCosts.from_dict(json.loads(out.read_text())["collectives"])


# ---------------------------------------------------------------------------- validation
# Every command checks all of its input here, in the parent process, before any namespace,
# process or file exists: a typo costs one line on stderr and exit code 2, not a cluster
# built for nothing and a traceback per rank.

#: Largest emulated cluster (one /24 of veth addresses, see `plait.cluster.netns`).
MAX_NODES = 250
_GROUP_RE = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_MODULE_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")


def _int_at_least(flag: str, value: int | None, minimum: int, maximum: int | None = None) -> None:
    """ValueError naming `flag` unless `value` (when given) is in [minimum, maximum]."""
    if value is None:
        return
    if value < minimum or (maximum is not None and value > maximum):
        accepted = (
            f"an integer >= {minimum}"
            if maximum is None
            else (f"an integer from {minimum} to {maximum}")
        )
        raise ValueError(f"{flag} {value}: expected {accepted}")


def _number(
    flag: str,
    value: float | None,
    *,
    low: float,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
) -> None:
    """ValueError naming `flag` unless `value` (when given) is finite and in range."""
    if value is None:
        return
    ok = math.isfinite(value) and (value > low if low_open else value >= low)
    if high is not None:
        ok = ok and (value < high if high_open else value <= high)
    if not ok:
        lo = f"{'(' if low_open else '['}{low:g}"
        hi = f"{high:g}{')' if high_open else ']'}" if high is not None else "inf)"
        raise ValueError(f"{flag} {value}: expected a number in {lo}, {hi}")


def _creatable(flag: str, path: str, p: Path) -> None:
    """The nearest existing ancestor of `p` is a directory this process can create in.

    Tried, not inferred from permission bits: root passes every ``access`` check, yet
    cannot create a file in /proc or on a read-only mount (``--out /proc/plait.json``
    used to train to the end and then lose the metrics).
    """
    anc = p.parent
    while not anc.exists() and anc != anc.parent:
        anc = anc.parent
    if not anc.is_dir():
        raise ValueError(f"{flag} {path!r}: cannot be created, {str(anc)!r} is not a directory")
    if not os.access(anc, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {path!r}: cannot be created, {str(anc)!r} is not writable")
    probe = anc / f".plait-probe-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    except OSError as exc:
        raise ValueError(
            f"{flag} {path!r}: cannot be created in {str(anc)!r} ({exc.strerror})"
        ) from None
    os.unlink(probe)


def _writable_dir(flag: str, path: str | None) -> None:
    """`path` is a writable directory, or one that can be created."""
    if path is None:
        return
    if not str(path).strip():
        raise ValueError(f"{flag}: empty path; expected a directory")
    p = Path(path).expanduser()
    if p.exists():
        if not p.is_dir():
            raise ValueError(f"{flag} {path!r}: exists and is not a directory")
        if not os.access(p, os.W_OK | os.X_OK):
            raise ValueError(f"{flag} {path!r}: directory is not writable")
        return
    _creatable(flag, path, p)


def _writable_file(flag: str, path: str | None) -> None:
    """`path` names a file that can be written (created with its parents if need be)."""
    if path is None:
        return
    if not str(path).strip():
        raise ValueError(f"{flag}: empty path; expected a file")
    p = Path(path).expanduser()
    if p.is_dir():
        raise ValueError(f"{flag} {path!r}: is a directory; expected a file path")
    if p.exists():
        if not os.access(p, os.W_OK):
            raise ValueError(f"{flag} {path!r}: file is not writable")
        return
    _creatable(flag, path, p)


#: Bounds of every number a command takes, by its destination: (lowest, highest), both
#: included. One table for all commands, checked before any command-specific check, so a
#: flag means the same range wherever it appears and an absurd value (``--steps 1e23``,
#: ``--threads 1000000``, ``--lr 1e308``) fails in one line instead of later, in a worker.
#: Counts of steps stop at ten million (a day at 120 steps/s), processes at what one
#: emulated machine can hold, seeds at what torch's generator takes.
NUMBER_BOUNDS: dict[str, tuple[float, float]] = {
    "nproc_per_node": (1, 256),
    "threads": (1, 1024),
    "timeout": (1, 365 * 86400),
    "steps": (1, 10**7),
    "epochs": (1, 10**6),
    "max_steps": (1, 10**7),
    "warmup": (0, 10**7),
    "eval_every": (0, 10**7),
    "checkpoint_every": (0, 10**7),
    "chunk": (1, 10**7),
    "repeats": (1, 10**4),
    "rounds": (1, 10**4),
    "batch_size": (1, 10**7),
    "accumulate": (1, 10**4),
    "max_restarts": (0, 100),
    "trials": (1, 10**6),
    "max_models": (1, 4096),
    "n": (1, 4096),
    "slots": (1, 4096),
    "seed": (0, 2**63 - 1),
    "seeds": (0, 2**63 - 1),
    "lr": (1e-12, 1e3),
    "momentum": (0, 1),
    "weight_decay": (0, 1e3),
}


def check_numbers(args: argparse.Namespace) -> None:
    """Every number in `args` within `NUMBER_BOUNDS` (lists element by element)."""
    for dest, (low, high) in NUMBER_BOUNDS.items():
        value = getattr(args, dest, None)
        values = value if isinstance(value, tuple | list) else [value]
        for v in values:
            if isinstance(v, bool) or not isinstance(v, int | float):
                continue  # not given, or text checked elsewhere (race's --lr LABEL=LR)
            if not (math.isfinite(v) and low <= v <= high):
                flag = f"--{dest.replace('_', '-')}"
                kind = "an integer" if isinstance(v, int) else "a number"
                raise ValueError(
                    f"{flag} {v}: expected {kind} from {_bound(low)} to {_bound(high)}"
                )


def _bound(x: float) -> str:
    return str(x) if isinstance(x, int) else f"{x:g}"


def _bandwidths(text: str | None, *, multi: bool) -> str | None:
    """Check ``--bandwidth`` (a list when `multi`) and return it as tc reads it."""
    if text is None:
        return None
    items = [b.strip().lower() for b in text.split(",")] if multi else [text.strip().lower()]
    for b in items:
        if not b:
            raise ValueError(f"--bandwidth {text!r}: empty item; expected e.g. slow,fast")
        try:
            resolve_bandwidth(b)
        except ValueError as exc:
            raise ValueError(f"--bandwidth: {exc}") from None
    return ",".join(items)


def _check_cluster_args(args: argparse.Namespace, *, multi_bandwidth: bool = False) -> None:
    """The emulated cluster's flags; normalises --bandwidth and --latency for tc."""
    _int_at_least("--nodes", args.nodes, 1, MAX_NODES)
    _int_at_least("--nproc-per-node", args.nproc_per_node, 1)
    _int_at_least("--threads", args.threads, 1)
    _number("--timeout", args.timeout, low=0, low_open=True)
    args.bandwidth = _bandwidths(args.bandwidth, multi=multi_bandwidth)
    if args.latency is not None:
        try:
            parse_duration(args.latency)
        except ValueError as exc:
            raise ValueError(f"--latency: {exc}") from None
        args.latency = args.latency.strip().lower()
    _number("--loss", args.loss, low=0, high=100, high_open=True)
    if args.link == "model" and args.loss:
        raise ValueError(f"--loss {args.loss} with --link model: a modelled link loses no packets")
    args.placement = _placement(args.device, args.nodes * args.nproc_per_node)


def _placement(device: str, ranks: int) -> Any:
    """Where rank 0 of `ranks` on this host computes and which backend they use
    (`plait.distributed.gpu_placement`); ``cuda`` without a GPU is refused here."""
    import torch

    from plait.distributed import gpu_placement

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    kind = ("cuda" if gpus else "cpu") if device == "auto" else device
    if kind == "cuda" and not gpus:
        raise ValueError("--device cuda: this machine has no CUDA device")
    return gpu_placement(kind, host_ranks=ranks, host_index=0, gpus=gpus)


def _check_backend(strategy: Any, args: argparse.Namespace) -> None:
    """Refuse a strategy whose collectives the job's backend cannot run on its device."""
    from plait.comm import check_collectives

    place = getattr(args, "placement", None)
    if place is not None:
        check_collectives(
            f"strategy {strategy.describe()!r}",
            strategy.collectives(),
            backend=place.backend,
            device=place.device,
        )


def _export_cluster_env(args: argparse.Namespace) -> None:
    """Hand ``--device`` and ``--link`` to everything this command launches (the workers
    read PLAIT_DEVICE, `Cluster.create` reads PLAIT_LINK) and say how ranks share GPUs."""
    from plait.cluster.netns import LINK_ENV
    from plait.distributed import DEVICE_ENV

    place = args.placement
    os.environ[DEVICE_ENV] = "cuda" if place.device.startswith("cuda") else "cpu"
    os.environ[LINK_ENV] = args.link
    if place.shared:
        ranks = args.nodes * args.nproc_per_node
        print(
            f"plait {args.command}: {ranks} ranks share this host's GPU(s); their collectives "
            "go through gloo (CUDA tensors by way of pinned host memory)",
            flush=True,
        )


def _check_tensorboard(log_dir: str | None) -> None:
    """``--tensorboard DIR``: a writable directory, and TensorBoard installed."""
    if log_dir is None:
        return
    _writable_dir("--tensorboard", log_dir)
    check_tensorboard(log_dir)


def _check_group(flag: str, group: str | None) -> None:
    if group is not None and (not _GROUP_RE.fullmatch(group) or group in (".", "..")):
        raise ValueError(
            f"{flag} {group!r}: expected 1-64 letters, digits, '_', '.' or '-' (not . or ..)"
        )


def _check_token_dir(flag: str) -> None:
    """The compute token's folder is this user's own, checked here rather than in every
    worker after the namespaces exist (another user's folder, a link)."""
    from plait.crossover.token import token_dir

    try:
        token_dir()
    except PermissionError as exc:
        raise ValueError(f"{flag}: {exc}") from None


def _check_device(flag: str, device: str) -> None:
    """``cpu`` or ``cuda[:N]`` with such a GPU present."""
    m = re.fullmatch(r"cpu|cuda(?::(\d+))?", device)
    if not m:
        raise ValueError(f"{flag} {device!r}: expected cpu, cuda or cuda:N")
    if device.startswith("cuda"):
        import torch

        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        index = int(m.group(1) or 0)
        if index >= count:
            raise ValueError(f"{flag} {device!r}: this machine has {count} CUDA device(s)")


def _check_strategies(
    specs: list[str], workloads: list[str], world: int, args: argparse.Namespace | None = None
) -> None:
    """Every spec fully checked, against the job's backend and device (`args.placement`)
    and against each workload's benchmark model."""
    from plait.train.strategy import Strategy, make_strategy
    from plait.workloads import get_workload

    if not specs:
        raise ValueError("--strategies: no strategy given; e.g. ssgd,acpsgd:rank=4")
    built = []
    for spec in specs:
        strategy = make_strategy(spec)
        built.append(strategy)
        if args is not None:
            _check_backend(strategy, args)
    for w in workloads:
        wl = get_workload(w)
        model = None
        for strategy in built:
            if type(strategy).check is Strategy.check:
                continue  # nothing to check against the model: do not build it
            if model is None:
                model = wl.model(wl.bench_data(8).info, bench=True)
            strategy.check(model, world=world)
    for strategy in built:
        strategy.close()


def _workloads(text: str) -> list[str]:
    from plait.workloads import get_workload

    names = [w.strip() for w in text.split(",") if w.strip()]
    if not names:
        raise ValueError(f"--workload {text!r}: expected one or more workload names")
    for name in names:
        get_workload(name)
    return names


def _validate_train(args: argparse.Namespace) -> None:
    _check_cluster_args(args)
    for flag in ("epochs", "steps", "batch_size", "accumulate"):
        _int_at_least(f"--{flag.replace('_', '-')}", getattr(args, flag), 1)
    for flag in ("checkpoint_every", "max_restarts", "eval_every"):
        _int_at_least(f"--{flag.replace('_', '-')}", getattr(args, flag), 0)
    _number("--lr", args.lr, low=0, low_open=True)
    _number("--momentum", args.momentum, low=0)
    _number("--weight-decay", args.weight_decay, low=0)
    _writable_dir("--checkpoint", args.checkpoint)
    _writable_file("--out", args.out)
    _writable_file("--trace", args.trace)
    _check_tensorboard(args.tensorboard)
    _check_group("--crossover", args.crossover)
    if args.crossover is not None:
        _check_token_dir("--crossover")
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
        _check_backend(strategy, args)
        if type(strategy).check is not Strategy.check:  # plan degrees against world, model
            strategy.check(wl.model(data.info), world=world)
    finally:
        strategy.close()


def _validate_run(args: argparse.Namespace) -> None:
    _check_cluster_args(args)
    _int_at_least("--max-restarts", args.max_restarts, 0)
    script = args.script[1:] if args.script[:1] == ["--"] else args.script
    if not script:
        raise ValueError("give the script after --, e.g. plait run --nodes 2 -- x.py")
    if args.module:
        if not _MODULE_RE.fullmatch(script[0]):
            raise ValueError(f"-m {script[0]!r}: expected a dotted module name, e.g. pkg.train")
    elif not Path(script[0]).is_file():
        raise ValueError(f"script {script[0]!r}: no such file (use -m to run a module)")


def _validate_cluster(args: argparse.Namespace) -> None:
    _check_cluster_args(args)


def _validate_bench(args: argparse.Namespace) -> None:
    _check_cluster_args(args, multi_bandwidth=True)
    _int_at_least("--steps", args.steps, 1)
    _int_at_least("--warmup", args.warmup, 0)
    _int_at_least("--batch-size", args.batch_size, 1)
    _writable_dir("--out", args.out)
    _check_tensorboard(args.tensorboard)
    _check_strategies(
        split_specs(args.strategies),
        _workloads(args.workload),
        args.nodes * args.nproc_per_node,
        args,
    )


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


def _validate_race(args: argparse.Namespace) -> None:
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
    _check_cluster_args(args)
    for flag in ("max_steps", "eval_every", "chunk", "batch_size"):
        _int_at_least(f"--{flag.replace('_', '-')}", getattr(args, flag), 1)
    _number("--target", args.target, low=-math.inf)
    if args.metric == "accuracy":
        _number("--target", args.target, low=0, high=1, low_open=True)
    if len(set(args.seeds)) != len(args.seeds):
        raise ValueError(f"--seeds {','.join(map(str, args.seeds))}: a seed given twice")
    _writable_dir("--out", args.out)
    _workloads(args.workload)
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
            _check_backend(strategy, args)
            if type(strategy).check is not Strategy.check:
                model = model or wl.model(wl.real().info)
                strategy.check(model, world=args.nodes * args.nproc_per_node)
        finally:
            strategy.close()


def _validate_crossover(args: argparse.Namespace) -> None:
    from plait.bench.colocate import Job
    from plait.train.config import TrainConfig

    _check_cluster_args(args, multi_bandwidth=True)
    _int_at_least("--steps", args.steps, 1)
    _int_at_least("--warmup", args.warmup, 0)
    _int_at_least("--repeats", args.repeats, 1)
    if args.compare and args.warmup + 2 > args.steps:
        raise ValueError(
            f"--warmup {args.warmup} with --steps {args.steps}: --compare needs "
            "--steps >= --warmup + 2 (two steps after warm-up to measure a rate)"
        )
    _check_group("--group", args.group)
    _check_token_dir("plait crossover run")
    _writable_file("--trace", args.trace)
    _writable_dir("--out", args.out)
    if len(args.jobs) < 2:
        raise ValueError(f"{len(args.jobs)} job(s) given; crossover runs at least two")
    for i, spec in enumerate(args.jobs):
        job = Job.parse(spec, i)
        world = args.nodes * args.nproc_per_node
        if job.config is not None:
            try:
                cfg = TrainConfig(**job.config)
                _check_strategies([cfg.strategy_spec()], [cfg.workload], world, args)
            except (TypeError, ValueError) as exc:
                raise ValueError(f"job {spec!r}: {exc}") from None
        elif job.workload is not None and job.strategy is not None:
            _check_strategies([job.strategy], [job.workload], world, args)  # plans, backend
        elif job.command and not Path(job.command[0]).is_file():
            raise ValueError(
                f"job {spec!r}: no such script {job.command[0]!r} (expected WORKLOAD/STRATEGY, "
                "a JSON file of train settings, or a quoted command whose first word is a script)"
            )


def _validate_sweep(args: argparse.Namespace) -> None:
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
        _int_at_least(f"--{flag.replace('_', '-')}", getattr(args, flag), 1)
    for name in ("lr", "weight_decay"):
        lo_hi = getattr(args, name)
        flag = f"--{name.replace('_', '-')}"
        if lo_hi is not None and (len(lo_hi) != 2 or not 0 < lo_hi[0] <= lo_hi[1]):
            raise ValueError(
                f"{flag} takes a range LO,HI with 0 < LO <= HI, got {','.join(map(str, lo_hi))}"
            )
    _number("--momentum", args.momentum, low=0)
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
    _check_device("--device", args.device)
    _writable_dir("--out", args.out)
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


def _validate_bench_fused(args: argparse.Namespace) -> None:
    from plait.bench.fused import MODEL_ALIASES, ArrayStrategy, get_model

    models = [m.strip() for m in args.models.split(",") if m.strip()]
    if not models:
        raise ValueError(
            f"--workload {args.models!r}: choose from {', '.join(MODEL_ALIASES)}, a registry "
            "workload or a factory"
        )
    for m in models:
        get_model(m)  # resolves the workload and builds one model: errors name it
    names = [s.strip() for s in args.strategies.split(",") if s.strip()]
    accepted = [s.value for s in ArrayStrategy]
    if not names or any(n not in accepted for n in names):
        raise ValueError(f"--strategies {args.strategies!r}: choose from {', '.join(accepted)}")
    for flag, values in (("--n", args.n), ("--threads", args.threads)):
        if any(v < 1 for v in values):
            raise ValueError(f"{flag} {','.join(map(str, values))}: expected integers >= 1")
    for flag in ("steps", "rounds", "batch_size"):
        _int_at_least(f"--{flag.replace('_', '-')}", getattr(args, flag), 1)
    _int_at_least("--warmup", args.warmup, 0)
    _check_device("--device", args.device)
    _writable_dir("--out", args.out)
    if args.fidelity is not None:
        _int_at_least("--fidelity", args.fidelity, 1)
        if args.device != "cpu":
            raise ValueError("--fidelity measures on the CPU (float64 references): drop --device")


def _validate_demo(args: argparse.Namespace) -> None:
    _int_at_least("--nodes", args.nodes, 1, MAX_NODES)
    _writable_dir("--out", args.out)


def _validate_plan(args: argparse.Namespace) -> None:
    _workloads(args.workload)
    if "," in args.workload:
        raise ValueError(f"--workload {args.workload!r}: plan takes one workload")
    _int_at_least("--nodes", args.nodes, 1, MAX_NODES)
    for flag in ("nproc_per_node", "batch_size", "slots", "threads"):
        _int_at_least(f"--{flag.replace('_', '-')}", getattr(args, flag), 1)
    if args.memory is not None:
        parse_size(args.memory, what="--memory size")
    args.bandwidth = _bandwidths(args.bandwidth, multi=False)
    _writable_file("--json", args.json)
    default_races = _subcommand(build_parser(), "plan").get_default("races")
    if args.races not in ("none", default_races) and not Path(args.races).is_dir():
        raise ValueError(f"--races {args.races!r}: not a folder of race results (or 'none')")


# ---------------------------------------------------------------------------- run configs
#: Parser entries a run config may not set: they steer the parser or this process itself.
_NOT_CONFIGURABLE = frozenset({"help", "config", "debug", "version", "verbose", "quiet"})


def _subcommand(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            child: argparse.ArgumentParser = action.choices[name]
            return child
    raise AssertionError(f"no subcommand {name!r}")


def _config_flags(sub: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """The flags of a subcommand a run config may set, by destination."""
    return {a.dest: a for a in sub._actions if a.option_strings and a.dest not in _NOT_CONFIGURABLE}


def _config_value(where: str, key: str, value: object, action: argparse.Action) -> object:
    """A TOML value as the flag's parsed value; ValueError naming the key otherwise."""
    if action.nargs == 0:  # an on/off switch
        if not isinstance(value, bool):
            raise ValueError(f"{where}: key {key!r}: expected true or false, got {value!r}")
        return value
    if isinstance(value, list):
        # a list of names stands for the flag's comma-separated text; strategy specs whose
        # options hold commas are separated by ';', as on the command line
        if action.type is not None or not all(isinstance(v, str) for v in value):
            raise ValueError(f"{where}: key {key!r}: expected one value, got a list")
        sep = ";" if action.dest == "strategies" and any("," in v for v in value) else ","
        value = sep.join(value)
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise ValueError(f"{where}: key {key!r}: expected a {_kind(action)}, got {value!r}")
    if action.type is None:
        value = str(value)
    elif action.type is int and isinstance(value, float):
        raise ValueError(f"{where}: key {key!r}: expected an integer, got {value!r}")
    elif not isinstance(value, str) and action.type in (int, float):
        value = action.type(value)
    else:
        convert: Callable[[str], object] = action.type  # type: ignore[assignment]
        try:
            value = convert(str(value))
        except (ValueError, TypeError, argparse.ArgumentTypeError) as exc:
            raise ValueError(f"{where}: key {key!r}: {exc}") from None
    if action.choices is not None and value not in action.choices:
        choices = ", ".join(map(str, action.choices))
        raise ValueError(f"{where}: key {key!r}: {value!r} is not one of {choices}")
    return value


def _kind(action: argparse.Action) -> str:
    if action.type is int:
        return "integer"
    return "number" if action.type is float else "string"


def load_run_config(path: str, sub: argparse.ArgumentParser) -> dict[str, object]:
    """The flag values a TOML run config sets for subcommand `sub`, by destination.

    Keys are the subcommand's flag names without the leading dashes, with dashes or
    underscores (``batch-size`` or ``batch_size``); values are TOML strings, numbers or
    booleans, and lists of strings for the comma-separated flags. Raises ValueError naming
    an unknown key (with the accepted ones) or a value the flag would refuse.
    """
    where = f"--config {path}"
    try:
        data = tomllib.loads(Path(path).expanduser().read_text())
    except FileNotFoundError:
        raise ValueError(f"{where}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{where}: cannot be read ({exc})") from None
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{where}: not valid TOML: {exc}") from None
    flags = _config_flags(sub)
    values: dict[str, object] = {}
    for key, value in data.items():
        action = flags.get(key.replace("-", "_"))
        if action is None:
            accepted = ", ".join(sorted(d.replace("_", "-") for d in flags))
            raise ValueError(f"{where}: unknown key {key!r} (accepted: {accepted})")
        if action.dest in values:
            raise ValueError(f"{where}: key {key!r} given twice (dashes and underscores)")
        values[action.dest] = _config_value(where, key, value, action)
    return values


def parse_command_line(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse `argv` and merge the ``--config`` run config under it.

    The config's values become the subcommand's defaults, so a flag given on the command
    line wins; it also wins over the config's value of a flag it excludes (``--epochs``
    over a config's ``steps``). Raises ValueError for a bad config (exit 2 in `main`).
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    if getattr(args, "config", None) is None:
        return args
    parser = build_parser()
    sub = _subcommand(parser, args.command)
    values = load_run_config(args.config, sub)
    given = _given_on_command_line(argv, args.command)
    for group in sub._mutually_exclusive_groups:
        dests = {a.dest for a in group._group_actions}
        if dests & given:
            for dest in dests - given:
                values.pop(dest, None)
    sub.set_defaults(**values)
    return parser.parse_args(argv)


def _given_on_command_line(argv: list[str], command: str) -> set[str]:
    """The destinations of the subcommand flags `argv` sets itself."""
    parser = build_parser()
    for action in _subcommand(parser, command)._actions:
        action.default = argparse.SUPPRESS
    return set(vars(parser.parse_args(argv)))


VALIDATORS: dict[str, Callable[[argparse.Namespace], None]] = {
    "demo": _validate_demo,
    "train": _validate_train,
    "run": _validate_run,
    "cluster": _validate_cluster,
    "bench": _validate_bench,
    "race": _validate_race,
    "crossover": _validate_crossover,
    "sweep": _validate_sweep,
    "bench-fused": _validate_bench_fused,
    "plan": _validate_plan,
}


COMMANDS = {
    "demo": cmd_demo,
    "train": cmd_train,
    "run": cmd_run,
    "cluster": cmd_cluster,
    "bench": cmd_bench,
    "race": cmd_race,
    "crossover": cmd_crossover,
    "sweep": cmd_sweep,
    "bench-fused": cmd_bench_fused,
    "plan": cmd_plan,
}


def _fail(args: argparse.Namespace, code: int, message: str) -> NoReturn:
    """Exit with one line on stderr (and the traceback first under --debug)."""
    if getattr(args, "debug", False) or os.environ.get("PLAIT_DEBUG") not in (None, "", "0"):
        traceback.print_exc()
    message = " ".join(message.split())  # one line, whatever the exception held
    sys.stderr.write(f"plait {args.command}: error: {message}\n")
    sys.stderr.flush()
    raise SystemExit(code)


def main(argv: list[str] | None = None) -> int:
    """Parse, check every input (exit 2 on a bad one), then run the command.

    Bad input, found before anything is built or in the command itself (ValueError), exits
    with code 2; any other error with code 1; both print one line unless ``--debug``.
    """
    try:
        # a Ctrl-C while torch imports (parsing, checking) stops the command once they end
        with interrupts_held():
            args = build_parser().parse_args(argv)
    except KeyboardInterrupt:
        print("\nplait: interrupted", file=sys.stderr)
        return 130
    try:
        with interrupts_held():
            args = parse_command_line(argv)
            configure(level_from(args.verbose, args.quiet))
            check_numbers(args)
            VALIDATORS[args.command](args)
        if hasattr(args, "placement"):
            _export_cluster_env(args)
        return COMMANDS[args.command](args)
    except ValueError as exc:
        _fail(args, 2, str(exc))
    except KeyboardInterrupt:
        print("\nplait: interrupted; cluster torn down", file=sys.stderr)
        return 130
    except Exception as exc:  # every other error ends as one line too; --debug shows all
        _fail(args, 1, f"{type(exc).__name__}: {exc}")


if __name__ == "__main__":
    sys.exit(main())
