"""The benchmark harness: strategies side by side in one distributed job, interleaved.

Every strategy gets its own copy of the same model (same seed) and optimizer. Rounds run
each strategy's synchronous step, then each strategy's compute-only step (`no_sync`, the
learning rate set to zero so it leaves the weights alone), so slow drift of a shared machine
hits all strategies alike. The first `warmup` rounds are discarded. A step is timed from a
barrier to the end of the optimizer step on every rank, and its time is the slowest rank's.

Per strategy the harness reports the median, min and max iteration time, the median
compute-only time, the bytes a worker sends per step (payload, modelled ring traffic and,
on an emulated cluster, bytes counted on the node's link), and the overlap efficiency
``max(compute, comm lower bound) / iteration``, the lower bound being the step's
collectives under the alpha-beta model probed at the start of the job.

It also reports the CPU time a worker process spends per step (all its threads: autograd,
compression, the collective library's threads and the kernel's network path charged to
them) in both phases. Where workers share too few cores, the compute-only step already
keeps every core busy, so each CPU-second a strategy adds to a step costs wall-clock time
no matter how well it overlaps: the difference bounds what overlap can hide.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import sys
from collections.abc import Iterator
from dataclasses import MISSING, asdict, dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

import torch
from torch import nn

from plait import comm
from plait import distributed as pdist
from plait.bench.core import Stats, Stopwatch, Turn, run_rounds
from plait.bench.records import BenchRecord
from plait.comm import AlphaBeta
from plait.comm import stats as comm_stats
from plait.comm.probe import probe_allreduce
from plait.flags import option, parse
from plait.records import write_json
from plait.trace import COMPUTE, OPTIM, span, tracer
from plait.train.loop import seed_everything
from plait.train.strategy import Strategy, make_strategy
from plait.workloads import get_workload


@dataclass(kw_only=True)
class BenchSpec:
    """One benchmark job: a workload, the strategies to compare, and how long to measure."""

    workload: str
    strategies: list[str]
    steps: int = 10
    warmup: int = 2
    batch_size: int | None = None
    bandwidth: str = ""
    rate: str = ""
    lr: float = 1e-3
    seed: int = 0
    trace: str | None = None
    probe: bool = True
    real: bool = False  # the workload's training model and data instead of the benchmark's

    def __post_init__(self) -> None:
        get_workload(self.workload)
        if not self.strategies:
            raise ValueError("no strategies to benchmark")
        if self.steps < 1 or self.warmup < 0:
            raise ValueError(f"steps must be >= 1 and warmup >= 0, got {self.steps}, {self.warmup}")


@dataclass
class _Runner:
    spec: str
    strategy: Strategy
    model: nn.Module
    optimizer: torch.optim.Optimizer
    local_batch: int


class StepKind(StrEnum):
    """The two turns a strategy gets per round."""

    STEP = "step"  # the synchronous step: compute and communication
    COMPUTE = "compute-only"  # `no_sync`, learning rate zero: compute alone


@dataclass(frozen=True, kw_only=True)
class StepSample:
    """What one rank measured in one turn."""

    wall_s: float
    cpu_s: float
    payload_bytes: int = 0  # collective payloads this rank sent
    wire_bytes: float = 0.0  # their modelled ring traffic
    comm_lb_s: float | None = None  # the collectives under the probed alpha-beta model
    nic_bytes: int | None = None  # bytes counted on the node's link (emulated cluster)


def _nic_tx_bytes() -> int | None:
    """Bytes sent so far on this node's link (emulated cluster only)."""
    ifname = os.environ.get("GLOO_SOCKET_IFNAME")
    if not ifname or os.environ.get("PLAIT_EMULATED") != "1":
        return None
    try:
        return int(Path(f"/sys/class/net/{ifname}/statistics/tx_bytes").read_text())
    except (OSError, ValueError):
        return None


@contextlib.contextmanager
def _zero_lr(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    saved = [g["lr"] for g in optimizer.param_groups]
    for g in optimizer.param_groups:
        g["lr"] = 0.0
    try:
        yield
    finally:
        for g, lr in zip(optimizer.param_groups, saved, strict=True):
            g["lr"] = lr


def _step(r: _Runner, x: torch.Tensor, y: torch.Tensor, loss_fn: Any, phase: str = "step") -> None:
    r.optimizer.zero_grad(set_to_none=True)
    driven = None
    if type(r.strategy).forward_backward is not Strategy.forward_backward:
        # a strategy that drives its own steps (pipelines): one span, not nested ones
        with span("forward_backward", COMPUTE, strategy=r.spec, phase=phase):
            driven = r.strategy.forward_backward(r.model, [(x, y)], loss_fn)
    if driven is None:
        with span("forward", COMPUTE, strategy=r.spec, phase=phase):
            loss = loss_fn(r.model(x), y)
        with span("backward", COMPUTE, strategy=r.spec, phase=phase):
            loss.backward()
    with span("optimizer", OPTIM, strategy=r.spec, phase=phase):
        r.strategy.before_optimizer_step(r.model)
        r.optimizer.step()


def _synchronize(device: torch.device) -> None:
    """Wait for the device's queued work: a CUDA step ends when its kernels do."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _round_batch(
    x_all: torch.Tensor, y_all: torch.Tensor, rnd: int, size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    start = (rnd % 4) * size
    return x_all[start : start + size].to(device), y_all[start : start + size].to(device)


def run_benchmark(spec: BenchSpec) -> list[BenchRecord]:
    """Run `spec` on the current process group; every rank returns the records.

    The contestants of the interleaved rounds (`plait.bench.core`) are every strategy's
    synchronous step, then every strategy's compute-only step, so a round runs
    A B ... then A B ... compute-only.
    """
    wl = get_workload(spec.workload)
    world = pdist.world_size()
    batch = spec.batch_size or wl.bench_batch
    # 4 rounds of the global batch: strategies that shard more than the data (n-D plans)
    # give each data-parallel replica world x batch / replicas samples
    pool = 4 * batch * world
    data = wl.real() if spec.real else wl.bench_data(max(pool, 8))
    xs, ys = (t for t in zip(*[data.train[i] for i in range(pool)], strict=True))
    x_all, y_all = torch.stack(list(xs)), torch.stack(list(ys))
    device = pdist.device()
    model_ab: AlphaBeta | None = None
    probe = None
    if spec.probe and world > 1:
        probe = probe_allreduce()
        model_ab = probe.model
    if spec.trace:
        tracer.enable()
    runners: list[_Runner] = []
    bench = not spec.real
    n_params = sum(p.numel() for p in wl.model(data.info, bench=bench).parameters())
    for s in spec.strategies:
        seed_everything(spec.seed)
        strategy = make_strategy(s)
        strategy.bind_data(
            (x_all[:batch].to(device), y_all[:batch].to(device)), global_batch=batch * world
        )
        model = strategy.wrap(wl.model(data.info, bench=bench).to(device))
        opt = strategy.build_optimizer(
            model, lambda params: torch.optim.SGD(params, lr=spec.lr, momentum=0.9)
        )
        strategy.attach_optimizer(opt)
        local = batch * world // strategy.data_parallel_size()
        runners.append(
            _Runner(spec=s, strategy=strategy, model=model, optimizer=opt, local_batch=local)
        )

    def measure(turn: Turn[tuple[int, StepKind]]) -> StepSample:
        index, phase = turn.contestant
        r = runners[index]
        x, y = _round_batch(x_all, y_all, turn.round, r.local_batch, device)
        _synchronize(device)
        comm.barrier()
        if phase is StepKind.COMPUTE:
            with Stopwatch() as sw, r.strategy.compute_only(r.model), _zero_lr(r.optimizer):
                _step(r, x, y, wl.loss, phase=phase.value)
                _synchronize(device)
            return StepSample(wall_s=sw.wall_s, cpu_s=sw.cpu_s)
        tx0 = _nic_tx_bytes()
        with comm_stats.window() as recs, Stopwatch() as sw:
            _step(r, x, y, wl.loss)
            _synchronize(device)
        tx1 = _nic_tx_bytes()
        return StepSample(
            wall_s=sw.wall_s,
            cpu_s=sw.cpu_s,
            payload_bytes=sum(c.nbytes for c in recs),
            wire_bytes=sum(c.wire_bytes for c in recs),
            comm_lb_s=None if model_ab is None else model_ab.total(recs),
            nic_bytes=None if tx0 is None or tx1 is None else tx1 - tx0,
        )

    contestants = [(i, phase) for phase in StepKind for i in range(len(runners))]
    bar = None
    if pdist.rank() == 0:
        from tqdm import tqdm

        bar = tqdm(
            total=(spec.warmup + spec.steps) * len(contestants),
            desc=f"bench {spec.workload} {spec.bandwidth}",
            unit="step",
            file=sys.stdout,
            mininterval=1.0,
        )
    kept = run_rounds(
        contestants,
        measure,
        rounds=spec.steps,
        warmup=spec.warmup,
        after_turn=None if bar is None else lambda turn, sample: bar.update(1),
    )
    if bar is not None:
        bar.close()
    if spec.trace:
        tracer.save(spec.trace)
    probed = None if probe is None else probe.to_dict()
    records = [
        _summarise(
            r,
            kept[i, StepKind.STEP],
            kept[i, StepKind.COMPUTE],
            spec=spec,
            world=world,
            batch=batch,
            n_params=n_params,
            probe=probed,
        )
        for i, r in enumerate(runners)
    ]
    for r in runners:
        r.strategy.close()
    return records


def _slowest(values: list[float]) -> list[float]:
    """Per step, the maximum over ranks."""
    return comm.reduce_floats(values, op="max", name="bench slowest")


def _mean_over_ranks(values: list[float]) -> list[float]:
    return comm.reduce_floats(values, op="mean", name="bench mean")


def _summarise(
    r: _Runner,
    steps: list[StepSample],
    compute: list[StepSample],
    *,
    spec: BenchSpec,
    world: int,
    batch: int,
    n_params: int,
    probe: dict[str, Any] | None,
) -> BenchRecord:
    """Reduce this rank's samples over ranks (collective) and summarise them."""
    nic_own = [s.nic_bytes for s in steps]
    here = bool(nic_own) and all(v is not None for v in nic_own)
    # the NIC's counters only where every rank read them (a mean over some would hang)
    measured_nic = comm.reduce_floats([float(here)], op="min", name="bench nic")[0] > 0
    nic = _mean_over_ranks([float(v) for v in nic_own if v is not None]) if measured_nic else []
    return bench_record(
        workload=spec.workload,
        strategy_spec=r.spec,
        strategy_desc=r.strategy.describe(),
        world=world,
        bandwidth=spec.bandwidth,
        rate=spec.rate,
        batch=batch,
        params=n_params,
        warmup=spec.warmup,
        iter_s=_slowest([s.wall_s for s in steps]),
        compute_s=_slowest([s.wall_s for s in compute]),
        cpu_s=_mean_over_ranks([s.cpu_s for s in steps]),
        compute_cpu_s=_mean_over_ranks([s.cpu_s for s in compute]),
        payload=[s.payload_bytes for s in steps],
        wire=[s.wire_bytes for s in steps],
        comm_lb=[s.comm_lb_s for s in steps if s.comm_lb_s is not None],
        nic=nic,
        probe=probe,
    )


def bench_record(
    *,
    workload: str,
    strategy_spec: str,
    strategy_desc: str,
    world: int,
    bandwidth: str,
    rate: str,
    batch: int,
    params: int,
    warmup: int,
    iter_s: list[float],
    compute_s: list[float],
    cpu_s: list[float],
    compute_cpu_s: list[float],
    payload: list[int],
    wire: list[float],
    comm_lb: list[float],
    nic: list[float],
    probe: dict[str, Any] | None = None,
    threads: int | None = None,
) -> BenchRecord:
    """The record of one strategy from its per-round figures, already reduced over ranks
    (step times: the slowest rank's; CPU and link bytes: the mean over ranks).

    Pure: the statistics of the harness without a process group, so they are tested on
    synthetic timings.
    """
    it, comp = Stats.of(iter_s), Stats.of(compute_s)
    lb = statistics.median(comm_lb) if comm_lb else 0.0
    nproc = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return BenchRecord(
        workload=workload,
        strategy=spec_name(strategy_spec),
        strategy_spec=strategy_spec,
        strategy_desc=strategy_desc,
        nodes=int(os.environ.get("PLAIT_NODES", str(world))),
        nproc_per_node=nproc,
        world_size=world,
        bandwidth=bandwidth,
        rate=rate,
        batch_size=batch,
        params=params,
        steps=it.n,
        warmup=warmup,
        iter_time_s=it.median,
        iter_time_min_s=it.min,
        iter_time_max_s=it.max,
        iter_time_mean_s=it.mean,
        iter_times_s=list(iter_s),
        compute_time_s=comp.median,
        compute_times_s=list(compute_s),
        comm_lower_bound_s=lb,
        overlap_efficiency=max(comp.median, lb) / it.median,
        cpu_time_s=statistics.median(cpu_s),
        compute_cpu_time_s=statistics.median(compute_cpu_s),
        payload_bytes_per_step=statistics.median(payload) if payload else 0,
        bytes_per_step=statistics.median(wire) if wire else 0.0,
        nic_bytes_per_step=(statistics.median(nic) / nproc) if nic else None,
        samples_per_s=world * batch / it.median,
        threads=torch.get_num_threads() if threads is None else threads,
        probe=probe,
        link=os.environ.get("PLAIT_LINK") or None,
        device=str(pdist.device()),
    )


def spec_name(spec: str) -> str:
    """The strategy's name: ``acpsgd`` of ``acpsgd:rank=4``."""
    return spec.partition(":")[0]


@dataclass(frozen=True, kw_only=True)
class WorkerConfig:
    """The worker's command line (`plait.flags`), as `plait.bench.runner` launches it.

    Attributes:
        spec: the job's `BenchSpec` as JSON (`spec_to_json`).
        out: where the main rank writes the job's records.
    """

    spec: Path = option(MISSING, "the job's BenchSpec", positional=True, metavar="SPEC.json")
    out: Path = option(MISSING, "the records written", positional=True, metavar="OUT.json")


def main(argv: list[str] | None = None) -> int:
    """Worker entry point: ``python -m plait.bench.harness SPEC.json OUT.json``."""
    cfg = parse(WorkerConfig, argv, prog="python -m plait.bench.harness")
    spec = BenchSpec(**json.loads(cfg.spec.read_text()))
    pdist.init_distributed()
    try:
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))
        records = run_benchmark(spec)
        if pdist.is_main():
            write_json(records, cfg.out, indent=2)
    finally:
        pdist.shutdown()
    return 0


def spec_to_json(spec: BenchSpec) -> str:
    """The spec as the JSON file `main` reads."""
    return json.dumps(asdict(spec))


if __name__ == "__main__":
    sys.exit(main())
