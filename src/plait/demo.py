"""`plait demo`: a real distributed job on an emulated 4-node cluster, in a few minutes.

1. builds 4 network namespaces linked at the `slow` setting and measures the links;
2. trains the MLP on the bundled digits with S-SGD across the 4 nodes (progress bar,
   per-epoch test accuracy, a checkpoint);
3. benchmarks the data-parallel strategies side by side on the 8.4 M-parameter MLP at the
   `slow` and `fast` settings and prints the table.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from plait.bench.report import markdown_table, write_reports
from plait.bench.runner import run_bench
from plait.cluster import Cluster, NetworkSpec, launch
from plait.train.strategy import available_strategies

#: Strategies the demo compares, when installed.
DEMO_STRATEGIES = ("ssgd", "fp16", "powersgd:rank=4", "acpsgd:rank=4")


def run_demo(*, nodes: int = 4, out: Path = Path("runs/demo"), quick: bool = False) -> int:
    out.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(out / "checkpoints", ignore_errors=True)  # a demo starts from scratch
    known = set(available_strategies())
    strategies = [s for s in DEMO_STRATEGIES if s.split(":")[0] in known]
    print(f"== plait demo: {nodes} emulated nodes ==", flush=True)
    with Cluster.create(nodes=nodes, network=NetworkSpec(bandwidth="slow")) as cluster:
        what = "network namespaces" if cluster.emulated else "loopback processes (unshaped)"
        print(f"[1/3] cluster {cluster.cid}: {nodes} {what}, links at {cluster.network.describe()}")
        probe_out = out / "probe.json"
        res = launch(
            cluster, ["plait.comm.probe", str(probe_out)], module=True, timeout_s=600, quiet=True
        )
        if res.ok:
            from plait.comm.probe import format_probe

            print(format_probe(json.loads(probe_out.read_text()), cluster.network.rate_bps))

        epochs = 2 if quick else 8
        print(f"\n[2/3] training the MLP on digits with S-SGD, {epochs} epochs", flush=True)
        train_out = out / "train.json"
        res = launch(
            cluster,
            [
                "plait.train",
                "--workload",
                "mlp",
                "--epochs",
                str(epochs),
                "--strategy",
                "ssgd",
                "--checkpoint",
                str(out / "checkpoints"),
                "--out",
                str(train_out),
            ],
            module=True,
            timeout_s=1800,
        )
        if not res.ok:
            print(res.tail(), file=sys.stderr)
            return 1
        final = json.loads(train_out.read_text())["final"]
        print(f"test accuracy after {epochs} epochs: {100 * final['test_accuracy']:.1f}%")

        print(f"\n[3/3] benchmark: {', '.join(strategies)} on the 8.4 M-param MLP", flush=True)
        records = run_bench(
            workloads=["mlp"],
            strategies=strategies,
            bandwidths=["slow", "fast"],
            steps=2 if quick else 5,
            warmup=1,
            out=out / "bench",
            cluster=cluster,
            command="plait demo",
        )
    paths = write_reports(records, out / "bench")
    print("\n" + markdown_table(records))
    print(f"results: {paths['markdown']}  plot: {paths['png']}  training: {train_out}")
    return 0
