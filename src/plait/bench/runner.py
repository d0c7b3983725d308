"""`plait bench`: build the emulated cluster once, run each workload at each network setting.

All strategies of one (workload, bandwidth) run in the same distributed job, interleaved
(see `plait.bench.harness`); the rates are changed between jobs with tc.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from plait._proc import keep_scratch, scratch_dir
from plait.bench.harness import BenchSpec
from plait.bench.records import BenchRecord
from plait.bench.report import write_reports
from plait.cluster import Cluster, NetworkSpec, launch
from plait.records import stamp

logger = logging.getLogger(__name__)


def run_bench(
    *,
    workloads: Sequence[str],
    strategies: Sequence[str],
    nodes: int = 4,
    nproc_per_node: int = 1,
    bandwidths: Sequence[str | None] = (None,),
    latency: str | None = None,
    loss: float | None = None,
    steps: int = 10,
    warmup: int = 2,
    batch_size: int | None = None,
    threads: int = 1,
    out: Path | None = None,
    trace: bool = False,
    timeout_s: float = 3 * 3600,
    command: str | None = None,
    cluster: Cluster | None = None,
) -> list[BenchRecord]:
    """Run the benchmark grid and write reports to `out`; return the records.

    A `cluster` that is already up is reused (and reshaped); otherwise one is built and torn
    down around the grid.
    """
    specs = [NetworkSpec(bandwidth=bw, latency=latency, loss=loss) for bw in bandwidths]
    for w in workloads:  # validate everything before building anything
        BenchSpec(workload=w, strategies=list(strategies), steps=steps, warmup=warmup)
    from plait.train.strategy import make_strategy
    from plait.workloads import get_workload

    for w in workloads:
        wl = get_workload(w)
        bench_model = wl.model(wl.bench_data(8).info, bench=True)
        for s in strategies:
            make_strategy(s).check(bench_model, world=nodes * nproc_per_node)
    records: list[BenchRecord] = []
    work = scratch_dir("plait-bench-")
    owned = cluster is None
    if cluster is None:
        cluster = Cluster.create(nodes=nodes, network=specs[0]).up()
    nodes = cluster.nodes
    try:
        for net in specs:
            cluster.shape(net)
            for w in workloads:
                # a factory's path holds '/' and ':'; file names take the factory's name
                tag = re.sub(r"[^A-Za-z0-9_.-]+", "-", w).strip("-")
                spec = BenchSpec(
                    workload=w,
                    strategies=list(strategies),
                    steps=steps,
                    warmup=warmup,
                    batch_size=batch_size,
                    bandwidth=net.bandwidth or "unshaped",
                    rate=net.rate or "",
                    trace=str(out / f"trace_{tag}_{net.bandwidth}.json") if trace and out else None,
                )
                spec_path = work / f"spec_{tag}_{net.bandwidth}.json"
                res_path = work / f"res_{tag}_{net.bandwidth}.json"
                spec_path.write_text(json.dumps(asdict(spec)))
                logger.info(
                    "bench: %s at %s on %dx%d: %s",
                    w,
                    net.describe(),
                    nodes,
                    nproc_per_node,
                    ", ".join(strategies),
                )
                result = launch(
                    cluster,
                    ["plait.bench.harness", str(spec_path), str(res_path)],
                    module=True,
                    nproc_per_node=nproc_per_node,
                    threads=threads,
                    timeout_s=timeout_s,
                    log_dir=work / "logs" / f"{w}_{net.bandwidth}",
                )
                if not result.ok or not res_path.exists():
                    logger.error("%s", result.tail())
                    why = ", timed out" if result.timed_out else ""
                    keep_scratch(work)
                    raise RuntimeError(
                        f"benchmark job {w} at {net.describe()} failed "
                        f"(exit codes {result.returncodes}{why})"
                    )
                recs = [
                    dataclasses.replace(BenchRecord.from_dict(r), latency=latency, loss=loss)
                    for r in json.loads(res_path.read_text())
                ]
                records += stamp(recs, command=command)
                if out is not None:  # keep partial results of long grids
                    write_reports(records, out)
    finally:
        if owned:
            cluster.down()
    return records


#: Record fields written as TensorBoard scalars, under ``bench/``.
SCALARS = (
    "samples_per_s",
    "iter_time_s",
    "compute_time_s",
    "comm_lower_bound_s",
    "overlap_efficiency",
    "bytes_per_step",
    "payload_bytes_per_step",
    "cpu_time_s",
)


def write_scalars(records: Sequence[BenchRecord | dict[str, Any]], log_dir: Path) -> None:
    """Write each record's scalars to TensorBoard, one run (subfolder) per workload, network
    setting and strategy, so TensorBoard overlays the strategies of a grid; the per-step
    times are the run's steps."""
    from plait.log import summary_writer

    for record in records:
        r = record.to_dict() if isinstance(record, BenchRecord) else record
        strategy = re.sub(r"[^\w.=-]+", "_", str(r.get("strategy_spec") or r["strategy"]))
        run = f"{r['workload']}/{r['bandwidth']}/{strategy}"
        writer = summary_writer(log_dir / run)
        try:
            for key in SCALARS:
                value = r.get(key)
                if isinstance(value, int | float):
                    writer.add_scalar(f"bench/{key}", value, 0)
            for i, t in enumerate(r.get("iter_times_s") or []):
                writer.add_scalar("bench/step_time_s", t, i)
        finally:
            writer.close()
