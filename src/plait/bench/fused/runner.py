"""The fused-array throughput benchmark: strategies side by side, interleaved.

For each model and array size N, every strategy is built and warmed up, then timed in
rounds that alternate between strategies, each round starting with the next one
(A B C D, B C D A, ...), so that the shared machine's background load falls on all of
them alike. A round trains every one of the N models `steps` steps; a step's time is the
round's time over `steps`, and throughput is N x batch / step time. Both the wall time
and the CPU time (all processes of a strategy) are recorded: on a machine shared with
other jobs the CPU time measures the work itself.

Every strategy runs at each of the configured intra-op thread counts (each pair is one
contestant of the interleaved rounds), so a report can compare strategies thread for
thread and also each at its own best count: on a 2-core CPU one model's small kernels
run slower on two threads than on one, while a fused array's large kernels use both.
Mixing thread counts has one cost: an in-process contestant's CPU time then includes the
spin-wait of OpenMP threads that a two-thread contestant left running in the process
(measured: one-thread rounds of the fused MLP at N = 16 used 1.8x their wall time in
CPU, 1.0x after a 50 ms pause, which in turn slowed every wall time). The goals are
judged on wall times; CPU times at one thread are clean only with `threads=(1,)`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from tqdm import tqdm

from plait._proc import usable_cpus
from plait.bench.core import Order, Stats, Turn, run_rounds
from plait.bench.fused.models import get_model
from plait.bench.fused.strategies import ArrayStrategy, Runner, StockAdam, make_runner
from plait.bench.records import FusedRecord
from plait.fused import native
from plait.fused.malloc import tune_malloc
from plait.fused.ops.conv import CONV_LAYOUTS, set_conv_layout


@dataclass(frozen=True, kw_only=True)
class BenchConfig:
    """What the benchmark measures.

    Attributes:
        models: benchmark model names (mlp, cnn, transformer).
        sizes: array sizes N.
        strategies: strategies to compare.
        steps: timed steps per round; rounds: rounds per strategy; warmup: untimed steps.
        threads: intra-op thread counts to measure every strategy at (in-process
            strategies and each concurrent worker alike). N concurrent processes get more
            than one thread only while N x threads fits the CPUs: beyond, their OpenMP
            threads spin against each other (measured at N = 16 with 2 threads each on
            2 cores: 130-630x slower than with one).
        batch_size: per-model batch (default: the model's).
        device: cpu or cuda.
        tune_malloc: raise glibc's malloc thresholds in every process of every strategy
            (see `plait.fused.malloc`).
        stock_adam: the implementation of `torch.optim.Adam` the serial, concurrent and
            vmap strategies use (see `StockAdam`).
        conv_layout: the layout of the fused arrays' 2-d convolutions
            (`plait.fused.set_conv_layout`: "nchw", the accurate default, or
            "channels_last", faster on a CPU).
        native_kernels: let fused arrays use plait's native CPU kernels
            (`plait.fused.native`); off, they run on torch's kernels only, which shows
            how much of the fused strategy's lead those kernels make.
    """

    models: Sequence[str] = ("mlp", "cnn", "transformer")
    sizes: Sequence[int] = (1, 2, 4, 8, 16, 32)
    strategies: Sequence[ArrayStrategy] = tuple(ArrayStrategy)
    steps: int = 5
    rounds: int = 9
    warmup: int = 3
    threads: Sequence[int] = (1,)
    batch_size: int | None = None
    device: str = "cpu"
    tune_malloc: bool = True
    stock_adam: StockAdam = StockAdam.FUSED
    native_kernels: bool = True
    conv_layout: str = "nchw"

    def __post_init__(self) -> None:
        for m in self.models:
            get_model(m)
        if min(self.sizes, default=0) < 1 or self.steps < 1 or self.rounds < 1:
            raise ValueError("sizes, steps and rounds must be >= 1")
        if self.conv_layout not in CONV_LAYOUTS:
            raise ValueError(f"conv layout {self.conv_layout!r}: expected one of {CONV_LAYOUTS}")
        if not self.threads or min(self.threads) < 1:
            raise ValueError(f"thread counts must be >= 1, got {tuple(self.threads)}")


def run_bench_fused(cfg: BenchConfig) -> list[FusedRecord]:
    """One record per (model, N, strategy, thread count), with the median step time and
    throughput; per model and N, each strategy's record at its fastest thread count
    (`fastest_threads`) comes first, and `speedup_vs_fastest_serial` compares with the
    serial strategy at its own fastest count."""
    before = torch.get_num_threads()
    native_before = native.set_enabled(cfg.native_kernels)
    layout_before = set_conv_layout(cfg.conv_layout)
    uses_native = cfg.native_kernels and cfg.device == "cpu" and native.unavailable_reason() is None
    tuned = cfg.tune_malloc and tune_malloc()
    records: list[FusedRecord] = []
    try:
        total = len(cfg.models) * len(cfg.sizes)
        bar = tqdm(total=total, desc="bench-fused", unit="config")
        for name in cfg.models:
            model = get_model(name)
            batch = cfg.batch_size or model.batch_size
            params = sum(p.numel() for p in model.build().parameters())
            for n in cfg.sizes:
                bar.set_postfix_str(f"{name} N={n}")
                samples = _measure(cfg, name, n, batch)
                config = fused_records(
                    samples,
                    workload=name,
                    model=model.description,
                    n=n,
                    batch=batch,
                    params=params,
                    cfg=cfg,
                    malloc_tuned=tuned,
                    native_kernels=uses_native,
                )
                # Each strategy's record at its fastest thread count comes first: that is
                # the whole-machine comparison, which readers of the JSON meet first.
                records += sorted(config, key=lambda r: not r.fastest_threads)
                bar.update(1)
        bar.close()
    finally:
        torch.set_num_threads(before)
        native.set_enabled(native_before)
        set_conv_layout(layout_before)
    return records


Contestant = tuple[ArrayStrategy, int]  # a strategy at an intra-op thread count


@dataclass(frozen=True)
class Sample:
    """One contestant's turn: wall and CPU seconds per step (all N models)."""

    wall_s: float
    cpu_s: float


def _fastest(medians: dict[Contestant, float]) -> dict[ArrayStrategy, Contestant]:
    """Each strategy's contestant with the shortest median step."""
    out: dict[ArrayStrategy, Contestant] = {}
    for c, step in medians.items():
        if c[0] not in out or step < medians[out[c[0]]]:
            out[c[0]] = c
    return out


def fused_records(
    samples: dict[Contestant, list[Sample]],
    *,
    workload: str,
    model: str,
    n: int,
    batch: int,
    params: int,
    cfg: BenchConfig,
    malloc_tuned: bool,
    native_kernels: bool,
) -> list[FusedRecord]:
    """The records of one (model, N) from every contestant's per-round samples, in the
    contestants' order; speed-ups compare medians with the serial strategy's at the same
    thread count and at its own fastest one."""
    medians = {c: Stats.of([s.wall_s for s in ss]).median for c, ss in samples.items()}
    fastest = _fastest(medians)
    best_serial = fastest.get(ArrayStrategy.SERIAL)
    out = []
    for (strategy, threads), ss in samples.items():
        wall = Stats.of([s.wall_s for s in ss])
        cpu = Stats.of([s.cpu_s for s in ss]).median
        serial = medians.get((ArrayStrategy.SERIAL, threads))
        out.append(
            FusedRecord(
                workload=workload,
                model=model,
                strategy=str(strategy),
                n=n,
                bandwidth=f"n{n}",
                batch_size=batch,
                params=params,
                threads=threads,
                device=cfg.device,
                fastest_threads=fastest[strategy] == (strategy, threads),
                iter_time_s=wall.median,
                iter_time_min_s=wall.min,
                iter_time_max_s=wall.max,
                throughput=n * batch / wall.median,
                cpu_time_s=cpu,
                cpu_throughput=n * batch / cpu,
                speedup_vs_serial=None if serial is None else serial / wall.median,
                speedup_vs_fastest_serial=(
                    None if best_serial is None else medians[best_serial] / wall.median
                ),
                steps=cfg.steps,
                rounds=cfg.rounds,
                malloc_tuned=malloc_tuned,
                stock_adam=cfg.stock_adam.value,
                native_kernels=native_kernels,
                conv_layout=cfg.conv_layout,
            )
        )
    return out


def _measure(cfg: BenchConfig, name: str, n: int, batch: int) -> dict[Contestant, list[Sample]]:
    model = get_model(name)
    runners: dict[Contestant, Runner] = {}
    try:
        for threads in cfg.threads:
            for s in cfg.strategies:
                if s is ArrayStrategy.CONCURRENT and threads > 1 and n * threads > usable_cpus():
                    continue  # oversubscribed (see BenchConfig.threads)
                torch.set_num_threads(threads)
                runners[s, threads] = r = make_runner(
                    s,
                    model,
                    n,
                    batch=batch,
                    threads=threads,
                    device=cfg.device,
                    tune=cfg.tune_malloc,
                    adam=cfg.stock_adam,
                )
                r.run(cfg.warmup)

        def measure(turn: Turn[Contestant]) -> Sample:
            torch.set_num_threads(turn.contestant[1])  # in-process ones; workers keep theirs
            wall, cpu = runners[turn.contestant].run(cfg.steps)
            return Sample(wall_s=wall / cfg.steps, cpu_s=cpu / cfg.steps)

        # warm-up ran above, right after each build: the rounds are all kept
        return run_rounds(list(runners), measure, rounds=cfg.rounds, order=Order.ROTATE)
    finally:
        for r in runners.values():
            r.close()
