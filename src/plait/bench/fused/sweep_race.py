"""Sweep race: how long a hyper-parameter sweep takes to finish, fused or not.

A sweep of `--trials` trials of a workload (digits-cnn by default) runs to the end in three
modes, side by side:

- ``fused``: one ``plait sweep`` process training arrays of up to `--max-models` models
  (the horizontally fused arrays of HFTA), with every thread;
- ``sequential``: one ``plait sweep --max-models 1`` process, trials one after another;
- ``concurrent``: `--concurrent` ``plait sweep --max-models 1`` processes started at once
  on the same Optuna study, each with ``--threads`` / `--concurrent` threads.

The figure is the wall-clock time from launching a mode's processes to the last one
exiting (interpreter start-up, data loading and the memory search included: the time a
user waits for the sweep). Every mode must train the same trials, so that their best
trial can be compared too: the search space (`grid_space`) gives trial *n* a learning
rate and weight decay that depend on *n* alone, the pruner is off, and a trial's initial
weights and data order depend only on ``--seed`` and *n* (`plait.fused.sweep.runner`).
Repeats rotate the modes (fused, sequential, concurrent; then sequential, concurrent,
fused; ...) so that no mode always runs first on a machine whose speed drifts.

    plait bench sweep-race --trials 32 --epochs 10 --repeats 3 \\
        --concurrent 2 --out benchmarks/hfta/sweep-race

Each run gets a fresh SQLite storage in a temporary folder, whose study the race creates
before the clock starts, for every mode alike, the way Optuna's distributed optimisation
is set up (``optuna create-study``, then the workers): the schema's creation is then not
timed, and concurrent processes never contend for it (``plait sweep`` retries when they
do, `plait.fused.sweep.runner`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import random
import resource
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

import optuna

from plait._proc import usable_cpus
from plait.bench import suites
from plait.bench.core import Order, Stats, schedule
from plait.cpu import read_jiffies
from plait.flags import option
from plait.records import provenance, pyplot, save_figure, write_report

#: Named in full: run as ``python -m``, ``__name__`` is ``__main__``, outside the ``plait``
#: loggers that `plait.log.configure` shows.
log = logging.getLogger("plait.bench.fused.sweep_race")

#: Seeds the search space: trial n's values come from ``Random(SPACE_SEED * 1_000_003 + n)``.
SPACE_SEED = 20_240_611
#: Log-uniform ranges of the space: those of ``plait sweep``'s SGD defaults.
LR_RANGE = (1e-3, 1.0)
WEIGHT_DECAY_RANGE = (1e-6, 1e-2)
#: Fixed options of every trial: SGD's momentum and the batch size (non-fusible).
MOMENTUM = 0.9
BATCH_SIZE = 32
#: This module's path for ``--space``, so the sweep processes import the same space (spelt
#: out: run as ``python -m``, the module's ``__name__`` is ``__main__``).
SPACE_TARGET = "plait.bench.fused.sweep_race:grid_space"
#: Characters of a failed process's output quoted in the error.
TAIL_CHARS = 3000


class Mode(StrEnum):
    """How the sweep is run."""

    FUSED = "fused"  # one process, arrays of up to --max-models models
    SEQUENTIAL = "sequential"  # one process, one model at a time
    CONCURRENT = "concurrent"  # N one-model processes on one study


class SweepRaceError(RuntimeError):
    """A sweep process failed or timed out; the message quotes the end of its output."""


def _log_uniform(rng: random.Random, low: float, high: float) -> float:
    return math.exp(rng.uniform(math.log(low), math.log(high)))


def grid_point(number: int) -> tuple[float, float]:
    """(learning rate, weight decay) of trial `number`: log-uniform, a function of the
    number alone.

    Each number seeds its own generator rather than indexing a list of `trials` values,
    so the point is defined for any number: concurrent sweeps that ask a trial at the same
    moment near the end may overshoot the study's total by a trial or two, and those
    trials must still be the same in every mode.

    Raises:
        ValueError: a negative number.
    """
    if number < 0:
        raise ValueError(f"trial number must be >= 0, got {number}")
    rng = random.Random(SPACE_SEED * 1_000_003 + number)
    return _log_uniform(rng, *LR_RANGE), _log_uniform(rng, *WEIGHT_DECAY_RANGE)


def grid_space(trial: optuna.Trial) -> dict[str, Any]:
    """The race's search space (``--space plait.bench.fused.sweep_race:grid_space``).

    The values come from `grid_point` (the trial's number), not from the sampler, so every
    mode trains the same configurations whatever order, process or array their trials
    land in, and concurrent processes (whose samplers share a seed, so would propose the
    same points) never train a configuration twice. They are still recorded through the
    trial, as single-valued ranges (Optuna accepts ``low == high`` and returns the value
    without asking the sampler), so the study and the reports show them as parameters.
    """
    lr, weight_decay = grid_point(trial.number)
    return {
        "lr": trial.suggest_float("lr", lr, lr, log=True),
        "weight_decay": trial.suggest_float("weight_decay", weight_decay, weight_decay, log=True),
        "momentum": MOMENTUM,
        "batch_size": BATCH_SIZE,
    }


@dataclass(frozen=True, kw_only=True)
class RaceConfig:
    """What the race runs.

    Attributes:
        trials: trials of each sweep (the study's total, over all its processes).
        epochs: training epochs per trial.
        repeats: runs of every mode; the table gives medians and min-max over them.
        concurrent: processes of the concurrent mode.
        threads: intra-op threads in all, shared out evenly among concurrent processes.
        max_models: the largest array of the fused mode.
        workload: the workload swept (a ``plait sweep --workload`` name).
        seed: ``plait sweep --seed``: initial weights and data order of every trial.
        timeout: seconds a mode's processes may run before they are killed.
        tolerance: how far apart the modes' best validation accuracies may be and still
            agree (the fused and one-model kernels sum in different orders).
    """

    trials: int = 32
    epochs: int = 10
    repeats: int = 3
    concurrent: int = 2
    threads: int = field(default_factory=usable_cpus)
    max_models: int = 32
    workload: str = "digits-cnn"
    seed: int = 0
    timeout: float = 3600.0
    tolerance: float = 0.01

    def __post_init__(self) -> None:
        for name in ("trials", "epochs", "repeats", "max_models", "threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} {getattr(self, name)}: must be >= 1")
        if self.concurrent < 2:
            raise ValueError(
                f"--concurrent {self.concurrent}: must be >= 2 (one process is the sequential mode)"
            )
        if self.concurrent > self.trials:
            raise ValueError(
                f"--concurrent {self.concurrent}: more processes than --trials {self.trials}"
            )
        if self.threads < self.concurrent:
            raise ValueError(
                f"--threads {self.threads}: fewer than --concurrent {self.concurrent} "
                "processes, each needs at least one"
            )
        if not self.timeout > 0:
            raise ValueError(f"--timeout {self.timeout}: must be > 0 seconds")
        if not self.tolerance >= 0:
            raise ValueError(f"--tolerance {self.tolerance}: must be >= 0")
        if not self.workload.strip():
            raise ValueError("--workload: empty name")

    def processes(self, mode: Mode) -> int:
        """Processes `mode` runs at once."""
        return self.concurrent if mode is Mode.CONCURRENT else 1

    def threads_per_process(self, mode: Mode) -> int:
        """Each process's share of the threads."""
        return self.threads // self.processes(mode)

    def array_limit(self, mode: Mode) -> int:
        """``--max-models`` of `mode`'s processes."""
        return self.max_models if mode is Mode.FUSED else 1


@dataclass(frozen=True, kw_only=True)
class TrialValue:
    """One trained trial as a sweep process reported it."""

    number: int
    state: str
    value: float | None
    process: int


@dataclass(frozen=True, kw_only=True)
class RunResult:
    """One run of one mode: its time to finish and the trials it trained.

    Attributes:
        mode, repeat: which run (repeats counted from 0).
        seconds: wall clock from launching the processes to the last one exiting.
        processes, threads: processes run at once and the threads of each.
        sweep_seconds: each process's own sweep time (its ``results.json`` ``elapsed_s``:
            asking, memory search and training, without start-up and reports).
        cpu_s: CPU seconds (user + system) of the run's processes together.
        others_busy: share of the machine's CPU time that other processes used during
            the run (None where ``/proc/stat`` is missing): the times are only comparable
            when this is near 0 in every run.
        trials: every trial trained, from every process.
    """

    mode: Mode
    repeat: int
    seconds: float
    processes: int
    threads: int
    sweep_seconds: list[float]
    cpu_s: float = 0.0
    others_busy: float | None = None
    trials: list[TrialValue]

    @property
    def best(self) -> TrialValue | None:
        """The completed trial of highest value; ties go to the lowest number, so modes
        that find the same values name the same trial."""
        done = [t for t in self.trials if t.state == "COMPLETE" and t.value is not None]
        return max(done, key=lambda t: (t.value, -t.number), default=None)

    def values(self) -> dict[int, float]:
        """Completed trials' values by trial number."""
        return {
            t.number: t.value for t in self.trials if t.state == "COMPLETE" and t.value is not None
        }

    def to_dict(self) -> dict[str, Any]:
        best = self.best
        return {
            **asdict(self),
            "mode": self.mode.value,
            "best_number": best.number if best else None,
            "best_value": best.value if best else None,
        }


@dataclass(frozen=True, kw_only=True)
class ModeSummary:
    """A mode over its repeats.

    Attributes:
        seconds: time to finish (median, min, max over repeats).
        sweep_seconds: the slowest process's own sweep time per repeat (median, min,
            max): the time to finish less interpreter start-up and report writing.
        others_busy: the largest share of the machine's CPU that other processes used
            during one of this mode's runs (None where unknown).
        vs_fused: median time over the fused mode's median time (None without fused runs).
        best_numbers, best_values: each repeat's best trial and its validation accuracy.
        trials: completed trials per repeat (more than the study's total when concurrent
            processes overshoot it).
        max_trial_diff: the largest difference of one trial's value between this mode's
            runs and the first fused run (None without a fused run): how much the modes'
            numerics differ, beyond the best trial.
    """

    mode: Mode
    seconds: Stats
    sweep_seconds: Stats
    others_busy: float | None
    vs_fused: float | None
    best_numbers: list[int | None]
    best_values: list[float | None]
    trials: list[int]
    max_trial_diff: float | None

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "mode": self.mode.value}


@dataclass(frozen=True, kw_only=True)
class RaceSummary:
    """The race's outcome: every mode's summary and whether their best trials agree.

    Attributes:
        modes: summaries in `Mode` order.
        agree: every run's best value is no further than `tolerance` from the others'
            (what a user of the sweep gets; the goal's "same best-trial value").
        same_trial: every run found the same best trial number. Not required to agree:
            the fused and one-model kernels sum in different orders, which moves a
            trial's accuracy by a few validation samples, and among 32 trials several tie
            within that (six at 0.9805 in one fused run of the digits CNN).
        best_spread: max - min of the best values over every run.
        tolerance: the agreement tolerance.
    """

    modes: list[ModeSummary]
    agree: bool
    same_trial: bool
    best_spread: float | None
    tolerance: float

    def mode(self, mode: Mode) -> ModeSummary:
        return next(s for s in self.modes if s.mode is mode)

    def to_dict(self) -> dict[str, Any]:
        return {
            "modes": [s.to_dict() for s in self.modes],
            "agree": self.agree,
            "same_trial": self.same_trial,
            "best_spread": self.best_spread,
            "tolerance": self.tolerance,
        }


def race_order(repeats: int) -> list[tuple[int, Mode]]:
    """(repeat, mode) in the order they run: the modes rotate by one each repeat."""
    return [
        (turn.round, turn.contestant)
        for turn in schedule(list(Mode), rounds=repeats, order=Order.ROTATE)
    ]


def summarize(runs: Sequence[RunResult], *, tolerance: float) -> RaceSummary:
    """Medians, ratios to fused and best-trial agreement of `runs` (any modes, repeats).

    Raises:
        ValueError: no runs.
    """
    if not runs:
        raise ValueError("no runs to summarise")
    fused = [r for r in runs if r.mode is Mode.FUSED]
    fused_median = Stats.of([r.seconds for r in fused]).median if fused else None
    reference = fused[0].values() if fused else None
    modes = []
    for mode in Mode:
        mine = [r for r in runs if r.mode is mode]
        if not mine:
            continue
        seconds = Stats.of([r.seconds for r in mine])
        diff: float | None = None
        if reference is not None:
            diffs = [
                abs(v - reference[n]) for r in mine for n, v in r.values().items() if n in reference
            ]
            diff = max(diffs, default=None)
        bests = [r.best for r in mine]
        busy = [r.others_busy for r in mine if r.others_busy is not None]
        modes.append(
            ModeSummary(
                mode=mode,
                seconds=seconds,
                sweep_seconds=Stats.of([max(r.sweep_seconds, default=0.0) for r in mine]),
                others_busy=max(busy, default=None),
                vs_fused=seconds.median / fused_median if fused_median else None,
                best_numbers=[b.number if b else None for b in bests],
                best_values=[b.value if b else None for b in bests],
                trials=[len(r.values()) for r in mine],
                max_trial_diff=diff,
            )
        )
    bests = [r.best for r in runs]
    values = [b.value for b in bests if b is not None and b.value is not None]
    spread = max(values) - min(values) if values else None
    found = all(b is not None for b in bests)
    agree = found and spread is not None and spread <= tolerance
    same_trial = found and len({b.number for b in bests if b is not None}) == 1
    return RaceSummary(
        modes=modes, agree=agree, same_trial=same_trial, best_spread=spread, tolerance=tolerance
    )


def _from_anywhere(workload: str) -> str:
    """`workload` as a sweep process started in its run's own folder finds it: a factory
    file (``path/file.py:factory``) by its absolute path."""
    target, sep, attr = workload.rpartition(":")
    if sep and target.endswith(".py"):
        return f"{Path(target).resolve()}:{attr}"
    return workload


def sweep_command(cfg: RaceConfig, mode: Mode, *, storage: str, study: str, out: Path) -> list[str]:
    """The command line of one of `mode`'s ``plait sweep`` processes.

    No ``--restart``: the storage is new for every run and its study exists already (see
    the module docstring); a concurrent process restarting the study would delete the
    trials of the one started a moment before it.
    """
    return [
        sys.executable,
        "-m",
        "plait",
        "sweep",
        "--workload",
        _from_anywhere(cfg.workload),
        "--space",
        SPACE_TARGET,
        "--optimizer",
        "sgd",
        "--trials",
        str(cfg.trials),
        "--epochs",
        str(cfg.epochs),
        "--pruner",
        "none",
        "--max-models",
        str(cfg.array_limit(mode)),
        "--seed",
        str(cfg.seed),
        "--threads",
        str(cfg.threads_per_process(mode)),
        "--storage",
        storage,
        "--study",
        study,
        "--out",
        str(out),
        "--no-progress",
    ]


def _environment() -> dict[str, str]:
    """The sweep processes' environment: this one, with the folder the race was started
    in on the import path, so a workload module there (``mywork:make``) imports from the
    run's own folder too."""
    path = [os.getcwd(), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path)}


def create_study(storage: str, study: str) -> None:
    """Create the (empty) study of a run, so its processes only ever load it."""
    optuna.create_study(study_name=study, storage=storage, direction="maximize")


class _CpuUsage:
    """CPU time of this process's children, and of the machine, from its creation on.

    The race's processes are children of this one (their CPU time counts once they are
    waited for); whatever else the machine's CPUs did meanwhile was other work, which
    slows the race down and must be reported with its times.
    """

    def __init__(self) -> None:
        self.children = _children_cpu_s()
        self.host = read_jiffies()

    def since(self) -> tuple[float, float | None]:
        """(CPU seconds of the children, others' share of the machine's CPU time)."""
        cpu_s = _children_cpu_s() - self.children
        host = read_jiffies()
        if host is None or self.host is None:
            return cpu_s, None
        busy_s = (host[0] - self.host[0]) / os.sysconf("SC_CLK_TCK")
        total_s = (sum(host) - sum(self.host)) / os.sysconf("SC_CLK_TCK")
        if total_s <= 0:
            return cpu_s, None
        return cpu_s, min(1.0, max(0.0, (busy_s - cpu_s) / total_s))


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _tail(path: Path) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no output)"
    return text[-TAIL_CHARS:].strip() or "(no output)"


def _stop(procs: Sequence[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
    for p in procs:
        p.wait()


def _wait_all(
    procs: Sequence[subprocess.Popen[bytes]],
    commands: Sequence[Sequence[str]],
    logs: Sequence[Path],
    *,
    deadline: float,
    what: str,
    timeout: float,
) -> None:
    """Wait for every process; on the first failure or at the deadline, kill the rest and
    raise with the failed (or first unfinished) process's output tail."""
    pending = list(range(len(procs)))
    try:
        while pending:
            for i in list(pending):
                rc = procs[i].poll()
                if rc is None:
                    continue
                pending.remove(i)
                if rc != 0:
                    raise SweepRaceError(
                        f"{what}: process {i} ({shlex.join(commands[i])}) exited "
                        f"with status {rc}; the end of its output:\n{_tail(logs[i])}"
                    )
            if not pending:
                break
            if time.perf_counter() > deadline:
                i = pending[0]
                raise SweepRaceError(
                    f"{what}: timed out after {timeout:g} s (--timeout) with "
                    f"{len(pending)} process(es) running; the end of process {i}'s "
                    f"output:\n{_tail(logs[i])}"
                )
            # Block on one running process for a moment, then look at all of them again:
            # any may fail first, and a failure should stop the others at once.
            with contextlib.suppress(subprocess.TimeoutExpired):
                procs[pending[0]].wait(timeout=min(0.5, max(0.0, deadline - time.perf_counter())))
    finally:
        _stop(procs)


def _read_trials(out: Path, process: int, cfg: RaceConfig) -> tuple[list[TrialValue], float]:
    """The trials one process trained (from its ``results.json``) and its sweep time.

    Raises:
        SweepRaceError: the report is missing, or a trial's parameters are not its
            `grid_point` (the processes did not sweep the race's space).
    """
    path = out / "results.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise SweepRaceError(f"process {process} left no readable {path}: {e}") from None
    trials = []
    for t in data["trials"]:
        lr, weight_decay = grid_point(t["number"])
        got = (t["params"].get("lr"), t["params"].get("weight_decay"))
        if got != (lr, weight_decay):
            raise SweepRaceError(
                f"{path}: trial #{t['number']} trained lr, weight decay {got}, not the "
                f"race's {(lr, weight_decay)}"
            )
        trials.append(
            TrialValue(number=t["number"], state=t["state"], value=t["value"], process=process)
        )
    return trials, float(data["elapsed_s"])


def run_mode(cfg: RaceConfig, mode: Mode, repeat: int) -> RunResult:
    """Run `mode`'s sweep once on a fresh storage and time it to the last process's exit.

    Raises:
        SweepRaceError: a process failed or ran past `cfg.timeout`, or a report is
            missing or wrong.
    """
    n = cfg.processes(mode)
    study = f"sweep-race-{mode.value}-{repeat}"
    with tempfile.TemporaryDirectory(prefix=f"plait-sweep-race-{mode.value}-") as tmp:
        root = Path(tmp)
        storage = f"sqlite:///{root / 'study.db'}"
        create_study(storage, study)
        outs = [root / f"out-{i}" for i in range(n)]
        logs = [root / f"process-{i}.log" for i in range(n)]
        commands = [sweep_command(cfg, mode, storage=storage, study=study, out=o) for o in outs]
        log.debug("%s, repeat %d: %s", mode.value, repeat + 1, shlex.join(commands[0]))
        handles = [p.open("wb") for p in logs]
        procs: list[subprocess.Popen[bytes]] = []
        try:
            usage = _CpuUsage()
            start = time.perf_counter()
            for command, handle in zip(commands, handles, strict=True):
                procs.append(
                    subprocess.Popen(
                        command,
                        stdin=subprocess.DEVNULL,
                        stdout=handle,
                        stderr=subprocess.STDOUT,
                        cwd=root,
                        env=_environment(),
                    )
                )
            _wait_all(
                procs,
                commands,
                logs,
                deadline=start + cfg.timeout,
                what=f"{mode.value} sweep (repeat {repeat + 1})",
                timeout=cfg.timeout,
            )
            seconds = time.perf_counter() - start
            cpu_s, others_busy = usage.since()
        finally:
            _stop(procs)
            for handle in handles:
                handle.close()
        trials: list[TrialValue] = []
        sweep_seconds = []
        for i, o in enumerate(outs):
            got, elapsed = _read_trials(o, i, cfg)
            trials.extend(got)
            sweep_seconds.append(elapsed)
    numbers = [t.number for t in trials]
    if len(set(numbers)) != len(numbers):
        raise SweepRaceError(f"{mode.value}: a trial number was trained twice: {sorted(numbers)}")
    return RunResult(
        mode=mode,
        repeat=repeat,
        seconds=seconds,
        processes=n,
        threads=cfg.threads_per_process(mode),
        sweep_seconds=sweep_seconds,
        cpu_s=cpu_s,
        others_busy=others_busy,
        trials=sorted(trials, key=lambda t: t.number),
    )


def run_race(cfg: RaceConfig) -> list[RunResult]:
    """Every mode `cfg.repeats` times, in rotating order; logs a line per run."""
    runs = []
    order = race_order(cfg.repeats)
    for k, (repeat, mode) in enumerate(order, 1):
        log.info(
            "run %d/%d: %s (repeat %d/%d, %d process(es) x %d thread(s))...",
            k,
            len(order),
            mode.value,
            repeat + 1,
            cfg.repeats,
            cfg.processes(mode),
            cfg.threads_per_process(mode),
        )
        run = run_mode(cfg, mode, repeat)
        best = run.best
        log.info(
            "run %d/%d: %s took %.1f s; %d trials, best #%s %s",
            k,
            len(order),
            mode.value,
            run.seconds,
            len(run.values()),
            best.number if best else "-",
            f"{best.value:.4f}" if best and best.value is not None else "-",
        )
        runs.append(run)
    return runs


def _fmt(value: float | None, spec: str = ".4f") -> str:
    return "-" if value is None else format(value, spec)


#: Others' share of the CPU above which the report warns that the times are disturbed.
BUSY_WARNING = 0.1


def markdown_table(summary: RaceSummary, cfg: RaceConfig) -> str:
    """The race's table: time to finish, ratio to fused, best trial per mode."""
    rows = [
        "| mode | processes x threads | max models | time, median (s) | min-max (s) "
        "| vs fused | sweep time, median (s) | others' CPU | best trial | best val. accuracy "
        "| trials | max trial diff. vs fused |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in summary.modes:
        numbers = sorted({n for n in s.best_numbers if n is not None})
        values = [v for v in s.best_values if v is not None]
        value = (
            "-"
            if not values
            else f"{values[0]:.4f}"
            if max(values) == min(values)
            else f"{min(values):.4f}-{max(values):.4f}"
        )
        trials = sorted(set(s.trials))
        ratio = "-" if s.vs_fused is None else f"{s.vs_fused:.2f}x"
        busy = "-" if s.others_busy is None else f"{s.others_busy:.0%}"
        rows.append(
            f"| {s.mode.value} | {cfg.processes(s.mode)} x {cfg.threads_per_process(s.mode)} "
            f"| {cfg.array_limit(s.mode)} | {s.seconds.median:.1f} "
            f"| {s.seconds.min:.1f}-{s.seconds.max:.1f} | {ratio} "
            f"| {s.sweep_seconds.median:.1f} | {busy} "
            f"| {', '.join(f'#{n}' for n in numbers) or '-'} | {value} "
            f"| {', '.join(map(str, trials))} | {_fmt(s.max_trial_diff)} |"
        )
    spread = _fmt(summary.best_spread)
    numbers = sorted({n for s in summary.modes for n in s.best_numbers if n is not None})
    verdict = (
        f"The best values agree: within {spread} of each other in every run "
        f"(tolerance {summary.tolerance:g})"
        if summary.agree
        else f"The best values DISAGREE: {spread} apart (tolerance {summary.tolerance:g})"
    ) + (
        "; the same best trial in every run."
        if summary.same_trial
        else f"; best trials {numbers} (near-ties, which summation order can swap)."
    )
    busiest = max((s.others_busy or 0.0 for s in summary.modes), default=0.0)
    if busiest > BUSY_WARNING:
        verdict += (
            f" Warning: other processes used up to {busiest:.0%} of the machine's CPU "
            "during the runs, so the times are disturbed."
        )
    return "\n".join(rows) + "\n\n" + verdict + "\n"


def _ratio(summary: RaceSummary, mode: Mode) -> str:
    ratio = next((s.vs_fused for s in summary.modes if s.mode is mode), None)
    return "-" if ratio is None else f"{ratio:.2f}x"


def describe(summary: RaceSummary, cfg: RaceConfig) -> str:
    """The paragraph that says what was run, above the table."""
    return (
        f"A {cfg.trials}-trial sweep of {cfg.workload} (SGD, momentum {MOMENTUM}, batch "
        f"{BATCH_SIZE}, {cfg.epochs} epochs per trial, no pruning) run to the end "
        f"{cfg.repeats} time(s) in each of three modes, in rotating order: `fused` is one "
        f"`plait sweep --max-models {cfg.max_models}` process on {cfg.threads} thread(s); "
        f"`sequential` is one `plait sweep --max-models 1` process on {cfg.threads} "
        f"thread(s); `concurrent` is {cfg.concurrent} `plait sweep --max-models 1` "
        f"processes started at once on one SQLite study, {cfg.threads // cfg.concurrent} "
        f"thread(s) each. Time is wall clock from launch to the last process's exit. "
        "Each run has a fresh SQLite storage whose study is created before the clock "
        "starts, for every mode alike. "
        f"Every mode trains the same trials: trial n's learning rate (log-uniform in "
        f"{LR_RANGE}) and weight decay (log-uniform in {WEIGHT_DECAY_RANGE}) depend on n "
        f"alone (`{SPACE_TARGET}`), as do its initial weights and data order (seed "
        f"{cfg.seed}). Sequential takes {_ratio(summary, Mode.SEQUENTIAL)} and concurrent "
        f"{_ratio(summary, Mode.CONCURRENT)} the fused time (medians). "
        '"Sweep time" is the slowest process\'s own sweep (asking, memory search, '
        'training), without interpreter start-up and reports; "others\' CPU" is the '
        "largest share of the machine's CPU time that other processes used during a run; "
        '"max trial diff." is the largest difference of one trial\'s validation accuracy '
        "from the first fused run.\n\n"
    )


def plot(summary: RaceSummary, path: Path) -> Path:
    """Bars of each mode's median time to finish, with min-max error bars."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    names = [s.mode.value for s in summary.modes]
    medians = [s.seconds.median for s in summary.modes]
    errors = [
        [s.seconds.median - s.seconds.min for s in summary.modes],
        [s.seconds.max - s.seconds.median for s in summary.modes],
    ]
    colours = ["tab:green", "tab:red", "tab:orange"][: len(names)]
    bars = ax.bar(names, medians, yerr=errors, capsize=6, color=colours)
    for bar, s in zip(bars, summary.modes, strict=True):
        label = f"{s.seconds.median:.0f} s"
        if s.vs_fused is not None and s.mode is not Mode.FUSED:
            label += f"\n{s.vs_fused:.2f}x fused"
        ax.annotate(
            label,
            (bar.get_x() + bar.get_width() / 2, s.seconds.max),
            xytext=(0, 4),
            textcoords="offset points",
            ha="center",
            va="bottom",
            fontsize=9,
        )
    ax.set_ylabel("time to finish the sweep (s)")
    ax.set_ylim(0, max(s.seconds.max for s in summary.modes) * 1.25)
    ax.set_title("sweep race: median of repeats, min-max bars")
    return save_figure(fig, path)


def write_results(
    out: Path,
    cfg: RaceConfig,
    runs: Sequence[RunResult],
    summary: RaceSummary,
    *,
    command: str,
    meta: Mapping[str, Any] | None = None,
) -> dict[str, Path]:
    """results.json (config, runs, summary, provenance), results.md and results.png.

    `meta`: the provenance taken when the race started (default: taken now).
    """
    record: Mapping[str, Any] = {
        "config": asdict(cfg),
        "summary": summary.to_dict(),
        "runs": [r.to_dict() for r in runs],
        **(meta if meta is not None else provenance(command=command)),
    }
    return write_report(
        out,
        record,
        title=f"Sweep race: {cfg.trials} trials of {cfg.workload}",
        command=command,
        body=describe(summary, cfg) + markdown_table(summary, cfg),
        plot=lambda path: plot(summary, path),
    )


@dataclass(frozen=True, kw_only=True)
class RaceFlags:
    """The command line (`plait.flags`): a `RaceConfig`'s fields and the report's folder.

    Kept apart from `RaceConfig`, whose thread count defaults to the usable CPUs when it is
    built, while the flag's default is "not given"; the other defaults are `RaceConfig`'s
    own, so the two cannot drift. Building the flags checks them (ValueError naming the
    flag), so that `plait.flags.parse` refuses a bad command line before anything runs.

    Attributes:
        threads: as `RaceConfig`'s; None for the usable CPUs.
        out: the report's folder (default: print the table only).
    """

    trials: int = option(RaceConfig.trials, "trials per sweep")
    epochs: int = option(RaceConfig.epochs, "epochs per trial")
    repeats: int = option(RaceConfig.repeats, "runs of every mode")
    concurrent: int = option(
        RaceConfig.concurrent, "processes of the concurrent mode (default: %(default)s)"
    )
    threads: int | None = option(
        None, "threads in all, split among concurrent processes (default: the usable CPUs)"
    )
    max_models: int = option(RaceConfig.max_models, "largest fused array")
    workload: str = option(RaceConfig.workload, "the workload swept")
    seed: int = option(RaceConfig.seed, "weights and data order")
    timeout: float = option(
        RaceConfig.timeout, "seconds one mode's run may take before its processes are killed"
    )
    tolerance: float = option(
        RaceConfig.tolerance, "how far apart the best validation accuracies may be and agree"
    )
    out: str | None = option(None, "report folder (default: print the table only)")

    def __post_init__(self) -> None:
        self.race()

    def race(self) -> RaceConfig:
        """The race of these flags; a bad value raises ValueError naming its flag."""
        from plait.workloads import WORKLOADS, is_factory_spec

        if not is_factory_spec(self.workload) and self.workload not in WORKLOADS:
            raise ValueError(
                f"--workload {self.workload!r}: unknown; choose from {', '.join(WORKLOADS)} "
                "or give a factory pkg.module:factory"
            )
        if self.out is not None and Path(self.out).exists() and not Path(self.out).is_dir():
            raise ValueError(f"--out {self.out!r}: exists and is not a folder")
        return RaceConfig(
            trials=self.trials,
            epochs=self.epochs,
            repeats=self.repeats,
            concurrent=self.concurrent,
            threads=self.threads if self.threads is not None else usable_cpus(),
            max_models=self.max_models,
            workload=self.workload,
            seed=self.seed,
            timeout=self.timeout,
            tolerance=self.tolerance,
        )


def run_parsed(flags: RaceFlags, call: suites.Call) -> int:
    """Run the race, print its table, and write the reports with ``--out``."""
    from plait.log import configure

    cfg = flags.race()
    configure()
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # a line per study created
    command = call.quoted
    meta = provenance(command=command)  # the code as the race starts
    runs = run_race(cfg)
    summary = summarize(runs, tolerance=cfg.tolerance)
    table = markdown_table(summary, cfg)
    print(table, end="")
    if flags.out is not None:
        paths = write_results(Path(flags.out), cfg, runs, summary, command=command, meta=meta)
        print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m plait.bench.fused.sweep_race``: the suite ``sweep-race``
    (`plait.bench.suites`)."""
    return suites.main("sweep-race", argv)


if __name__ == "__main__":
    sys.exit(main())
