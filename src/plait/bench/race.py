"""`plait race`: time to a held-out target, strategies interleaved on one cluster.

Users choose a strategy by how soon it reaches the accuracy (or loss) they need, not by its
step time: a compressor that halves the step but needs three times the steps loses. A race
trains every entry (a strategy spec, an optimizer and a learning rate) on a workload's
real data from the same seed and the same initial weights, and reports the wall-clock
training time and the steps each needs to reach the target on the held-out split.

How entries share the machine: ONE distributed job on the emulated cluster holds every
entry's `Trainer` (each its own model copy, optimizer and strategy on the same process
group) and trains them in turn, `chunk` steps each (A B C A B C ...), until each reaches
its target or the step budget. Slow drift of a shared machine (another job, thermal
throttling) then hits all entries alike, as in `plait bench`; separate long-lived jobs
taking turns would interleave just as well but pay a process start-up per entry and
hold every entry's processes in memory at once for nothing. Each entry keeps its own
random-number state between its chunks, so its run does not depend on the others'.

Clocks: an entry's training time is the sum of its steps' wall-clock times (forward,
backward, communication, optimizer), measured on every rank and reported as the slowest
rank's total at each evaluation. A chunk starts after a barrier (so the previous entry's
stragglers are not charged to it). Evaluations on the held-out split (every `eval_every`
steps, also at step 0 and at the budget) are excluded from the time and timed apart.
Bytes are those of `plait.comm.stats` during training steps: modelled ring bytes sent per
worker, summed over the run.

Seeds run one after another in the same job; per entry, the report gives the median over
seeds with min and max. A seed that never reaches the target counts as infinitely slow,
so the median is "not reached" when at least half the seeds miss.

What makes a verdict: two hosts of the same kind gave the same race different step
counts (a target decided by one or two samples of a small test split, and floating-point
results that depend on the kernels the CPU dispatches to). So a race runs at least five
seeds by default, its workers pin the CPU kernels (`plait.cpu.float_pins`), every ratio of
times carries a bootstrap interval over the seeds (`ratio_interval`), and a ratio is
called a win (or a loss) only when its interval excludes 1 (`verdict`).
"""

from __future__ import annotations

import json
import logging
import math
import statistics
import sys
import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import numpy as np

from plait import comm
from plait import distributed as pdist
from plait.bench.protocol import (
    BOOTSTRAP_RESAMPLES,
    CONFIDENCE,
    DEFAULT_SEEDS,
    METRICS,
    MIN_VERDICT_SEEDS,
)
from plait.comm import stats as comm_stats
from plait.cpu import float_pins
from plait.records import provenance, pyplot, save_figure, write_json, write_markdown
from plait.specs import split_specs
from plait.train.config import OPTIMIZERS, TrainConfig
from plait.train.loop import Trainer, rng_state, set_rng_state
from plait.train.strategies.kfac import KFACStrategy

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class Entry:
    """One competitor: a strategy spec trained with an optimizer at a learning rate.

    Attributes:
        spec: a strategy spec as `plait train --strategy` takes it (``acpsgd:rank=4``).
        optimizer: ``sgd`` (with momentum), ``adam``, ``adamw`` or ``muon``; None: the
            workload's default.
        lr: learning rate; None: the workload's default.
        with_lr: name the entry with its learning rate (``ssgd+sgd@0.1``): set by
            `RaceSpec` when one spec and optimizer race at several learning rates.
    """

    spec: str
    optimizer: str | None = None
    lr: float | None = None
    with_lr: bool = False

    @property
    def label(self) -> str:
        """``spec+optimizer`` (the name in tables, plots and the ``--lr`` map), and
        ``@lr`` after it when `with_lr`."""
        name = self.spec if self.optimizer is None else f"{self.spec}+{self.optimizer}"
        return f"{name}@{self.lr:g}" if self.with_lr and self.lr is not None else name


def parse_entry(
    text: str,
    *,
    optimizer: str | None = None,
    lrs: Mapping[str, float] | None = None,
    lr: float | None = None,
) -> Entry:
    """Read ``SPEC[+OPTIMIZER][@LR]`` (``acpsgd:rank=4+sgd@0.1``, ``ssgd+muon@0.02``).

    The learning rate comes from ``@LR``, else from `lrs` by the entry's label (or its bare
    spec), else `lr`; the optimizer from ``+OPTIMIZER``, else `optimizer`.

    Raises:
        ValueError: an empty spec, an unknown optimizer, or a learning rate that is not a
            positive number.
    """
    body, at, lr_text = text.strip().rpartition("@")
    if not at:
        body, lr_text = text.strip(), ""
    spec, plus, opt_text = body.rpartition("+")
    if not plus:
        spec, opt_text = body, ""
    spec = spec.strip()
    opt = opt_text.strip() or optimizer
    if not spec:
        raise ValueError(f"race entry {text!r}: no strategy; expected SPEC[+OPTIMIZER][@LR]")
    if opt is not None and opt not in OPTIMIZERS:
        raise ValueError(
            f"race entry {text!r}: unknown optimizer {opt!r}; choose from {', '.join(OPTIMIZERS)}"
        )
    entry = Entry(spec=spec, optimizer=opt)
    value: float | None
    if lr_text:
        value = _positive(lr_text, f"race entry {text!r}: learning rate")
    else:
        lrs = lrs or {}
        value = lrs.get(entry.label, lrs.get(spec, lr))
    return Entry(spec=spec, optimizer=opt, lr=value)


def _positive(text: str, what: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{what} {text!r} is not a number") from None
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{what} {text!r}: expected a number > 0")
    return value


def parse_lr_map(items: Sequence[str]) -> tuple[float | None, dict[str, float]]:
    """``--lr`` values: a bare number applies to every entry, ``LABEL=LR`` to one.

    The label is the entry's ``SPEC[+OPTIMIZER]``; options inside it may hold ``=`` too, so
    the learning rate is what follows the last ``=`` (``acpsgd:rank=4+sgd=0.1``).

    Raises:
        ValueError: an item that is neither, or a label given twice.
    """
    default: float | None = None
    lrs: dict[str, float] = {}
    for item in items:
        for part in split_specs(item) if ";" in item else [item]:
            label, eq, value = part.strip().rpartition("=")
            if not eq:
                default = _positive(part.strip(), "--lr")
                continue
            if not label.strip():
                raise ValueError(f"--lr {part!r}: expected LR or LABEL=LR")
            if label.strip() in lrs:
                raise ValueError(f"--lr: {label.strip()!r} given twice")
            lrs[label.strip()] = _positive(value, f"--lr {label.strip()}")
    return default, lrs


@dataclass(kw_only=True)
class RaceSpec:
    """One race: what a job trains and when each entry stops (JSON between processes).

    Attributes:
        workload: a registered workload or a user factory; trained on its real data.
        entries: the competitors.
        target: the held-out metric to reach.
        metric: ``accuracy`` (reach at least `target`) or ``loss`` (at most `target`).
        seeds: one run per entry per seed (same seed: same initial weights and data order).
        max_steps: step budget per run.
        eval_every: steps between held-out evaluations (also at step 0 and the budget).
        chunk: steps an entry trains before the next entry's turn.
        batch_size: per-worker batch size (default: the workload's).
        full_budget: keep training after the target to the budget (final metrics at equal
            steps); by default a run stops at its target.
        bandwidth, rate: the network setting as given and as shaped (recorded only).
    """

    workload: str
    entries: list[Entry]
    target: float
    metric: str = "accuracy"
    seeds: list[int] = field(default_factory=lambda: list(DEFAULT_SEEDS))
    max_steps: int = 500
    eval_every: int = 10
    chunk: int = 10
    batch_size: int | None = None
    full_budget: bool = False
    bandwidth: str = ""
    rate: str = ""

    def __post_init__(self) -> None:
        self.entries = [Entry(**e) if isinstance(e, dict) else e for e in self.entries]
        if not self.entries:
            raise ValueError("a race needs at least one entry, e.g. ssgd+sgd@0.1")
        labels = [e.label for e in self.entries]
        several = {x for x in labels if labels.count(x) > 1}
        # one spec and optimizer at several learning rates: a learning-rate sweep, whose
        # entries are named with their rates
        self.entries = [
            replace(e, with_lr=True) if e.label in several and e.lr is not None else e
            for e in self.entries
        ]
        labels = [e.label for e in self.entries]
        twice = sorted({x for x in labels if labels.count(x) > 1})
        if twice:
            raise ValueError(f"race entries given twice: {', '.join(twice)}")
        if self.metric not in METRICS:
            raise ValueError(f"metric {self.metric!r}: choose from {', '.join(METRICS)}")
        if not math.isfinite(self.target):
            raise ValueError(f"target {self.target}: expected a finite number")
        if self.metric == "accuracy" and not 0 < self.target <= 1:
            raise ValueError(f"target accuracy {self.target}: expected a fraction in (0, 1]")
        if not self.seeds:
            raise ValueError("a race needs at least one seed")
        if len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"seeds given twice: {self.seeds}")
        for key in ("max_steps", "eval_every", "chunk"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key} must be >= 1, got {getattr(self, key)}")
        if self.batch_size is not None and self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        for e in self.entries:  # workload, spec and its options, optimizer, lr
            self.train_config(e, self.seeds[0])

    def train_config(self, entry: Entry, seed: int) -> TrainConfig:
        """The `plait train` settings of one run (validated by `TrainConfig`)."""
        return TrainConfig(
            workload=self.workload,
            strategy=entry.spec,
            data="real",
            steps=self.max_steps,
            batch_size=self.batch_size,
            lr=entry.lr,
            optimizer=entry.optimizer,
            seed=seed,
            progress=False,
        )

    def reached(self, value: float) -> bool:
        """The stop rule's test: `value` of the held-out metric meets the target."""
        return reached(value, self.target, self.metric)


def reached(value: float, target: float, metric: str) -> bool:
    """True when `value` meets `target`: at least it for accuracy, at most it for a loss."""
    higher = METRICS[metric][1]
    if not math.isfinite(value):
        return False
    return value >= target if higher else value <= target


def should_stop(
    *, step: int, value: float | None, target: float, metric: str, max_steps: int, full_budget: bool
) -> bool:
    """The stop rule: at the step budget, at an evaluation that meets the target (unless
    the run goes on to the full budget), or at one that is not a number: a diverged run
    (NaN weights) never arrives, and training it on would only spend the race's time.
    `value` is None between evaluations."""
    if step >= max_steps:
        return True
    if value is None:
        return False
    if not math.isfinite(value):
        return True
    if full_budget:
        return False
    return reached(value, target, metric)


@dataclass(kw_only=True)
class RacePoint:
    """One evaluation of a run: where it stood on the held-out split."""

    step: int
    train_time_s: float
    metric: float
    test_loss: float
    test_accuracy: float
    train_loss: float | None
    #: K-FAC's factor and inversion intervals in force at this point (``"auto"`` decides
    #: them as it goes); None for an entry without K-FAC
    kfac_intervals: list[int] | None = None


@dataclass(kw_only=True)
class RaceRun:
    """One entry trained from one seed."""

    label: str
    spec: str
    optimizer: str
    lr: float
    seed: int
    reached: bool
    steps_to_target: int | None
    time_to_target_s: float | None
    steps: int
    train_time_s: float
    eval_time_s: float
    final_metric: float
    bytes_per_worker: float
    payload_bytes: int
    curve: list[RacePoint]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(kw_only=True)
class RaceResult:
    """One entry over all seeds: medians with min and max, and the runs themselves.

    Times, steps and bytes are per run; `time_ratio` is this entry's median time to target
    over the first entry's (None when either did not reach it).
    """

    workload: str
    label: str
    spec: str
    optimizer: str
    lr: float
    metric: str
    target: float
    seeds: list[int]
    reached: int
    time_to_target_s: float | None
    time_to_target_min_s: float | None
    time_to_target_max_s: float | None
    steps_to_target: float | None
    steps_to_target_min: int | None
    steps_to_target_max: int | None
    final_metric: float
    final_metric_min: float
    final_metric_max: float
    bytes_per_worker: float
    bytes_per_worker_min: float
    bytes_per_worker_max: float
    time_ratio: float | None
    nodes: int
    nproc_per_node: int
    world_size: int
    bandwidth: str
    rate: str
    batch_size: int
    max_steps: int
    eval_every: int
    chunk: int
    full_budget: bool
    runs: list[RaceRun]
    #: `time_ratio`'s bootstrap interval over the seeds (`ratio_interval`), and what it
    #: says (`verdict`); None where the ratio is undefined
    time_ratio_lo: float | None = None
    time_ratio_hi: float | None = None
    verdict: str | None = None
    #: median over seeds of the bytes each worker sent per training step
    bytes_per_step: float | None = None
    provenance: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        prov = d.pop("provenance")
        return {**d, **prov}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RaceResult:
        """Read back one record of results.json (`to_dict`'s output)."""
        names = {f.name for f in fields(cls)} - {"provenance", "runs"}
        runs = [
            RaceRun(**{**r, "curve": [RacePoint(**p) for p in r["curve"]]}) for r in data["runs"]
        ]
        return cls(
            **{k: v for k, v in data.items() if k in names},
            runs=runs,
            provenance={k: v for k, v in data.items() if k not in names and k != "runs"},
        )


def read_results(path: Path) -> list[RaceResult]:
    """A race's results.json, as `RaceResult` records (to re-plot or compare them)."""
    return [RaceResult.from_dict(d) for d in json.loads(Path(path).read_text())]


# ------------------------------------------------------------------ the distributed job
def _max_over_ranks(value: float) -> float:
    return comm.reduce_floats([value], op="max", name="race time")[0]


def _mean_over_ranks(values: list[float]) -> list[float]:
    return comm.reduce_floats(values, op="mean", name="race mean")


class _Runner:
    """One entry's trainer, data stream, clocks and learning curve within a seed."""

    def __init__(self, spec: RaceSpec, entry: Entry, seed: int) -> None:
        self.spec, self.entry, self.seed = spec, entry, seed
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # e.g. K-FAC's "modules left unpreconditioned"
            self.trainer = Trainer(spec.train_config(entry, seed))
        self.batches = self.trainer.stream()
        self.rng = rng_state()
        self.step = 0
        self.train_s = 0.0
        self.eval_s = 0.0
        self.wire = 0.0
        self.owner = object()  # tags this entry's collectives in plait.comm.stats
        self.payload = 0
        self.last_loss: float | None = None
        self.curve: list[RacePoint] = []
        self.hit: RacePoint | None = None
        self.done = False

    def evaluate(self) -> float:
        """Evaluate on the held-out split (time kept apart) and apply the stop rule."""
        t0 = time.perf_counter()
        metrics = self.trainer.evaluate()
        self.eval_s += time.perf_counter() - t0
        key = METRICS[self.spec.metric][0]
        if key not in metrics:
            raise ValueError(f"workload {self.spec.workload!r} has no held-out split to race on")
        point = RacePoint(
            step=self.step,
            train_time_s=_max_over_ranks(self.train_s),
            metric=metrics[key],
            test_loss=metrics["test_loss"],
            test_accuracy=metrics["test_accuracy"],
            train_loss=self.last_loss,
            kfac_intervals=self._kfac_intervals(),
        )
        self.curve.append(point)
        if self.hit is None and self.spec.reached(point.metric):
            self.hit = point
        self.done = should_stop(
            step=self.step,
            value=point.metric,
            target=self.spec.target,
            metric=self.spec.metric,
            max_steps=self.spec.max_steps,
            full_budget=self.spec.full_budget,
        )
        return point.metric

    def _kfac_intervals(self) -> list[int] | None:
        strategy = self.trainer.strategy
        if not isinstance(strategy, KFACStrategy) or strategy.kfac is None:
            return None
        kfac = strategy.kfac
        step = kfac.steps
        return [int(kfac.at("factor_interval", step)), int(kfac.at("inv_interval", step))]

    def advance(self, steps: int, bar: Any) -> None:
        """Train up to `steps` steps (evaluating on schedule) unless the run is done."""
        t = self.trainer
        set_rng_state(self.rng)
        comm.barrier()
        for _ in range(steps):
            if self.done:
                break
            micro = [next(self.batches) for _ in range(t.cfg.accumulate)]
            with comm_stats.owned_by(self.owner), comm_stats.window() as recs:
                t0 = time.perf_counter()
                self.last_loss = t.train_step(micro)
                self.train_s += time.perf_counter() - t0
            # this entry's own collectives are counted in `record`, wherever they ran;
            # untagged ones (issued from a backend thread's callback) end within the step
            untagged = [r for r in recs if r.owner is None]
            self.wire += sum(r.wire_bytes for r in untagged)
            self.payload += sum(r.nbytes for r in untagged)
            self.step += 1
            if bar is not None:
                bar.update(1)
            if self.step % self.spec.eval_every == 0 or self.step >= self.spec.max_steps:
                self.evaluate()
        self.rng = rng_state()

    def record(self) -> RaceRun:
        owned = comm_stats.owned(self.owner)
        wire, payload = _mean_over_ranks(
            [
                self.wire + sum(r.wire_bytes for r in owned),
                float(self.payload + sum(r.nbytes for r in owned)),
            ]
        )
        last = self.curve[-1]
        e = self.entry
        return RaceRun(
            label=e.label,
            spec=e.spec,
            optimizer=self.trainer.cfg.optimizer or self.trainer.wl.optimizer,
            lr=self.trainer.cfg.lr or self.trainer.wl.lr,
            seed=self.seed,
            reached=self.hit is not None,
            steps_to_target=None if self.hit is None else self.hit.step,
            time_to_target_s=None if self.hit is None else self.hit.train_time_s,
            steps=self.step,
            train_time_s=last.train_time_s,
            eval_time_s=_max_over_ranks(self.eval_s),
            final_metric=last.metric,
            bytes_per_worker=wire,
            payload_bytes=int(payload),
            curve=self.curve,
        )

    def close(self) -> None:
        self.trainer.close()


def run_race_job(spec: RaceSpec, *, progress: bool = False) -> list[RaceRun]:
    """Run `spec` on the current process group; every rank returns the same records."""
    bar = None
    if progress and pdist.is_main():
        from tqdm import tqdm

        total = len(spec.seeds) * len(spec.entries) * spec.max_steps
        bar = tqdm(
            total=total, desc=f"race {spec.workload}", unit="step", file=sys.stdout, mininterval=1.0
        )
    runs: list[RaceRun] = []
    try:
        for seed in spec.seeds:
            runners = [_Runner(spec, e, seed) for e in spec.entries]
            try:
                for r in runners:  # the common starting point: same weights, same metric
                    set_rng_state(r.rng)
                    r.evaluate()  # a target met before training ends the run at step 0
                    r.rng = rng_state()
                while not all(r.done for r in runners):
                    for r in runners:
                        if not r.done:
                            r.advance(spec.chunk, bar)
                runs += [r.record() for r in runners]
            finally:
                for r in runners:
                    r.close()
    finally:
        if bar is not None:
            bar.close()
    return runs


# ----------------------------------------------------------------------- aggregation
def median_range(values: Sequence[float | None]) -> tuple[float | None, float | None, float | None]:
    """(median, min, max) where None means "never" (+infinity); None where that is the answer.

    A run that missed the target is slower than any that reached it, so it still counts
    in the median: with 3 seeds, one miss leaves a median; two make it "not reached".
    """
    if not values:
        return None, None, None
    xs = [math.inf if v is None else float(v) for v in values]
    med = statistics.median(xs)

    def finite(x: float) -> float | None:
        return None if math.isinf(x) else x

    return finite(med), finite(min(xs)), finite(max(xs))


def ratio_interval(
    a: Sequence[float | None],
    b: Sequence[float | None],
    *,
    resamples: int = BOOTSTRAP_RESAMPLES,
    confidence: float = CONFIDENCE,
    seed: int = 0,
) -> tuple[float | None, float | None, float | None]:
    """Median of `a` over median of `b` (times by seed, paired: ``a[i]`` and ``b[i]`` ran
    from the same seed), with a percentile bootstrap interval over the seeds.

    None is a run that never reached the target (+infinity, as in `median_range`). Each
    resample draws the seeds with replacement and takes the ratio of the two medians; a
    resample where both medians are "never" has no ratio. The interval is None when more
    than the interval's tails (1 - `confidence`) of the resamples have none.

    Returns:
        (ratio, low, high); ratio is None when both medians are "never", and infinite
        (or 0) when only the numerator's (the denominator's) is.
    """
    if len(a) != len(b) or not a:
        raise ValueError(f"ratio_interval needs paired, non-empty times, got {len(a)}, {len(b)}")
    xa = np.array([math.inf if v is None else float(v) for v in a])
    xb = np.array([math.inf if v is None else float(v) for v in b])

    def ratio(num: np.ndarray, den: np.ndarray) -> np.ndarray:
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.asarray(num / den, dtype=float)

    point = float(ratio(np.median(xa), np.median(xb)))
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(xa), size=(resamples, len(xa)))
    boot = ratio(np.median(xa[idx], axis=1), np.median(xb[idx], axis=1))
    tail = (1 - confidence) / 2
    lo: float | None = None
    hi: float | None = None
    if np.isnan(boot).mean() <= 2 * tail:
        # no interpolation between resamples: "never" (inf) must not turn into NaN
        lo_v, hi_v = np.quantile(boot[~np.isnan(boot)], [tail, 1 - tail], method="inverted_cdf")
        lo, hi = float(lo_v), float(hi_v)
    return (None if math.isnan(point) else point), lo, hi


def verdict(lo: float | None, hi: float | None, seeds: int = MIN_VERDICT_SEEDS) -> str:
    """What an interval of a time ratio (a over b) over `seeds` paired seeds says:
    ``faster`` when it lies wholly below 1, ``slower`` wholly above, ``no verdict`` when it
    holds 1 (or is undefined), ``too few seeds`` below `MIN_VERDICT_SEEDS`."""
    if seeds < MIN_VERDICT_SEEDS:
        return "too few seeds"
    if lo is None or hi is None:
        return "no verdict"
    if hi < 1:
        return "faster"
    if lo > 1:
        return "slower"
    return "no verdict"


@dataclass(frozen=True)
class Comparison:
    """Entry `a`'s time to target over entry `b`'s, with its interval and verdict."""

    a: str
    b: str
    ratio: float | None
    lo: float | None
    hi: float | None
    verdict: str
    seeds: int


def compare(results: Sequence[RaceResult], a: str, b: str) -> Comparison:
    """`a`'s median time to target over `b`'s (labels), paired over their common seeds.

    Raises:
        ValueError: an unknown label, or no seed both ran.
    """
    by_label = {r.label: r for r in results}
    for label in (a, b):
        if label not in by_label:
            raise ValueError(f"no race entry {label!r}; entries: {', '.join(by_label)}")
    ta = {r.seed: r.time_to_target_s for r in by_label[a].runs}
    tb = {r.seed: r.time_to_target_s for r in by_label[b].runs}
    seeds = sorted(ta.keys() & tb.keys())
    if not seeds:
        raise ValueError(f"entries {a!r} and {b!r} share no seed")
    ratio, lo, hi = ratio_interval([ta[x] for x in seeds], [tb[x] for x in seeds])
    return Comparison(
        a=a, b=b, ratio=ratio, lo=lo, hi=hi, verdict=verdict(lo, hi, len(seeds)), seeds=len(seeds)
    )


def _stats(runs: Sequence[RaceRun]) -> dict[str, Any]:
    """An entry's medians with [min, max] over its runs (one per seed), as `RaceResult`
    fields."""
    t_med, t_min, t_max = median_range([r.time_to_target_s for r in runs])
    s_med, s_min, s_max = median_range([r.steps_to_target for r in runs])
    f_med, f_min, f_max = median_range([r.final_metric for r in runs])
    b_med, b_min, b_max = median_range([r.bytes_per_worker for r in runs])
    per_step, _, _ = median_range([r.bytes_per_worker / max(1, r.steps) for r in runs])
    assert f_med is not None and b_med is not None  # measured on every run
    return {
        "seeds": [r.seed for r in runs],
        "reached": sum(r.reached for r in runs),
        "time_to_target_s": t_med,
        "time_to_target_min_s": t_min,
        "time_to_target_max_s": t_max,
        "steps_to_target": s_med,
        "steps_to_target_min": None if s_min is None else int(s_min),
        "steps_to_target_max": None if s_max is None else int(s_max),
        "final_metric": f_med,
        "final_metric_min": f_min or 0.0,
        "final_metric_max": f_max or 0.0,
        "bytes_per_worker": b_med,
        "bytes_per_worker_min": b_min or 0.0,
        "bytes_per_worker_max": b_max or 0.0,
        "runs": list(runs),
        "bytes_per_step": per_step,
    }


def summarise(
    spec: RaceSpec,
    runs: Sequence[RaceRun],
    *,
    nodes: int,
    nproc_per_node: int,
    batch_size: int,
) -> list[RaceResult]:
    """One `RaceResult` per entry, in entry order, from its runs over the seeds."""
    results: list[RaceResult] = []
    for e in spec.entries:
        mine = sorted((r for r in runs if r.label == e.label), key=lambda r: r.seed)
        if not mine:
            raise ValueError(f"no runs of race entry {e.label!r}")
        results.append(
            RaceResult(
                workload=spec.workload,
                label=e.label,
                spec=e.spec,
                optimizer=mine[0].optimizer,
                lr=mine[0].lr,
                metric=spec.metric,
                target=spec.target,
                time_ratio=None,
                nodes=nodes,
                nproc_per_node=nproc_per_node,
                world_size=nodes * nproc_per_node,
                bandwidth=spec.bandwidth,
                rate=spec.rate,
                batch_size=batch_size,
                max_steps=spec.max_steps,
                eval_every=spec.eval_every,
                chunk=spec.chunk,
                full_budget=spec.full_budget,
                **_stats(mine),
            )
        )
    return annotate(results)


#: what two races must share for their runs to make one race (`merge`)
_SAME_RACE = (
    "workload", "spec", "optimizer", "lr", "metric", "target", "nodes", "nproc_per_node",
    "rate", "batch_size", "max_steps", "eval_every", "chunk", "full_budget",
)  # fmt: skip


def merge(parts: Sequence[Sequence[RaceResult]]) -> list[RaceResult]:
    """One race from races of the same entries and settings run apart, on other seeds (a
    second batch of seeds, run later or on a twin host): the runs pooled, the medians,
    ratios and verdicts taken again over all of them.

    The merged records keep the first race's provenance, and list every part's command
    under ``commands``.

    Raises:
        ValueError: the races differ in their entries (or their order) or in a setting of
            `_SAME_RACE`, or a seed ran in two of them.
    """
    if not parts or not parts[0]:
        raise ValueError("merge needs at least one race with entries")
    first = parts[0]
    labels = [r.label for r in first]
    for i, other in enumerate(parts[1:], 1):
        theirs = [r.label for r in other]
        if theirs != labels:
            raise ValueError(
                f"race {i + 1} has entries {', '.join(theirs)}; race 1 has {', '.join(labels)}"
            )
        for a, b in zip(first, other, strict=True):
            for name in _SAME_RACE:
                if getattr(a, name) != getattr(b, name):
                    raise ValueError(
                        f"entry {a.label!r}: {name} is {getattr(a, name)!r} in race 1, "
                        f"{getattr(b, name)!r} in race {i + 1}"
                    )
    commands: list[str] = []
    for part in parts:
        prov = part[0].provenance
        commands += prov.get("commands") or [prov.get("command", "")]
    merged = []
    for k, r in enumerate(first):
        runs = sorted((run for part in parts for run in part[k].runs), key=lambda x: x.seed)
        seeds = [run.seed for run in runs]
        twice = sorted({x for x in seeds if seeds.count(x) > 1})
        if twice:
            raise ValueError(f"entry {r.label!r}: seed {twice[0]} ran in two of the races")
        prov = {**r.provenance, "commands": commands}
        merged.append(replace(r, time_ratio=None, provenance=prov, **_stats(runs)))
    return annotate(merged)


def annotate(results: list[RaceResult]) -> list[RaceResult]:
    """Set every entry's time ratio to the first entry's, its interval and verdict, and
    its bytes per step, from the runs (also for results written before these existed)."""
    for r in results:
        c = compare(results, r.label, results[0].label)
        both = r.time_to_target_s is not None and results[0].time_to_target_s is not None
        r.time_ratio = c.ratio if both else None
        r.time_ratio_lo, r.time_ratio_hi, r.verdict = c.lo, c.hi, c.verdict
        if r.bytes_per_step is None:
            r.bytes_per_step, _, _ = median_range(
                [x.bytes_per_worker / max(1, x.steps) for x in r.runs]
            )
    return results


# -------------------------------------------------------------------------- reports
def _span(med: float | None, lo: float | None, hi: float | None, fmt: str) -> str:
    if med is None:
        return "not reached"
    hi_text = "never" if hi is None else format(hi, fmt)
    return f"{format(med, fmt)} [{format(lo or 0.0, fmt)}-{hi_text}]"


def _ratio_text(ratio: float | None, lo: float | None, hi: float | None) -> str:
    if ratio is None:
        return "-"
    if ratio == 0:
        return "0 (only the numerator reached)"
    text = f"{ratio:.2f}x" if math.isfinite(ratio) else "never"
    if lo is None or hi is None:
        return f"{text} [undefined]"
    hi_text = f"{hi:.2f}" if math.isfinite(hi) else "never"
    return f"{text} [{lo:.2f}-{hi_text}]"


def markdown(results: Sequence[RaceResult], compare_pairs: Sequence[tuple[str, str]] = ()) -> str:
    """The race as a Markdown table: medians over seeds with [min-max], every entry's time
    against the first entry's with its bootstrap interval and verdict, then the
    `compare_pairs` (a, b) as a table of their own."""
    if not results:
        return "No race results.\n"
    r0 = results[0]
    goal = ">=" if METRICS[r0.metric][1] else "<="
    net = r0.bandwidth or "unshaped"
    if r0.rate and r0.rate != r0.bandwidth:
        net += f" = {r0.rate}"
    pct = round(100 * CONFIDENCE)
    lines = [
        f"Race on `{r0.workload}` to held-out {r0.metric} {goal} {r0.target:g}: "
        f"{r0.nodes} node(s) x {r0.nproc_per_node}, {net}, batch {r0.batch_size} per worker, "
        f"budget {r0.max_steps} steps, evaluated every {r0.eval_every} steps, entries "
        f"interleaved {r0.chunk} steps at a time; seeds {', '.join(map(str, r0.seeds))}.",
        "Times are training only (evaluation excluded); median over seeds [min-max]; a seed "
        f"that misses the target counts as never. Ratios of median times carry a {pct}% "
        "bootstrap interval over the seeds; a verdict needs the interval to exclude 1.",
        "",
        f"| entry | lr | reached | time to target (s) | steps to target | final {r0.metric} "
        f"| MB sent per worker | MB per step | time vs {r0.label} [{pct}% CI] | verdict |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        mb_min, mb_max = r.bytes_per_worker_min / 1e6, r.bytes_per_worker_max / 1e6
        steps = _span(r.steps_to_target, r.steps_to_target_min, r.steps_to_target_max, ".0f")
        per_step = "-" if r.bytes_per_step is None else f"{r.bytes_per_step / 1e6:.3f}"
        ratio = "1.00x" if r is r0 else _ratio_text(r.time_ratio, r.time_ratio_lo, r.time_ratio_hi)
        lines.append(
            f"| {r.label} | {r.lr:g} | {r.reached}/{len(r.seeds)} "
            f"| {_span(r.time_to_target_s, r.time_to_target_min_s, r.time_to_target_max_s, '.2f')} "
            f"| {steps} "
            f"| {_span(r.final_metric, r.final_metric_min, r.final_metric_max, '.4f')} "
            f"| {_span(r.bytes_per_worker / 1e6, mb_min, mb_max, '.1f')} "
            f"| {per_step} | {ratio} | {'-' if r is r0 else (r.verdict or '-')} |"
        )
    if compare_pairs:
        lines += [
            "",
            f"| comparison | ratio of median times [{pct}% CI] | seeds | verdict |",
            "|---|---|---|---|",
        ]
        for a, b in compare_pairs:
            c = compare(results, a, b)
            lines.append(
                f"| {a} / {b} | {_ratio_text(c.ratio, c.lo, c.hi)} | {c.seeds} | {c.verdict} |"
            )
    return "\n".join(lines) + "\n"


def parse_pairs(text: str) -> list[tuple[str, str]]:
    """``A/B;C/D`` (labels as the table names them) as [(A, B), (C, D)].

    Raises:
        ValueError: an item without exactly one ``/`` between two labels.
    """
    pairs = []
    for item in filter(None, (x.strip() for x in text.split(";"))):
        a, sep, b = item.rpartition("/")
        if not sep or not a.strip() or not b.strip():
            raise ValueError(f"--compare {item!r}: expected A/B (two entry labels)")
        pairs.append((a.strip(), b.strip()))
    return pairs


def _median_run(runs: Sequence[RaceRun]) -> RaceRun:
    """The run whose time to target is the median (lower middle), misses last."""
    ranked = sorted(
        runs, key=lambda r: (math.inf if r.time_to_target_s is None else r.time_to_target_s, r.seed)
    )
    return ranked[(len(ranked) - 1) // 2]


def plot(results: Sequence[RaceResult], path: Path) -> Path:
    """Held-out metric against training time (left) and steps (right), one colour per entry.

    The entry's median run (by time to target) is the solid line; its other seeds are thin
    and faint; a dot marks where each run first met the target, the dashed line the target.
    """
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for r in results:
        best = _median_run(r.runs)
        color = None
        for run in [best, *(x for x in r.runs if x is not best)]:
            main = run is best
            for ax, key in ((axes[0], "train_time_s"), (axes[1], "step")):
                xs = [getattr(p, key) for p in run.curve]
                ys = [p.metric for p in run.curve]
                (line,) = ax.plot(
                    xs,
                    ys,
                    color=color,
                    linewidth=1.8 if main else 0.8,
                    alpha=1.0 if main else 0.35,
                    label=f"{r.label} (lr {r.lr:g})" if main and key == "step" else None,
                )
                color = line.get_color()
                hit = next((p for p in run.curve if p.step == run.steps_to_target), None)
                if run.reached and hit is not None:
                    ax.plot(
                        [getattr(hit, key)],
                        [hit.metric],
                        "o",
                        color=color,
                        markersize=4 if main else 2.5,
                        alpha=1.0 if main else 0.5,
                    )
    for ax in axes:
        ax.axhline(results[0].target if results else 0.0, color="grey", linestyle="--", linewidth=1)
        ax.grid(alpha=0.3)
    axes[0].set_xlabel("training wall-clock time (s, evaluation excluded)")
    axes[1].set_xlabel("step")
    if results:
        axes[0].set_ylabel(f"held-out {results[0].metric}")
        if results[0].metric == "loss":
            axes[0].set_yscale("log")
    # below both panels: long specs inside an axis would hide its curves
    handles, labels = axes[1].get_legend_handles_labels()
    legend = fig.legend(
        handles, labels, loc="upper center", bbox_to_anchor=(0.5, 0.0), fontsize=8, frameon=False
    )
    return save_figure(fig, path, dpi=120, outside=[legend])


def write_reports(
    results: Sequence[RaceResult], out: Path, compare_pairs: Sequence[tuple[str, str]] = ()
) -> None:
    """results.json (one record per entry with its runs), results.md and results.png."""
    write_json(results, out / "results.json")
    prov = results[0].provenance if results else {}
    commands = [c for c in prov.get("commands") or [prov.get("command", "")] if c]
    head = "# Race\n\n"
    if len(commands) == 1:
        head += f"Command: `{commands[0]}`\n\n"
    elif commands:  # a merged race (`merge`): its seeds ran in several invocations
        head += "Commands (the seeds ran in several invocations, pooled here):\n\n"
        head += "".join(f"- `{c}`\n" for c in commands) + "\n"
    write_markdown(head + markdown(results, compare_pairs), out / "results.md")
    plot(results, out / "results.png")


# --------------------------------------------------------------------- the launcher
def run_race(
    spec: RaceSpec,
    *,
    nodes: int = 4,
    nproc_per_node: int = 1,
    latency: str | None = None,
    loss: float | None = None,
    threads: int = 1,
    out: Path | None = None,
    timeout_s: float | None = 6 * 3600,
    command: str | None = None,
    progress: bool = True,
    compare_pairs: Sequence[tuple[str, str]] = (),
) -> list[RaceResult]:
    """Build the emulated cluster, run the race as one job on it, write reports to `out`.

    `spec.bandwidth` is the network setting (a named setting, a tc rate, or empty for an
    unshaped network); the cluster is torn down afterwards whatever happens. The workers
    run with the CPU kernels pinned (`plait.cpu.float_pins`, recorded with the results).
    `compare_pairs` are pairs of entry labels whose ratio the report also gives.

    Raises:
        ValueError: a bad spec (raised before any cluster exists).
        RuntimeError: the job failed; its node logs are kept and their tails logged.
    """
    from plait._proc import keep_scratch, scratch_dir
    from plait.cluster import Cluster, NetworkSpec, launch

    spec = RaceSpec(**{**asdict(spec)})  # re-validated, as the workers will read it
    labels = {e.label for e in spec.entries}
    for a, b in compare_pairs:
        for label in (a, b):
            if label not in labels:
                raise ValueError(f"--compare: no entry {label!r}; entries: {', '.join(labels)}")
    net = NetworkSpec(bandwidth=spec.bandwidth or None, latency=latency, loss=loss)
    spec.rate = net.rate or ""
    cfg = spec.train_config(spec.entries[0], spec.seeds[0])
    from plait.workloads import get_workload

    batch = cfg.batch_size or get_workload(spec.workload).train_batch
    work = scratch_dir("plait-race-")
    spec_path, res_path = work / "spec.json", work / "runs.json"
    spec_path.write_text(json.dumps(asdict(spec)))
    argv = ["plait.bench.race", str(spec_path), str(res_path)]
    if not progress:
        argv.append("--no-progress")
    # the code that runs: the tree as the race starts, not as it ends (a long race may
    # outlive edits to the working tree)
    meta = provenance(command=command)
    pins = float_pins()
    with Cluster.create(nodes=nodes, network=net) as cluster:
        logger.info(
            "race %s on %d node(s) x %d (%s): %s",
            spec.workload,
            nodes,
            nproc_per_node,
            cluster.network.describe(),
            ", ".join(e.label for e in spec.entries),
        )
        result = launch(
            cluster,
            argv,
            module=True,
            nproc_per_node=nproc_per_node,
            threads=threads,
            timeout_s=timeout_s,
            log_dir=work / "logs",
            env=pins,
        )
    if not result.ok or not res_path.exists():
        logger.error("%s", result.tail())
        keep_scratch(work)
        why = ", timed out" if result.timed_out else ""
        raise RuntimeError(f"race job failed (exit codes {result.returncodes}{why})")
    runs = [_run_from_dict(d) for d in json.loads(res_path.read_text())]
    results = summarise(spec, runs, nodes=nodes, nproc_per_node=nproc_per_node, batch_size=batch)
    for r in results:
        r.provenance = {**meta, "latency": latency, "loss": loss, "float_pins": pins}
    if out is not None:
        write_reports(results, out, compare_pairs)
    return results


def _run_from_dict(d: dict[str, Any]) -> RaceRun:
    d = dict(d)
    d["curve"] = [RacePoint(**p) for p in d["curve"]]
    return RaceRun(**d)


def main(argv: list[str] | None = None) -> int:
    """Worker entry point: ``python -m plait.bench.race SPEC.json OUT.json [--no-progress]``."""
    args = sys.argv[1:] if argv is None else argv
    progress = "--no-progress" not in args
    args = [a for a in args if a != "--no-progress"]
    if len(args) != 2:
        sys.stderr.write("usage: python -m plait.bench.race SPEC.json OUT.json [--no-progress]\n")
        return 2
    spec = RaceSpec(**json.loads(Path(args[0]).read_text()))
    pdist.init_distributed()
    try:
        runs = run_race_job(spec, progress=progress)
        if pdist.is_main():
            Path(args[1]).write_text(json.dumps([r.to_dict() for r in runs], indent=1))
    finally:
        pdist.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
