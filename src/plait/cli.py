"""The `plait` command line; flag spellings are a public contract (see the README)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

from plait.cluster.network import NAMED_RATES, NetworkSpec


def _add_cluster_args(p: argparse.ArgumentParser, *, multi_bandwidth: bool = False) -> None:
    g = p.add_argument_group("emulated cluster")
    g.add_argument("--nodes", type=int, default=1, help="emulated nodes (network namespaces)")
    g.add_argument("--nproc-per-node", type=int, default=1, help="worker processes per node")
    bw_help = (
        f"egress rate per node: a tc rate (100mbit, 1gbit) or a named setting "
        f"({', '.join(f'{k}={v}' for k, v in NAMED_RATES.items())})"
    )
    if multi_bandwidth:
        bw_help += "; a comma-separated list runs each"
    g.add_argument("--bandwidth", default=None, help=bw_help)
    g.add_argument("--latency", default=None, help="added one-way delay per link, e.g. 2ms")
    g.add_argument("--loss", type=float, default=None, help="packet loss per link, percent")
    g.add_argument("--threads", type=int, default=1, help="intra-op threads per worker process")
    g.add_argument("--timeout", type=float, default=None, help="wall-clock limit in seconds")


def _add_train_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workload", default="mlp", help="mlp, resnet18, vgg or gpt")
    p.add_argument("--strategy", default="ssgd", help="strategy spec, e.g. ssgd or acpsgd:rank=4")
    p.add_argument("--data", default="real", choices=["real", "synthetic"])
    n = p.add_mutually_exclusive_group()
    n.add_argument("--epochs", type=int, default=None, help="passes over the data")
    n.add_argument("--steps", type=int, default=None, help="optimizer steps (instead of epochs)")
    p.add_argument("--batch-size", type=int, default=None, help="per-worker batch size")
    p.add_argument("--accumulate", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--lr", type=float, default=None)
    p.add_argument("--optimizer", default=None, choices=["sgd", "adam", "adamw"])
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoint", default=None, help="checkpoint directory (resumes from it)")
    p.add_argument("--checkpoint-every", type=int, default=0, help="steps between checkpoints")
    p.add_argument("--max-restarts", type=int, default=3, help="torchrun restarts after a failure")
    p.add_argument("--trace", default=None, help="write a merged Chrome trace here")
    p.add_argument("--out", default=None, help="write the run's metrics (JSON) here")
    p.add_argument("--eval-every", type=int, default=0,
                   help="also evaluate every K steps (a learning curve in --out)")  # fmt: skip
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(
        "--crossover",
        default=None,
        metavar="GROUP",
        help="share each device's compute token with co-located jobs of GROUP",
    )
    p.add_argument(
        "--plan",
        default=None,
        help="n-D parallel plan, e.g. dp=2,tp=2,zero=3 or pp=4,schedule=interleaved, or auto "
        "(--strategy then names the data axis's compressor)",
    )
    p.add_argument("--memory", default=None, help="memory per device for --plan auto, e.g. 2GiB")


def train_config_from_args(args: argparse.Namespace) -> Any:
    from plait.train.loop import TrainConfig

    names = {f.name for f in fields(TrainConfig)}
    values = {k: v for k, v in vars(args).items() if k in names}
    values["progress"] = not args.no_progress
    return TrainConfig(**values)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="plait",
        description="Braid computation and communication: faster PyTorch training where "
        "hardware sits idle.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    d = sub.add_parser("demo", help="end-to-end demonstration on an emulated 4-node cluster")
    d.add_argument("--nodes", type=int, default=4)
    d.add_argument("--out", default="runs/demo", help="where the demo writes its results")
    d.add_argument("--quick", action="store_true", help="fewer steps (for smoke tests)")

    t = sub.add_parser("train", help="train a workload with a strategy")
    _add_train_args(t)
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
    pl.add_argument("--workload", default="gpt", help="mlp, resnet18, vgg or gpt")
    pl.add_argument("--nodes", type=int, default=4, help="nodes of the cluster to plan for")
    pl.add_argument("--nproc-per-node", type=int, default=1, help="ranks per node")
    pl.add_argument("--memory", default=None, help="memory per device, e.g. 2GiB (default: none)")
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
    return parser


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(v) for v in text.split(",") if v.strip())


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split(",") if v.strip())


def _bytes(text: str) -> int:
    """A size such as 512MB, 2GB or a plain byte count."""
    units = {"kb": 1 << 10, "mb": 1 << 20, "gb": 1 << 30, "tb": 1 << 40, "b": 1}
    t = text.strip().lower()
    for unit, factor in units.items():
        if t.endswith(unit) and t[: -len(unit)].replace(".", "", 1).isdigit():
            return int(float(t[: -len(unit)]) * factor)
    if t.isdigit():
        return int(t)
    raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 512MB, 2GB)")


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
                   help="memory one array may use, e.g. 2GB (default: half of free)")  # fmt: skip
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


def _split_specs(text: str) -> list[str]:
    """Split a strategy list; options use commas too, so ';' separates when present."""
    if ";" in text:
        return [s.strip() for s in text.split(";") if s.strip()]
    out: list[str] = []
    for part in (s.strip() for s in text.split(",")):
        if not part:
            continue
        if "=" in part and ":" not in part and out:
            out[-1] += "," + part  # an option of the previous spec
        else:
            out.append(part)
    return out


def _network(args: argparse.Namespace, bandwidth: str | None = None) -> NetworkSpec:
    return NetworkSpec(
        bandwidth=bandwidth if bandwidth is not None else args.bandwidth,
        latency=args.latency,
        loss=args.loss,
    )


def _check_plan(cfg: Any, world: int) -> None:
    """Fail before launching when an explicit plan does not fit the world or the model."""
    if cfg.plan is None or cfg.plan.strip() == "auto":
        return
    from plait.bench.workloads import get_workload
    from plait.parallel import Plan, adapter_for

    wl = get_workload(cfg.workload)
    data = wl.real() if cfg.data == "real" else wl.synthetic(8)
    model = wl.model(data.info)
    Plan.parse(cfg.plan).validate(world=world, dims=adapter_for(model).dims(model))


def cmd_train(args: argparse.Namespace) -> int:
    cfg = train_config_from_args(args)
    if "RANK" in os.environ:  # already launched by torchrun: train in this process
        from plait.train.loop import train

        train(cfg)
        return 0
    from plait.cluster import Cluster, launch

    _check_plan(cfg, args.nodes * args.nproc_per_node)
    cfg_path = Path(tempfile.mkdtemp(prefix="plait-train-")) / "config.json"
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
    out = Path(tempfile.mkdtemp(prefix="plait-probe-")) / "probe.json"
    with Cluster.create(nodes=nodes, network=_network(args)) as cluster:
        print(f"probing all-reduce on {nodes} node(s) x {args.nproc_per_node}, "
              f"{cluster.network.describe()} ...", flush=True)  # fmt: skip
        result = launch(
            cluster,
            ["plait.bench.probe", str(out)],
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
        strategies=_split_specs(args.strategies),
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
    from plait.cluster import Cluster
    from plait.crossover.colocate import Job, Mode, compare, run_colocated
    from plait.crossover.report import markdown, write

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
    from plait.fused.bench import BenchConfig, StockAdam, Strategy, run_bench_fused
    from plait.fused.bench.report import markdown_table, write_reports

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
    print(f"plait plan: {args.workload} on {args.nodes} node(s) x {args.nproc_per_node}: "
          f"{choice.plan.describe()}\n")  # fmt: skip
    print(choice.table(limit=None if args.all else 25))
    if args.json:
        Path(args.json).write_text(json.dumps(choice.to_dict(), indent=2))
    return 0


def _probe_network(args: argparse.Namespace) -> Any:
    from plait.cluster import Cluster, launch
    from plait.comm import CollectiveCosts

    out = Path(tempfile.mkdtemp(prefix="plait-probe-")) / "probe.json"
    net = NetworkSpec(bandwidth=args.bandwidth)
    with Cluster.create(nodes=max(2, args.nodes), network=net) as cluster:
        result = launch(cluster, ["plait.bench.probe", str(out), "--collectives"], module=True,
                        nproc_per_node=args.nproc_per_node, threads=args.threads,
                        timeout_s=600, quiet=True)  # fmt: skip
    if not result.ok or not out.exists():
        raise ValueError(f"network probe failed:\n{result.tail()}")
    return CollectiveCosts.from_dict(json.loads(out.read_text())["collectives"])


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


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except ValueError as exc:
        parser.exit(2, f"plait {args.command}: error: {exc}\n")
    except KeyboardInterrupt:
        print("\nplait: interrupted; cluster torn down", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
