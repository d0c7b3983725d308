"""The `plait` command line; flag spellings are a public contract (see the README)."""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import traceback
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any, NoReturn

from plait._proc import scratch_dir
from plait.cluster.network import NAMED_RATES, NetworkSpec, parse_duration, resolve_bandwidth
from plait.specs import split_specs
from plait.train.args import add_train_args, config_from_args
from plait.units import parse_size


class _Parser(argparse.ArgumentParser):
    """argparse whose usage errors are one line: the flag, the bad value, what it takes."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _add_cluster_args(p: argparse.ArgumentParser, *, multi_bandwidth: bool = False) -> None:
    g = p.add_argument_group("emulated cluster")
    g.add_argument("--nodes", type=int, default=1, help="emulated nodes (network namespaces)")
    g.add_argument("--nproc-per-node", type=int, default=1, help="worker processes per node")
    bw_help = (
        f"egress rate per node: a tc rate from 1kbit to 1tbit (100mbit, 1gbit; bps is bytes/s, "
        f"as in tc) or a named setting "
        f"({', '.join(f'{k}={v}' for k, v in NAMED_RATES.items())})"
    )
    if multi_bandwidth:
        bw_help += "; a comma-separated list runs each"
    g.add_argument("--bandwidth", default=None, help=bw_help)
    g.add_argument(
        "--latency", default=None, help="added one-way delay per link, up to 60s, e.g. 2ms"
    )
    g.add_argument(
        "--loss", type=float, default=None, help="packet loss per link, percent in [0, 100)"
    )
    g.add_argument("--threads", type=int, default=1, help="intra-op threads per worker process")
    g.add_argument("--timeout", type=float, default=None, help="wall-clock limit in seconds")


def _version_text() -> str:
    import torch

    from plait import __version__

    return f"plait {__version__} (torch {torch.__version__})"


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="plait",
        description="Braid computation and communication: faster PyTorch training where "
        "hardware sits idle.",
    )
    parser.add_argument("--debug", action="store_true",
                        help="show the traceback of an error (also PLAIT_DEBUG=1)")  # fmt: skip
    parser.add_argument("--version", action="version", version=_version_text())
    sub = parser.add_subparsers(dest="command", required=True)

    d = sub.add_parser("demo", help="end-to-end demonstration on an emulated 4-node cluster")
    d.add_argument("--nodes", type=int, default=4)
    d.add_argument("--out", default="runs/demo", help="where the demo writes its results")
    d.add_argument("--quick", action="store_true", help="fewer steps (for smoke tests)")

    t = sub.add_parser("train", help="train a workload with a strategy")
    add_train_args(t)
    _add_cluster_args(t)

    r = sub.add_parser("run", help="run a script on an emulated cluster (one torchrun per node)")
    _add_cluster_args(r)
    r.add_argument("--max-restarts", type=int, default=0)
    r.add_argument("-m", "--module", action="store_true", help="run SCRIPT as a module")
    r.add_argument("script", nargs=argparse.REMAINDER, help="-- SCRIPT ARGS...")

    c = sub.add_parser("cluster", help="manage emulated clusters")
    c.add_argument("action", choices=["up", "down", "status", "probe"])
    c.add_argument("--all", action="store_true", help="down: also clusters of running jobs")
    _add_cluster_args(c)

    b = sub.add_parser("bench", help="benchmark strategies side by side")
    b.add_argument("--workload", default="resnet18", help="workload(s), comma-separated")
    b.add_argument("--strategies", default="ssgd", help="strategy specs, comma-separated; use ; "
                   "between specs whose options contain commas")  # fmt: skip
    _add_cluster_args(b, multi_bandwidth=True)
    b.add_argument("--steps", type=int, default=10, help="measured steps per strategy")
    b.add_argument("--warmup", type=int, default=2, help="discarded steps per strategy")
    b.add_argument("--batch-size", type=int, default=None, help="per-worker batch size")
    b.add_argument("--out", default=None, help="output directory (results.json/.md/.png)")
    b.add_argument("--trace", action="store_true", help="write a merged trace per job")
    b.set_defaults(nodes=4)

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
    xr.add_argument("--compare", action="store_true",
                    help="measure alone (sequential), uncoordinated and crossover")  # fmt: skip
    xr.add_argument("--trace", default=None, help="merged timeline of the co-located jobs")
    xr.add_argument("--out", default=None, help="output directory (results.json/.md/.png)")
    xr.set_defaults(nodes=4)
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
    _add_debug_flag(parser)
    return parser


def _add_debug_flag(parser: argparse.ArgumentParser) -> None:
    """Accept ``--debug`` after any subcommand too (``plait train ... --debug``)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                if not any("--debug" in a.option_strings for a in child._actions):
                    child.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                                       help="show the traceback of an error")  # fmt: skip
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


def _add_sweep_parser(sub: Any) -> None:
    s = sub.add_parser(
        "sweep",
        help="hyper-parameter sweep with Optuna, trials trained as fused arrays",
        description="Ask Optuna for trials, train them N at a time as one fused array, "
        "report each trial's validation accuracy per epoch (pruned trials leave their "
        "array), tell Optuna the results.",
    )
    s.add_argument("--task", default="digits-cnn", help="digits-cnn or digits-mlp")
    s.add_argument("--trials", type=int, default=32, help="trials in the study (all processes)")
    s.add_argument("--epochs", type=int, default=10, help="epochs per trial")
    s.add_argument("--study", default=None, help="Optuna study name (default: the task)")
    s.add_argument("--storage", default=None,
                   help="Optuna storage URL (default sqlite:///runs/plait-sweeps.db; "
                        "e.g. postgresql://... to share a sweep between machines)")  # fmt: skip
    s.add_argument("--restart", action="store_true",
                   help="delete an existing study of that name first (a fresh run)")  # fmt: skip
    s.add_argument("--max-models", type=int, default=64, help="largest array to try")
    s.add_argument("--memory-budget", type=_bytes, default=None,
                   help="memory one array may use: 2GiB = 2*2^30 bytes, 2GB = 2*10^9 "
                        "(default: half of free)")  # fmt: skip
    s.add_argument("--pruner", default="median", choices=["median", "asha", "none"])
    s.add_argument("--sampler", default="tpe", choices=["tpe", "random"])
    s.add_argument("--lr", type=_floats, default=(1e-3, 1.0), help="learning-rate range LO,HI")
    s.add_argument("--weight-decay", type=_floats, default=(1e-6, 1e-2),
                   help="weight-decay range LO,HI")  # fmt: skip
    s.add_argument("--momentum", type=float, default=0.9)
    s.add_argument("--batch-sizes", type=_ints, default=(32,),
                   help="batch-size choices (non-fusible: one array per value)")  # fmt: skip
    s.add_argument("--widths", type=_ints, default=(8,),
                   help="model-width choices (non-fusible: one array per value)")  # fmt: skip
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--device", default="cpu", help="cpu or cuda")
    s.add_argument("--threads", type=int, default=None, help="intra-op threads")
    s.add_argument("--out", default=None, help="report directory (default runs/sweeps/STUDY)")
    s.add_argument("--no-progress", action="store_true")
    s.add_argument("--default-malloc", action="store_true",
                   help="keep glibc's malloc thresholds (default: raised)")  # fmt: skip


def _add_bench_fused_parser(sub: Any) -> None:
    f = sub.add_parser(
        "bench-fused",
        help="throughput of N models trained fused vs serially, as processes, with vmap",
    )
    f.add_argument("--models", default="mlp,cnn,transformer",
                   help="benchmark models, comma-separated: mlp, cnn, transformer")  # fmt: skip
    f.add_argument("--n", type=_ints, default=(1, 2, 4, 8, 16, 32), help="array sizes")
    f.add_argument("--strategies", default="fused,serial,concurrent,vmap",
                   help="fused, serial, concurrent, vmap (comma-separated)")  # fmt: skip
    f.add_argument("--steps", type=int, default=5, help="timed steps per round")
    f.add_argument("--rounds", type=int, default=9, help="interleaved rounds per strategy")
    f.add_argument("--warmup", type=int, default=3, help="untimed steps before the rounds")
    f.add_argument("--threads", type=_ints, default=(1,),
                   help="intra-op thread counts of every process, e.g. 1,2: every strategy "
                        "runs at each")  # fmt: skip
    f.add_argument("--batch-size", type=int, default=None, help="per-model batch size")
    f.add_argument("--device", default="cpu", help="cpu or cuda")
    f.add_argument("--out", default=None, help="output directory (results.json/.md/.png)")
    f.add_argument("--default-malloc", action="store_true",
                   help="keep glibc's malloc thresholds (default: raised)")  # fmt: skip
    f.add_argument("--stock-adam", default="fused", choices=["fused", "foreach", "for-loop"],
                   help="torch.optim.Adam implementation of the serial, concurrent and vmap "
                        "strategies (default: fused, the kernel FusedAdam runs too)")  # fmt: skip
    f.add_argument("--no-native", action="store_true",
                   help="fused arrays on torch's kernels only, without plait's native CPU "
                        "kernels (plait.fused.native)")  # fmt: skip


def _network(args: argparse.Namespace, bandwidth: str | None = None) -> NetworkSpec:
    return NetworkSpec(
        bandwidth=bandwidth if bandwidth is not None else args.bandwidth,
        latency=args.latency,
        loss=args.loss,
    )


def cmd_train(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    if "RANK" in os.environ:  # already launched by torchrun: train in this process
        from plait.train.loop import train

        train(cfg)
        return 0
    from plait.cluster import Cluster, launch

    cfg_path = scratch_dir("plait-train-") / "config.json"
    cfg_path.write_text(json.dumps(asdict(cfg)))
    with Cluster.create(nodes=args.nodes, network=_network(args)) as cluster:
        print(f"plait train: {cfg.workload} / {cfg.strategy_spec()} on {args.nodes} node(s) x "
              f"{args.nproc_per_node} ({cluster.network.describe()})", flush=True)  # fmt: skip
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
        print(f"plait train: failed (exit codes {result.returncodes})", file=sys.stderr)
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
        print(f"probing all-reduce on {nodes} node(s) x {args.nproc_per_node}, "
              f"{cluster.network.describe()} ...", flush=True)  # fmt: skip
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

    print(markdown_table(records))
    if out is not None:
        paths = write_reports(records, out)
        print("wrote " + ", ".join(str(p) for p in paths.values()))
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
            print(f"plait crossover: {len(args.jobs)} jobs on {args.nodes} node(s), "
                  f"{net.describe()}", flush=True)  # fmt: skip
            if not args.compare:
                runs = run_colocated(
                    cluster, args.jobs, mode=Mode(args.mode), steps=args.steps, group=args.group,
                    nproc_per_node=args.nproc_per_node, threads=args.threads, trace=trace,
                )  # fmt: skip
                total = 0.0
                for r in runs:
                    if not r.ok:
                        print(r.log, file=sys.stderr)
                        raise RuntimeError(f"{r.job} failed")
                    t = r.step_end_unix
                    rate = (len(t) - 1) / (t[-1] - t[0]) if len(t) > 1 else 0.0
                    total += rate * r.samples_per_step
                    print(f"  {r.job}: {rate:.2f} steps/s, {rate * r.samples_per_step:.1f} "
                          f"samples/s, token {r.token}")  # fmt: skip
                print(f"  aggregate: {total:.1f} samples/s")
                continue
            comp = compare(
                cluster, args.jobs, steps=args.steps, warmup=args.warmup, repeats=args.repeats,
                group=args.group,
                nproc_per_node=args.nproc_per_node, threads=args.threads, trace=trace,
            )  # fmt: skip
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


def cmd_sweep(args: argparse.Namespace) -> int:
    import torch

    from plait.fused.sweep import PrunerKind, SamplerKind, SearchSpace, SweepConfig, digits_task
    from plait.fused.sweep import run_sweep as run
    from plait.fused.sweep.report import write_reports

    for name in ("lr", "weight_decay"):
        if len(getattr(args, name)) != 2:
            raise ValueError(f"--{name.replace('_', '-')} takes a range LO,HI")
    if args.threads:
        torch.set_num_threads(args.threads)
    if not args.default_malloc:
        from plait.fused.malloc import tune_malloc

        tune_malloc()
    space = SearchSpace(lr=args.lr, weight_decay=args.weight_decay, momentum=args.momentum,
                        batch_sizes=args.batch_sizes, widths=args.widths)  # fmt: skip
    task = digits_task(args.task, space)
    cfg = SweepConfig(
        trials=args.trials, epochs=args.epochs, study=args.study, storage=args.storage,
        max_models=args.max_models, memory_budget=args.memory_budget,
        pruner=PrunerKind(args.pruner), sampler=SamplerKind(args.sampler), seed=args.seed,
        device=args.device, progress=not args.no_progress,
    )  # fmt: skip
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
    from plait.bench.fused import BenchConfig, StockAdam, Strategy, run_bench_fused
    from plait.bench.fused.report import markdown_table, write_reports

    cfg = BenchConfig(
        models=tuple(m.strip() for m in args.models.split(",") if m.strip()),
        sizes=args.n,
        strategies=tuple(Strategy(s.strip()) for s in args.strategies.split(",") if s.strip()),
        steps=args.steps, rounds=args.rounds, warmup=args.warmup, threads=args.threads,
        batch_size=args.batch_size, device=args.device, tune_malloc=not args.default_malloc,
        stock_adam=StockAdam(args.stock_adam), native_kernels=not args.no_native,
    )  # fmt: skip
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
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(choice.to_dict(), indent=2))
    return 0


def _probe_network(args: argparse.Namespace) -> Any:
    from plait.cluster import Cluster, launch
    from plait.comm import CollectiveCosts

    out = scratch_dir("plait-probe-") / "probe.json"
    net = NetworkSpec(bandwidth=args.bandwidth)
    with Cluster.create(nodes=max(2, args.nodes), network=net) as cluster:
        result = launch(cluster, ["plait.comm.probe", str(out), "--collectives"], module=True,
                        nproc_per_node=args.nproc_per_node, threads=args.threads,
                        timeout_s=600, quiet=True)  # fmt: skip
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
        accepted = f"an integer >= {minimum}" if maximum is None else (
            f"an integer from {minimum} to {maximum}")  # fmt: skip
        raise ValueError(f"{flag} {value}: expected {accepted}")


def _number(
    flag: str, value: float | None, *, low: float, high: float | None = None,
    low_open: bool = False, high_open: bool = False,
) -> None:  # fmt: skip
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
    """The nearest existing ancestor of `p` is a directory this process may write into."""
    anc = p.parent
    while not anc.exists() and anc != anc.parent:
        anc = anc.parent
    if not anc.is_dir():
        raise ValueError(f"{flag} {path!r}: cannot be created, {str(anc)!r} is not a directory")
    if not os.access(anc, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {path!r}: cannot be created, {str(anc)!r} is not writable")


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


def _check_group(flag: str, group: str | None) -> None:
    if group is not None and (not _GROUP_RE.fullmatch(group) or group in (".", "..")):
        raise ValueError(
            f"{flag} {group!r}: expected 1-64 letters, digits, '_', '.' or '-' (not . or ..)"
        )


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


def _check_strategies(specs: list[str], workloads: list[str], world: int) -> None:
    """Every spec fully checked, and each against each workload's benchmark model."""
    from plait.train.strategy import Strategy, make_strategy
    from plait.workloads import get_workload

    if not specs:
        raise ValueError("--strategies: no strategy given; e.g. ssgd,acpsgd:rank=4")
    built = []
    for spec in specs:
        strategy = make_strategy(spec)
        built.append(strategy)
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
    _check_group("--crossover", args.crossover)
    if args.memory is not None:
        parse_size(args.memory, what="--memory size")
    cfg = config_from_args(args)  # workload, strategy spec and its options
    if "RANK" in os.environ:
        return  # a worker: the parent checked the rest before launching
    from plait.train.strategy import Strategy, make_strategy
    from plait.workloads import get_workload

    strategy = make_strategy(cfg.strategy_spec())
    try:
        if type(strategy).check is not Strategy.check:  # plan degrees against world, model
            wl = get_workload(cfg.workload)
            data = wl.real() if cfg.data == "real" else wl.bench_data(8)
            strategy.check(wl.model(data.info), world=args.nodes * args.nproc_per_node)
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
    _check_strategies(
        split_specs(args.strategies), _workloads(args.workload), args.nodes * args.nproc_per_node
    )


def _validate_crossover(args: argparse.Namespace) -> None:
    from plait.bench.colocate import Job
    from plait.train.loop import TrainConfig

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
                _check_strategies([cfg.strategy_spec()], [cfg.workload], world)
            except (TypeError, ValueError) as exc:
                raise ValueError(f"job {spec!r}: {exc}") from None
        elif job.workload is not None and job.strategy is not None:
            _check_strategies([job.strategy], [job.workload], world)  # plans against the world
        elif job.command and not Path(job.command[0]).is_file():
            raise ValueError(
                f"job {spec!r}: no such script {job.command[0]!r} (expected WORKLOAD/STRATEGY, "
                "a JSON file of train settings, or a quoted command whose first word is a script)"
            )


def _validate_sweep(args: argparse.Namespace) -> None:
    from plait.fused.sweep.task import TASK_NAMES

    if args.task not in TASK_NAMES:
        raise ValueError(f"--task {args.task!r}: choose from {', '.join(TASK_NAMES)}")
    for flag in ("trials", "epochs", "max_models", "threads"):
        _int_at_least(f"--{flag.replace('_', '-')}", getattr(args, flag), 1)
    for name in ("lr", "weight_decay"):
        lo_hi = getattr(args, name)
        flag = f"--{name.replace('_', '-')}"
        if len(lo_hi) != 2 or not 0 < lo_hi[0] <= lo_hi[1]:
            raise ValueError(
                f"{flag} {','.join(map(str, lo_hi))}: expected a range LO,HI with 0 < LO <= HI"
            )
    _number("--momentum", args.momentum, low=0)
    for flag, values in (("--batch-sizes", args.batch_sizes), ("--widths", args.widths)):
        if any(v < 1 for v in values):
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


def _validate_bench_fused(args: argparse.Namespace) -> None:
    from plait.bench.fused import BENCH_MODELS, Strategy

    models = [m.strip() for m in args.models.split(",") if m.strip()]
    if not models:
        raise ValueError(f"--models {args.models!r}: choose from {', '.join(BENCH_MODELS)}")
    for m in models:
        if m not in BENCH_MODELS:
            raise ValueError(
                f"--models: unknown model {m!r}; choose from {', '.join(BENCH_MODELS)}"
            )
    names = [s.strip() for s in args.strategies.split(",") if s.strip()]
    accepted = [s.value for s in Strategy]
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


VALIDATORS: dict[str, Callable[[argparse.Namespace], None]] = {
    "demo": _validate_demo,
    "train": _validate_train,
    "run": _validate_run,
    "cluster": _validate_cluster,
    "bench": _validate_bench,
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
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        VALIDATORS[args.command](args)
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
