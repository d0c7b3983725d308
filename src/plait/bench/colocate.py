"""Run several distributed jobs on the same emulated nodes and measure what co-location buys.

Each job is its own launch (one torchrun per node, its own rendezvous port and process
group) inside the *same* node namespaces, so the jobs share each node's CPU and network
link exactly as jobs sharing a real node share its devices and NIC. Three ways to run a
set of jobs are compared:

- sequential: one job after another, each alone on the cluster;
- uncoordinated: all at once, left to the operating system;
- crossover: all at once, each device's compute passed between the jobs by its token.

Throughput is judged inside the window where all jobs are past their warm-up and none has
finished. Each job's rate there is divided by its rate alone and the ratios are summed: the
normalised aggregate throughput (weighted speedup). Running the jobs one after another
scores exactly 1 by construction, so the score is directly "x over sequential". Per-job
slowdown versus alone shows fairness: no job may starve.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import shlex
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any, TypeVar

from plait.bench.core import CpuSampler, Turn, run_rounds
from plait.bench.crossover_report import plot_interleaving
from plait.bench.records import Comparison, ModeResult
from plait.cluster import Cluster, LaunchResult, launch
from plait.train.strategy import make_strategy
from plait.workloads import get_workload

logger = logging.getLogger(__name__)


#: How long an interrupted co-located run waits for its launches to tear down.
_STOP_WAIT_S = 15.0


@contextlib.contextmanager
def _work_dir(*, keep_on_failure: bool = False) -> Iterator[tuple[Path, threading.Event]]:
    """The runs' scratch folder and a flag to set when a run failed.

    Removed on exit, and on Ctrl-C; kept, and named in the log, when the block raises or
    the flag is set (it holds the failed run's node logs).
    """
    path = Path(tempfile.mkdtemp(prefix="plait-crossover-"))
    failed = threading.Event()
    try:
        yield path, failed
    except KeyboardInterrupt:
        shutil.rmtree(path, ignore_errors=True)
        raise
    except BaseException:
        logger.warning("co-located runs' logs kept in %s", path)
        raise
    if failed.is_set() and keep_on_failure:
        logger.warning("co-located runs' logs kept in %s", path)
    else:
        shutil.rmtree(path, ignore_errors=True)


class Mode(StrEnum):
    ALONE = "alone"
    UNCOORDINATED = "uncoordinated"
    CROSSOVER = "crossover"


@dataclass(frozen=True, kw_only=True)
class Job:
    """One job: a built-in training run (``workload/strategy``) or a user command.

    Built-in jobs train on synthetic data of the workload's benchmark shapes, report
    per-step timestamps, and take ``--crossover`` themselves. A user command receives the
    group in ``PLAIT_CROSSOVER_GROUP`` (pass it to `plait.crossover.attach`) and is timed
    as a whole.
    """

    name: str
    workload: str | None = None
    strategy: str | None = None
    config: dict[str, Any] | None = None
    command: tuple[str, ...] = ()

    @classmethod
    def parse(cls, text: str, index: int) -> Job:
        """``resnet18/ssgd``, ``gpt/acpsgd:rank=4``, ``job.json`` (TrainConfig fields), or
        a command (``"my_script.py --lr 0.1"``)."""
        text = text.strip()
        if text.endswith(".json") and Path(text).is_file():
            cfg = json.loads(Path(text).read_text())
            if not isinstance(cfg, dict):
                raise ValueError(f"job file {text} must hold a JSON object of train settings")
            return cls(name=f"job{index}:{Path(text).stem}", config=cfg)
        if "/" in text and " " not in text and not text.endswith(".py"):
            workload, _, strategy = text.partition("/")
            get_workload(workload)
            make_strategy(strategy).close()
            return cls(name=f"job{index}:{text}", workload=workload, strategy=strategy)
        argv = tuple(shlex.split(text))
        if not argv:
            raise ValueError(f"empty job {index}")
        return cls(name=f"job{index}:{Path(argv[0]).name}", command=argv)

    def argv(
        self, *, steps: int, out: Path, group: str | None, tmp: Path, trace: Path | None = None
    ) -> tuple[list[str], bool]:
        """(torchrun argv, is-a-module) for one run."""
        if self.command:
            return list(self.command), False
        if self.config is not None:
            cfg = dict(self.config)
            cfg.update(out=str(out), crossover=group, progress=False)
            if trace is not None:
                cfg["trace"] = str(trace)
            path = tmp / f"{abs(hash(self.name))}-{group or 'none'}.json"
            path.write_text(json.dumps(cfg))
            return ["plait.train", "--config-json", str(path)], True
        assert self.workload is not None and self.strategy is not None
        wl = get_workload(self.workload)
        argv = [
            "plait.train",
            "--workload",
            self.workload,
            "--strategy",
            self.strategy,
            "--data",
            "synthetic",
            "--steps",
            str(steps),
            "--batch-size",
            str(wl.bench_batch),
            "--out",
            str(out),
            "--no-progress",
        ]
        if group:
            argv += ["--crossover", group]
        if trace is not None:
            argv += ["--trace", str(trace)]
        return argv, True


@dataclass(kw_only=True)
class JobRun:
    """One job's outcome in one run."""

    job: str
    mode: Mode
    ok: bool
    elapsed_s: float
    step_end_unix: list[float] = field(default_factory=list)
    samples_per_step: int = 0
    token: dict[str, float] | None = None
    log: str = ""


def _run_jobs(
    cluster: Cluster,
    jobs: list[Job],
    *,
    mode: Mode,
    steps: int | list[int],
    group: str,
    nproc_per_node: int,
    threads: int,
    timeout_s: float,
    work: Path,
    trace: Path | None = None,
) -> list[JobRun]:
    """Launch `jobs` at once (one thread per launch) and collect their metrics.

    With `trace`, every job records a timeline and they are merged into one file there,
    each job's ranks a separate group of tracks, so the interleaving shows.
    """
    results: dict[int, LaunchResult] = {}
    outs = [work / f"{mode}-{i}.json" for i in range(len(jobs))]
    runs = []
    gate = group if mode is Mode.CROSSOVER else None

    traces = [work / f"trace-{mode}-{i}.json" for i in range(len(jobs))] if trace else None
    per_job = [steps] * len(jobs) if isinstance(steps, int) else steps

    stop = threading.Event()
    # One event per launch, set when its thread is through (teardown included). Waiting on
    # these rather than on Thread.join: on Python 3.11 a join that Ctrl-C interrupts marks
    # the thread stopped while it still runs (CPython's bpo-45274 handling), and a later
    # join would then return before that launch's teardown ended.
    done = [threading.Event() for _ in jobs]

    def go(i: int, job: Job) -> None:
        try:
            argv, module = job.argv(
                steps=per_job[i],
                out=outs[i],
                group=gate,
                tmp=work,
                trace=traces[i] if traces else None,
            )
            env = {"PLAIT_CROSSOVER_GROUP": gate} if gate else {}
            results[i] = launch(
                cluster,
                argv,
                module=module,
                nproc_per_node=nproc_per_node,
                threads=threads,
                timeout_s=timeout_s,
                env=env,
                quiet=True,
                log_dir=work / f"logs-{mode}-{i}",
                stop=stop,
            )
        finally:
            done[i].set()

    # daemon threads: a launch that does not stop in time never keeps the process alive
    threads_ = [
        threading.Thread(target=go, args=(i, j), daemon=True, name=f"launch-{j.name}")
        for i, j in enumerate(jobs)
    ]
    try:
        for t in threads_:
            t.start()
        for ev in done:
            while not ev.wait(timeout=0.2):  # short waits: Ctrl-C reaches the main thread
                pass
    except BaseException:
        # Ctrl-C (or SIGTERM/SIGHUP): the launches' threads cannot see it; tell them,
        # and give them the time their teardown takes
        stop.set()
        end = time.monotonic() + _STOP_WAIT_S
        for ev in done:
            ev.wait(timeout=max(0.0, end - time.monotonic()))
        raise
    missing = [jobs[i].name for i in range(len(jobs)) if i not in results]
    if missing:
        raise RuntimeError(f"launch of {', '.join(missing)} failed before it ran")
    for i, job in enumerate(jobs):
        res = results[i]
        run = JobRun(job=job.name, mode=mode, ok=res.ok, elapsed_s=res.elapsed_s)
        if outs[i].exists():
            summary = json.loads(outs[i].read_text())
            run.step_end_unix = summary.get("step_end_unix", [])
            run.samples_per_step = summary["batch_size"] * summary["world_size"]
            run.token = summary.get("crossover")
        if not res.ok:
            run.log = res.tail(20)
        runs.append(run)
    if trace is not None and traces is not None:
        merge_traces([(j.name, t) for j, t in zip(jobs, traces, strict=True)], trace)
        plot_interleaving(trace, trace.with_suffix(".png"))
    return runs


def merge_traces(parts: list[tuple[str, Path]], out: Path) -> Path:
    """One Chrome trace of several jobs: job k's rank r becomes process 1000k + r."""
    events: list[dict[str, Any]] = []
    for k, (name, path) in enumerate(parts):
        if not path.exists():
            continue
        for ev in json.loads(path.read_text())["traceEvents"]:
            new = {**ev, "pid": 1000 * k + int(ev["pid"])}
            if ev.get("ph") == "M" and ev.get("name") == "process_name":
                new["args"] = {"name": f"{name} rank {ev['pid']}"}
            events.append(new)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
    return out


def common_window(runs: list[JobRun], *, warmup: int) -> tuple[float, float]:
    """(start, end) unix times of the window where every job is past warm-up and none
    has finished: it opens when the last job finishes its warm-up and closes when the
    first job finishes."""
    usable = [r.step_end_unix for r in runs]
    if any(len(t) <= warmup + 1 for t in usable):
        raise ValueError("every job needs more steps than its warm-up to measure a rate")
    start = max(t[warmup] for t in usable)
    end = min(t[-1] for t in usable)
    if end <= start:
        raise ValueError("the jobs did not overlap after warm-up: give them more steps")
    return start, end


def window_rates(runs: list[JobRun], *, warmup: int) -> tuple[list[float], float]:
    """Steps per second of each job inside the `common_window`, and the window's length;
    a job's rate counts its steps that end inside the window."""
    start, end = common_window(runs, warmup=warmup)
    rates = []
    for r in runs:
        inside = [x for x in r.step_end_unix if start < x <= end]
        rates.append(len(inside) / (end - start))
    return rates, end - start


def alone_rate(run: JobRun, *, warmup: int) -> float:
    t = run.step_end_unix
    if len(t) <= warmup + 1:
        raise ValueError(f"{run.job}: too few steps to measure a rate alone")
    return (len(t) - 1 - warmup) / (t[-1] - t[warmup])


def balanced_steps(steps: int, step_s: list[float]) -> list[int]:
    """Steps per co-located job so that all run about as long as the slowest one's `steps`.

    Jobs of very different step times would otherwise finish before the slowest is past
    its warm-up, leaving no common window to measure.
    """
    if not step_s or min(step_s) <= 0:
        raise ValueError(f"step times must be positive, got {step_s}")
    slowest = max(step_s)
    return [max(steps, math.ceil(steps * slowest / s)) for s in step_s]


def compare(
    cluster: Cluster,
    specs: list[str],
    *,
    steps: int = 20,
    warmup: int = 3,
    repeats: int = 1,
    group: str | None = None,
    nproc_per_node: int = 1,
    threads: int = 1,
    timeout_s: float = 3600.0,
    modes: tuple[Mode, ...] = (Mode.UNCOORDINATED, Mode.CROSSOVER),
    trace: Path | None = None,
    progress: bool = True,
) -> Comparison:
    """Measure each job alone (gated, to time its compute), then co-located in each mode.

    With `repeats` > 1 the whole sequence (every job alone, then every mode) runs that many
    times, interleaved, and each figure is the median over the repeats, so a slow drift of
    a shared machine hits every mode alike.
    """
    with _work_dir() as (work, _):
        return _compare(
            cluster,
            specs,
            work=work,
            steps=steps,
            warmup=warmup,
            repeats=repeats,
            group=group,
            nproc_per_node=nproc_per_node,
            threads=threads,
            timeout_s=timeout_s,
            modes=modes,
            trace=trace,
            progress=progress,
        )


def _compare(
    cluster: Cluster,
    specs: list[str],
    *,
    work: Path,
    steps: int = 20,
    warmup: int = 3,
    repeats: int = 1,
    group: str | None = None,
    nproc_per_node: int = 1,
    threads: int = 1,
    timeout_s: float = 3600.0,
    modes: tuple[Mode, ...] = (Mode.UNCOORDINATED, Mode.CROSSOVER),
    trace: Path | None = None,
    progress: bool = True,
) -> Comparison:
    """Measure each job alone (gated, to time its compute), then co-located in each mode.

    With `repeats` > 1 the whole sequence (every job alone, then every mode) runs that many
    times, interleaved, and each figure is the median over the repeats, so a slow drift of
    a shared machine hits every mode alike.
    """
    jobs = [Job.parse(s, i) for i, s in enumerate(specs)]
    if len(jobs) < 2:
        raise ValueError("co-location needs at least two jobs")
    if any(j.command for j in jobs):
        raise ValueError("comparisons need built-in jobs (workload/strategy or job files)")
    if repeats < 1 or steps <= warmup + 1:
        raise ValueError(f"need repeats >= 1 and steps > warmup + 1, got {repeats}, {steps}")
    group = group or f"xo-{cluster.cid}"

    def run(
        batch: list[Job], mode: Mode, n: int | list[int], gate: str, tr: Path | None = None
    ) -> tuple[list[JobRun], float | None]:
        """The runs, and the host's CPU busy fraction inside their common window."""
        with CpuSampler() as cpu:
            runs = _run_jobs(
                cluster,
                batch,
                mode=mode,
                steps=n,
                group=gate,
                trace=tr,
                work=work,
                nproc_per_node=nproc_per_node,
                threads=threads,
                timeout_s=timeout_s,
            )
        for r in runs:
            _check(r)
        return runs, cpu.busy(*common_window(runs, warmup=warmup))

    # the contestants of the interleaved rounds (`plait.bench.core`): every job alone,
    # then every mode; a round is one repeat
    contestants: list[tuple[Mode, int]] = [(Mode.ALONE, i) for i in range(len(jobs))]
    contestants += [(mode, -1) for mode in modes]
    co_steps: list[int] = []
    first_rates: list[float] = []
    done = 0

    def measure(turn: Turn[tuple[Mode, int]]) -> _Alone | _CoLocated:
        nonlocal co_steps, done
        mode, i = turn.contestant
        done += 1
        if mode is Mode.ALONE:
            if progress:
                logger.info("[%d/%d] %s alone", done, total, jobs[i].name)
            # alone but gated: the token is never contended, its hold time is the compute
            (solo,), busy = run([jobs[i]], Mode.CROSSOVER, steps, f"{group}-solo{i}")
            compute = None
            if solo.token:
                compute = solo.token["hold_s"] / max(1, solo.token["acquisitions"])
            rate = alone_rate(solo, warmup=warmup)
            if turn.round == 0:
                first_rates.append(rate)
            return _Alone(rate=rate, busy=busy, compute_s=compute)
        if not co_steps:  # a fast job runs more steps, so all overlap past warm-up
            co_steps = balanced_steps(steps, [1 / r for r in first_rates])
        if progress:
            logger.info("[%d/%d] %d jobs %s", done, total, len(jobs), mode)
        mode_trace = None
        if trace is not None and turn.round == 0:
            mode_trace = trace.with_name(f"{trace.stem}-{mode}.json")
        runs, busy = run(jobs, mode, co_steps, group, mode_trace)
        rates, window = window_rates(runs, warmup=warmup)
        return _CoLocated(rates=rates, window_s=window, tokens=[r.token for r in runs], busy=busy)

    total = repeats * len(contestants)
    kept = run_rounds(contestants, measure, rounds=repeats)
    alone = [[_as(_Alone, x) for x in kept[Mode.ALONE, i]] for i in range(len(jobs))]
    alone_rates = [[x.rate for x in a] for a in alone]
    alone_busy = [[x.busy for x in a if x.busy is not None] for a in alone]
    computes = [[x.compute_s for x in a if x.compute_s is not None] for a in alone]
    co = {mode: [_as(_CoLocated, x) for x in kept[mode, -1]] for mode in modes}
    rates = [statistics.median(r) for r in alone_rates]
    comp = Comparison(
        jobs=[j.name for j in jobs],
        bandwidth=cluster.network.bandwidth or "unshaped",
        rate=cluster.network.rate or "",
        steps=steps,
        warmup=warmup,
        repeats=repeats,
        alone_steps_per_s=rates,
        alone_step_s=[1 / r for r in rates],
        compute_s=[statistics.median(c) if c else 0.0 for c in computes],
        co_located_steps=co_steps,
        alone_cpu_busy=[statistics.median(b) if b else None for b in alone_busy],
    )
    for mode, reps in co.items():
        # per repeat, normalise by the same repeat's alone rates, then take medians
        norms = [
            [c / alone_rates[i][k] for i, c in enumerate(rep.rates)] for k, rep in enumerate(reps)
        ]
        busy_runs = [r.busy for r in reps if r.busy is not None]
        speedups = [sum(n) for n in norms]
        norm = [statistics.median(n[i] for n in norms) for i in range(len(jobs))]
        comp.modes[mode.value] = ModeResult(
            steps_per_s=[statistics.median(r.rates[i] for r in reps) for i in range(len(jobs))],
            normalised=norm,
            speedup_vs_sequential=statistics.median(speedups),
            speedup_runs=speedups,
            slowdown_vs_alone=[1 / n for n in norm],
            window_s=statistics.median(r.window_s for r in reps),
            token=reps[-1].tokens,
            fairness=jain_index(norm),
            cpu_busy=statistics.median(busy_runs) if busy_runs else None,
        )
    return comp


@dataclass(frozen=True)
class _Alone:
    """One job's turn alone: its rate past warm-up, the host's CPU busy share, and its
    compute per step (token hold time; None where the job reported no token)."""

    rate: float
    busy: float | None
    compute_s: float | None


@dataclass(frozen=True)
class _CoLocated:
    """One mode's turn: each job's rate in the common window, the window, the tokens."""

    rates: list[float]
    window_s: float
    tokens: list[dict[str, float] | None]
    busy: float | None


_T = TypeVar("_T")


def _as(kind: type[_T], sample: object) -> _T:
    assert isinstance(sample, kind), sample  # alone turns give _Alone, modes _CoLocated
    return sample


def _check(run: JobRun) -> None:
    if not run.ok or not run.step_end_unix:
        raise RuntimeError(f"{run.job} ({run.mode}) failed:\n{run.log}")


def jain_index(xs: list[float]) -> float:
    """Jain's fairness index of the jobs' normalised rates: 1 is perfectly even, 1/n is one
    job taking everything."""
    return sum(xs) ** 2 / (len(xs) * sum(x * x for x in xs))


def run_colocated(
    cluster: Cluster,
    specs: list[str],
    *,
    mode: Mode = Mode.CROSSOVER,
    steps: int = 20,
    group: str | None = None,
    nproc_per_node: int = 1,
    threads: int = 1,
    timeout_s: float = 3600.0,
    trace: Path | None = None,
) -> list[JobRun]:
    """Launch the jobs together on `cluster` and return each job's run."""
    jobs = [Job.parse(s, i) for i, s in enumerate(specs)]
    with _work_dir(keep_on_failure=True) as (work, failed):
        runs = _run_jobs(
            cluster,
            jobs,
            mode=mode,
            steps=steps,
            group=group or f"xo-{cluster.cid}",
            nproc_per_node=nproc_per_node,
            threads=threads,
            timeout_s=timeout_s,
            work=work,
            trace=trace,
        )
        if not all(r.ok for r in runs):
            failed.set()
    return runs
