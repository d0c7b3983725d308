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
import resource
import statistics
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from plait import distributed as pdist
from plait.comm import AlphaBeta
from plait.comm import stats as comm_stats
from plait.comm.probe import probe_allreduce
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
    iter_s: list[float] = field(default_factory=list)
    compute_s: list[float] = field(default_factory=list)
    payload: list[int] = field(default_factory=list)
    wire: list[float] = field(default_factory=list)
    comm_lb: list[float] = field(default_factory=list)
    nic: list[int] = field(default_factory=list)
    cpu_s: list[float] = field(default_factory=list)
    compute_cpu_s: list[float] = field(default_factory=list)


def _process_cpu_s() -> float:
    """CPU seconds (user + system) used so far by every thread of this process."""
    use = resource.getrusage(resource.RUSAGE_SELF)
    return use.ru_utime + use.ru_stime


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


def _round_batch(
    x_all: torch.Tensor, y_all: torch.Tensor, rnd: int, size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    start = (rnd % 4) * size
    return x_all[start : start + size].to(device), y_all[start : start + size].to(device)


def run_benchmark(spec: BenchSpec) -> list[dict[str, Any]]:
    """Run `spec` on the current process group; every rank returns the records."""
    wl = get_workload(spec.workload)
    world, rank = pdist.world_size(), pdist.rank()
    batch = spec.batch_size or wl.bench_batch
    # 4 rounds of the global batch: strategies that shard more than the data (n-D plans)
    # give each data-parallel replica world x batch / replicas samples
    pool = 4 * batch * world
    data = wl.bench_data(max(pool, 8))
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
    n_params = sum(p.numel() for p in wl.model(data.info, bench=True).parameters())
    for s in spec.strategies:
        seed_everything(spec.seed)
        strategy = make_strategy(s)
        strategy.bind_data((x_all[:batch].to(device), y_all[:batch].to(device)),
                           global_batch=batch * world)  # fmt: skip
        model = strategy.wrap(wl.model(data.info, bench=True).to(device))
        opt = strategy.build_optimizer(
            model, lambda params: torch.optim.SGD(params, lr=spec.lr, momentum=0.9)
        )
        strategy.attach_optimizer(opt)
        local = batch * world // strategy.data_parallel_size()
        runners.append(_Runner(spec=s, strategy=strategy, model=model, optimizer=opt,
                               local_batch=local))  # fmt: skip
    rounds = spec.warmup + spec.steps
    bar = None
    if rank == 0:
        from tqdm import tqdm

        bar = tqdm(total=rounds * len(runners) * 2, desc=f"bench {spec.workload} {spec.bandwidth}",
                   unit="step", file=sys.stdout, mininterval=1.0)  # fmt: skip
    for rnd in range(rounds):
        keep = rnd >= spec.warmup
        for r in runners:
            x, y = _round_batch(x_all, y_all, rnd, r.local_batch, device)
            pdist.barrier()
            tx0 = _nic_tx_bytes()
            with comm_stats.window() as recs:
                c0 = _process_cpu_s()
                t0 = time.perf_counter()
                _step(r, x, y, wl.loss)
                dt = time.perf_counter() - t0
                dc = _process_cpu_s() - c0
            tx1 = _nic_tx_bytes()
            if keep:
                r.iter_s.append(dt)
                r.cpu_s.append(dc)
                r.payload.append(sum(c.nbytes for c in recs))
                r.wire.append(sum(c.wire_bytes for c in recs))
                if model_ab is not None:
                    r.comm_lb.append(model_ab.total(recs))
                if tx0 is not None and tx1 is not None:
                    r.nic.append(tx1 - tx0)
            if bar is not None:
                bar.update(1)
        for r in runners:
            x, y = _round_batch(x_all, y_all, rnd, r.local_batch, device)
            pdist.barrier()
            c0 = _process_cpu_s()
            t0 = time.perf_counter()
            with r.strategy.compute_only(r.model), _zero_lr(r.optimizer):
                _step(r, x, y, wl.loss, phase="compute-only")
            dt = time.perf_counter() - t0
            dc = _process_cpu_s() - c0
            if keep:
                r.compute_s.append(dt)
                r.compute_cpu_s.append(dc)
            if bar is not None:
                bar.update(1)
    if bar is not None:
        bar.close()
    if spec.trace:
        tracer.save(spec.trace)
    records = [
        _summarise(r, spec=spec, world=world, batch=batch, n_params=n_params) for r in runners
    ]
    for r in runners:
        r.strategy.close()
    if probe is not None:
        for rec in records:
            rec["probe"] = probe.to_dict()
    return records


def _slowest(values: list[float]) -> list[float]:
    """Per step, the maximum over ranks."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return values
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def _mean_over_ranks(values: list[float]) -> list[float]:
    if not dist.is_initialized() or dist.get_world_size() == 1 or not values:
        return values
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t)
    return (t / dist.get_world_size()).tolist()


def _summarise(
    r: _Runner, *, spec: BenchSpec, world: int, batch: int, n_params: int
) -> dict[str, Any]:
    it = _slowest(r.iter_s)
    comp = _slowest(r.compute_s)
    nic = _mean_over_ranks([float(v) for v in r.nic]) if r.nic else []
    cpu = _mean_over_ranks(r.cpu_s)
    comp_cpu = _mean_over_ranks(r.compute_cpu_s)
    has_nic = torch.tensor([1 if r.nic else 0])
    if dist.is_initialized() and world > 1:
        dist.all_reduce(has_nic, op=dist.ReduceOp.MIN)
    iter_med = statistics.median(it)
    comp_med = statistics.median(comp)
    lb = statistics.median(r.comm_lb) if r.comm_lb else 0.0
    nproc = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    rec: dict[str, Any] = {
        "workload": spec.workload,
        "strategy": spec_name(r.spec),
        "strategy_spec": r.spec,
        "strategy_desc": r.strategy.describe(),
        "nodes": int(os.environ.get("PLAIT_NODES", str(world))),
        "nproc_per_node": nproc,
        "world_size": world,
        "bandwidth": spec.bandwidth,
        "rate": spec.rate,
        "batch_size": batch,
        "params": n_params,
        "steps": spec.steps,
        "warmup": spec.warmup,
        "iter_time_s": iter_med,
        "iter_time_min_s": min(it),
        "iter_time_max_s": max(it),
        "iter_time_mean_s": statistics.mean(it),
        "iter_times_s": it,
        "compute_time_s": comp_med,
        "compute_times_s": comp,
        "comm_lower_bound_s": lb,
        "overlap_efficiency": max(comp_med, lb) / iter_med,
        "cpu_time_s": statistics.median(cpu),
        "compute_cpu_time_s": statistics.median(comp_cpu),
        "payload_bytes_per_step": statistics.median(r.payload) if r.payload else 0,
        "bytes_per_step": statistics.median(r.wire) if r.wire else 0.0,
        "nic_bytes_per_step": (statistics.median(nic) / nproc) if nic and int(has_nic) else None,
        "samples_per_s": world * batch / iter_med,
        "threads": torch.get_num_threads(),
    }
    return rec


def spec_name(spec: str) -> str:
    return spec.partition(":")[0]


def main(argv: list[str] | None = None) -> int:
    """Worker entry point: ``python -m plait.bench.harness SPEC.json OUT.json``."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m plait.bench.harness SPEC.json OUT.json", file=sys.stderr)
        return 2
    spec = BenchSpec(**json.loads(Path(args[0]).read_text()))
    pdist.init_distributed()
    try:
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))
        records = run_benchmark(spec)
        if pdist.is_main():
            Path(args[1]).write_text(json.dumps(records, indent=2))
    finally:
        pdist.shutdown()
    return 0


def spec_to_json(spec: BenchSpec) -> str:
    return json.dumps(asdict(spec))


if __name__ == "__main__":
    sys.exit(main())
