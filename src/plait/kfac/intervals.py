"""Choosing K-FAC's factor and inversion intervals from measured costs (``"auto"``).

K-FAC's extra work per step is the factor update (computing the factors in the layer hooks
and, under eager sync, their all-reduce, every `f` steps) and the inversion round (every `i`
steps: the decompositions, the broadcasts of their results and, under lazy sync, the
all-reduce of the running factors). Amortised over the steps that reuse them, the overhead
per step is

    overhead(f, i) = factor_s / f + inversion_s / i

The three costs are measured on the live run, by difference: a plain step (neither a
factor update nor inversions) times the base step, a factor step costs what it takes
beyond a plain one, and an inversion step what it takes beyond a factor step. Difference,
not the sum of K-FAC's own timed parts, because K-FAC's traffic also slows what is not
K-FAC's: under lazy sync the running factors are all-reduced during the backward pass of
an inversion step, on the link that carries the data-parallel gradient all-reduce, and
that step's backward waits longer for its gradients. The GPT on the `slow` link measured
a 5.7 s "base" step that way, against 3.1 to 3.8 s for a plain step, and kept inverting
every step. So after the first step, at intervals (1, 1), `probe_intervals` runs a few
steps of every kind (`IntervalPlanner` keeps the medians of each), and where a kind has
not been seen the timed parts stand in. (Under lazy sync a factor step between rounds has
no traffic, and less its timed factor part it is a clean base step: the lazy probe has no
plain steps.)

The rule: choose the smallest intervals whose amortised overhead stays within a fraction
`rho` (default 0.25) of the base step (the step without K-FAC's communication and
inversions), with `i` a multiple of `f` (inversions use freshly averaged factors) and both
in ``1..max_interval`` (default 100). "Smallest" means the smallest `i`, then the smallest
`f`: inverses are what precondition, so their freshness comes first.

Why a budget and not a full minimisation of time per unit of progress: progress per step
degrades slowly with staleness (factors are running averages that move little between
steps; published K-FAC schedules invert every 10 to 100 steps with no loss per step), while
the time per step grows by the whole overhead. Time per unit of progress is
``(base + overhead(f, i)) / progress(f, i)`` with `progress` close to flat in the intervals;
once the overhead is a small fraction of the base step, larger intervals save at most that
fraction of time and put freshness at risk. So paying more than `rho` of the base step
buys little, and the smallest intervals within the budget are the best trade. When even
``max_interval`` does not meet the budget, the largest intervals are taken (the cheapest
K-FAC can be) and a warning says so.

Everything here is a pure function of its inputs, so every rank that feeds in the same
numbers (costs that are identical everywhere, a base step agreed over the group) decides
the same intervals. `IntervalPlanner` adds the drift check: it keeps the costs it is shown
and asks for a new decision when the median of any of them over a window moves by more than
a factor `drift` (default 2) from the one of the last decision.
"""

from __future__ import annotations

import logging
import math
import statistics
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from plait.kfac.checks import check_int, check_value

logger = logging.getLogger(__name__)

#: The value of `KFACConfig.factor_interval` / `inv_interval` asking for this rule.
AUTO = "auto"

#: An interval given as a constant or as a callable of the step.
IntSchedule = int | Callable[[int], int]

#: Steps at intervals (1, 1) before the probe, and left out of the measurements: step 0
#: pays one-time costs (the buckets and placement are planned, on a 6-8-3 MLP its
#: inversions cost several times a later round's). One is enough: at 3 the digits CNN's
#: races spent 0.25-0.5 s in their first 10 steps (40-60 ms a step, AdamW's 22-27 ms) of
#: the 1.5-1.9 s they took to the target.
WARMUP_STEPS = 1

#: Inversion rounds run at `probe_intervals` before the first decision: two, so each kind
#: of step is seen at least twice and one slow step does not set the median.
PROBE_ROUNDS = 2


@dataclass(frozen=True, kw_only=True)
class StepCosts:
    """The seconds the rule weighs, per occurrence.

    Attributes:
        base_step_s: one training step without K-FAC's factor update and inversions (its
            forward, backward and preconditioning).
        factor_s: one factor update: computing every factor, and all-reducing them under
            eager sync.
        inversion_s: one round of inversions, with the broadcasts of their results, and
            under lazy sync the all-reduce of the running factors it inverts.
    """

    base_step_s: float
    factor_s: float
    inversion_s: float

    def __post_init__(self) -> None:
        for name in ("base_step_s", "factor_s", "inversion_s"):
            v = getattr(self, name)
            if not v >= 0:
                raise ValueError(f"{name} must be >= 0, got {v!r}")


@dataclass(frozen=True)
class Intervals:
    """A decision: steps between factor updates and between inversions."""

    factor: int
    inv: int


def overhead_s(costs: StepCosts, factor: int, inv: int) -> float:
    """Amortised seconds per step K-FAC adds at these intervals."""
    return costs.factor_s / factor + costs.inversion_s / inv


def choose_intervals(
    costs: StepCosts,
    *,
    rho: float = 0.25,
    max_interval: int = 100,
    factor: int | None = None,
    inv: int | None = None,
) -> Intervals:
    """The smallest intervals whose amortised overhead is at most `rho` of the base step.

    Args:
        costs: the step's base time and K-FAC's priced communication and inversions.
        rho: the overhead budget as a fraction of the base step (> 0).
        max_interval: the largest interval considered (>= 1).
        factor: a fixed factor interval (only the inversion interval is chosen, among its
            multiples); None chooses it.
        inv: a fixed inversion interval (only the factor interval is chosen, among its
            divisors); None chooses it.

    Raises:
        ValueError: a bad budget or bound.
    """
    if not rho > 0:
        raise ValueError(f"the overhead budget rho must be > 0, got {rho}")
    if max_interval < 1:
        raise ValueError(f"max_interval must be >= 1, got {max_interval}")
    if factor is not None and inv is not None:
        return Intervals(factor, inv)
    if factor is not None:
        candidates = [(factor, i) for i in range(factor, max(max_interval, factor) + 1, factor)]
    elif inv is not None:
        candidates = [(f, inv) for f in range(1, inv + 1) if inv % f == 0]
    else:
        candidates = [
            (f, i) for i in range(1, max_interval + 1) for f in range(1, i + 1) if i % f == 0
        ]
    budget = rho * costs.base_step_s
    # smallest i first, then smallest f (the candidates' order when i is chosen)
    candidates.sort(key=lambda fi: (fi[1], fi[0]))
    for f, i in candidates:
        if overhead_s(costs, f, i) <= budget:
            return Intervals(f, i)
    f, i = min(candidates, key=lambda fi: (overhead_s(costs, *fi), fi[1], fi[0]))
    logger.warning(
        "K-FAC's overhead stays above %.0f%% of the %.3g s base step even at intervals "
        "factor=%d, inv=%d (%.3g s per step): K-FAC may lose to its base optimizer here",
        100 * rho, costs.base_step_s, f, i, overhead_s(costs, f, i),
    )  # fmt: skip
    return Intervals(f, i)


def probe_intervals(
    factor: int | None = None, inv: int | None = None, *, lazy: bool = False
) -> Intervals:
    """Intervals whose kinds of step give every cost by difference; a given (fixed)
    interval is kept.

    Under eager sync every factor update is exchanged, so its traffic can slow the
    backward pass of the step: only plain steps time the base step, and the probe is
    (2, 4). Under lazy sync a factor update between rounds is local, and a factor step
    less its timed factor computation is a clean base step: the probe is (1, 2), which
    keeps the factors fresh while they move fastest (on the GPT at lr 0.1, two rounds at
    (2, 4) this early took the held-out loss from 4.7 to 9.7).

    Args:
        factor: the fixed factor interval, or None when it is chosen.
        inv: the fixed inversion interval, or None when it is chosen.
        lazy: the factors are exchanged only to be inverted (`FactorSync.LAZY`).
    """
    if factor is not None and inv is not None:
        return Intervals(factor, inv)
    if factor is not None:
        return Intervals(factor, 2 * factor)
    if inv is not None:
        f = 1 if lazy else next((f for f in range(2, inv + 1) if inv % f == 0), 1)
        return Intervals(f, inv)
    return Intervals(1, 2) if lazy else Intervals(2, 4)


@dataclass
class IntervalPlanner:
    """`choose_intervals` plus the drift check that triggers a new decision.

    Attributes:
        rho: overhead budget (fraction of the base step).
        max_interval: upper bound of both intervals.
        drift: a new decision is due when a windowed median cost differs from the one
            decided on by more than this factor, either way (> 1).
        window: measurements per median.
    """

    rho: float = 0.25
    max_interval: int = 100
    drift: float = 2.0
    window: int = 20
    decided: Intervals | None = None
    decided_on: StepCosts | None = None
    # whole steps by kind: neither part, a factor update only, an inversion round
    _plain: list[float] = field(default_factory=list)
    _factor_steps: list[float] = field(default_factory=list)
    _inv_steps: list[float] = field(default_factory=list)
    # K-FAC's own timed parts, which stand in for a kind not seen yet: the base step of
    # steps without inversions (clean of the round's traffic), of inversion steps
    _seen: list[float] = field(default_factory=list)
    _seen_inv: list[float] = field(default_factory=list)
    _factor: list[float] = field(default_factory=list)
    _inversion: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.drift > 1:
            raise ValueError(f"drift must be > 1, got {self.drift}")
        if self.window < 1:
            raise ValueError(f"window must be >= 1, got {self.window}")

    def decide(
        self, costs: StepCosts, *, factor: int | None = None, inv: int | None = None
    ) -> Intervals:
        """Decide from `costs` and remember them as the reference for drift."""
        self.decided = choose_intervals(
            costs, rho=self.rho, max_interval=self.max_interval, factor=factor, inv=inv
        )
        self.decided_on = costs
        logger.info(
            "K-FAC intervals: factor=%d, inv=%d (base step %.3g s, factor update %.3g s, "
            "inversions %.3g s, budget %.0f%%)",
            self.decided.factor, self.decided.inv, costs.base_step_s, costs.factor_s,
            costs.inversion_s, 100 * self.rho,
        )  # fmt: skip
        return self.decided

    def observe(
        self,
        total_s: float,
        *,
        factor_s: float | None = None,
        inversion_s: float | None = None,
    ) -> None:
        """Record one whole step and K-FAC's timed parts of it: `factor_s` on a step with
        a factor update, `inversion_s` on one with an inversion round (each window keeps
        its latest `window`)."""
        kind = (
            self._inv_steps
            if inversion_s is not None
            else self._factor_steps
            if factor_s is not None
            else self._plain
        )
        split = total_s - (factor_s or 0.0) - (inversion_s or 0.0)
        for seen, value in (
            (kind, total_s),
            (self._seen_inv if inversion_s is not None else self._seen, split),
            (self._factor, factor_s),
            (self._inversion, inversion_s),
        ):
            if value is not None:
                seen.append(value)
                del seen[: -self.window]

    def costs(self, priced: StepCosts) -> StepCosts:
        """The measured costs: by difference between the medians of the kinds of step
        where both were seen, else from the timed parts, else their `priced` value.

        An inversion step is taken to update the factors too (the rule keeps the
        inversion interval a multiple of the factor interval)."""
        med = statistics.median
        base = self.median()
        if base is None:
            base = priced.base_step_s
        if self._factor_steps and self._plain:
            factor = max(med(self._factor_steps) - base, 0.0)
        else:
            factor = med(self._factor) if self._factor else priced.factor_s
        if self._inv_steps and (self._factor_steps or self._plain):
            ref = med(self._factor_steps) if self._factor_steps else base + factor
            inversion = max(med(self._inv_steps) - ref, 0.0)
        else:
            inversion = med(self._inversion) if self._inversion else priced.inversion_s
        return StepCosts(base_step_s=base, factor_s=factor, inversion_s=inversion)

    def median(self) -> float | None:
        """The base step measured so far: plain steps, else the timed split of steps
        without inversions, else of inversion steps (None before any step)."""
        seen = self._plain or self._seen or self._seen_inv
        return statistics.median(seen) if seen else None

    def drifted(self, costs: StepCosts) -> bool:
        """Whether any of `costs` is more than `drift` times off the decided-on one."""
        if self.decided_on is None:
            return True
        for name in ("base_step_s", "factor_s", "inversion_s"):
            ref, now = getattr(self.decided_on, name), getattr(costs, name)
            if ref <= 0 or now <= 0:
                if ref != now:
                    return True
                continue
            if not 1 / self.drift <= now / ref <= self.drift:
                return True
        return False


# ---------------------------------------------------------------------------- progress
#: Candidates of a progress probe are the decided inversion interval and its neighbours
#: on this geometric ladder (``c / LADDER``, ``c``, ``c * LADDER``).
LADDER = 2

#: The first probe's centre: inversion intervals 1, 2 and 4, in blocks of 4 steps.
FIRST_CENTRE = 2

#: A probe's rates inform a decision when the best one exceeds this many standard errors
#: (about 97.7% one-sided under normal noise); below, the cost budget decides alone.
Z_INFORMED = 2.0


@dataclass(frozen=True)
class StepPlan:
    """What one step does: update the factors, invert them, under which intervals."""

    factor: bool
    inversion: bool
    intervals: Intervals


@dataclass(frozen=True, kw_only=True)
class StepSample:
    """One step as measured on this worker (what `IntervalController.observe` is shown).

    Attributes:
        total_s: the whole step, from its first hooked forward to the end of K-FAC's step.
        factor_s: K-FAC's timed factor work, on a step that updated the factors.
        inversion_s: the timed inversion round, on a step that inverted.
        loss: the step's training loss on this worker (None: not given).
    """

    total_s: float
    factor_s: float | None = None
    inversion_s: float | None = None
    loss: float | None = None


#: Agrees numbers over the ranks (``"max"`` or ``"mean"``): a collective, which a
#: controller calls only at steps every rank reaches together, with lists of equal length.
Agree = Callable[[list[float], str], list[float]]

#: The priced costs to fall back on before measuring, given a base step (`KFAC.step_costs`).
Priced = Callable[[float], StepCosts]


def step_time_s(costs: StepCosts, iv: Intervals) -> float:
    """Seconds per step at intervals `iv`: the base step plus the amortised overhead."""
    return costs.base_step_s + overhead_s(costs, iv.factor, iv.inv)


@dataclass(frozen=True)
class Progress:
    """Loss decrease per step under each candidate of a probe, with standard errors."""

    rates: tuple[float, ...]
    stderr: tuple[float, ...]

    @property
    def informed(self) -> bool:
        """Whether the best rate stands out from the noise (`Z_INFORMED`)."""
        best = max(range(len(self.rates)), key=lambda k: self.rates[k])
        return self.rates[best] > Z_INFORMED * self.stderr[best]


def fit_progress(losses: Sequence[float], which: Sequence[int], candidates: int) -> Progress | None:
    """Each candidate's loss decrease per step, from a probe's training losses.

    The loss before step t is modelled as ``c - sum_k d_k n_k(t) + e (t - t_mid)^2``, with
    ``n_k(t)`` the updates made under candidate k before step t: every step moves the loss
    by its candidate's rate, and the shared quadratic term takes the curve's common
    slowing down, so ``d_k`` is candidate k's rate at the probe's midpoint. Blocks run in a
    palindrome (A B C C B A), which makes the rates nearly orthogonal to that drift. Least
    squares; standard errors from the residuals.

    Args:
        losses: the training loss at each probe step (before its update).
        which: the candidate index of each step's update.
        candidates: the number of candidates.

    Returns:
        None when a loss is missing (NaN) or the probe is too short to fit.
    """
    t_count = len(losses)
    if t_count != len(which) or t_count < candidates + 3:
        return None
    y = np.asarray(losses, dtype=np.float64)
    if not np.all(np.isfinite(y)):
        return None
    x = np.zeros((t_count, candidates + 2))
    counts = np.zeros(candidates)
    mid = (t_count - 1) / 2
    for t in range(t_count):
        x[t, 0] = 1.0
        x[t, 1 : candidates + 1] = -counts
        x[t, -1] = (t - mid) ** 2
        counts[which[t]] += 1
    if np.linalg.matrix_rank(x) < x.shape[1]:
        return None
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    resid = y - x @ coef
    dof = max(t_count - x.shape[1], 1)
    cov = float(resid @ resid) / dof * np.linalg.inv(x.T @ x)
    se = np.sqrt(np.maximum(np.diag(cov), 0.0))
    return Progress(
        rates=tuple(float(v) for v in coef[1 : candidates + 1]),
        stderr=tuple(float(v) for v in se[1 : candidates + 1]),
    )


def choose_by_progress(
    costs: StepCosts,
    candidates: Sequence[Intervals],
    progress: Progress | None,
    *,
    rho: float = 0.25,
    max_interval: int = 100,
    factor: int | None = None,
    inv: int | None = None,
) -> Intervals:
    """The candidate with the most loss decrease per second, when the probe saw one.

    Time per unit of progress is ``step_time(f, i) / rate(f, i)``: the cost side alone
    (`choose_intervals`) assumes the rate flat in the intervals, which the GPT at lr 0.1
    refuted (its loss fell half as fast per step with rounds every 3 steps as every step).
    Without an informed measurement (no losses given, or progress lost in the noise) the
    cost budget decides, as before.
    """
    if progress is None or not progress.informed:
        return choose_intervals(costs, rho=rho, max_interval=max_interval, factor=factor, inv=inv)
    per_s = [
        r / max(step_time_s(costs, c), 1e-12)
        for r, c in zip(progress.rates, candidates, strict=True)
    ]
    best = max(range(len(candidates)), key=lambda k: (per_s[k], -k))
    return candidates[best]


def ladder(centre: int, *, max_interval: int, unit: int = 1) -> list[int]:
    """Inversion intervals around `centre`: ``centre / LADDER, centre, centre * LADDER``,
    multiples of `unit` (a fixed factor interval) within ``unit .. max_interval``."""
    out: list[int] = []
    for raw in (centre // LADDER, centre, centre * LADDER):
        i = max(unit, min(max_interval, raw // unit * unit))
        if i not in out:
            out.append(i)
    return out


# ---------------------------------------------------------------------------- controllers
class IntervalController(ABC):
    """Policy: which steps update the factors and which invert them.

    `KFAC` asks `plan` once per step, shows each finished step to `observe`, then calls
    `update`, which may agree numbers over the ranks (a collective, so only at steps
    every rank reaches together) and returns new intervals when the decision changes. It
    re-plans placement whenever `decided` changes. No process group, clock or model: a
    test drives a controller with synthetic steps.
    """

    @abstractmethod
    def plan(self, step: int) -> StepPlan:
        """The kinds of step `step` is (a pure function of the decisions so far)."""

    @property
    @abstractmethod
    def decided(self) -> Intervals:
        """The intervals in force outside probes (the ones placement is planned for)."""

    def observe(self, step: int, sample: StepSample) -> None:  # noqa: B027
        """Record a finished step."""

    def update(self, step: int, agree: Agree, priced: Priced) -> Intervals | None:
        """Decide after `step` if due; the new decided intervals, or None if unchanged."""
        return None

    def state_dict(self) -> dict[str, Any]:
        return {"intervals": [self.decided.factor, self.decided.inv]}

    def load_state_dict(self, state: dict[str, Any]) -> None:  # noqa: B027
        """Restore `state_dict` output."""


class FixedIntervals(IntervalController):
    """Constant intervals, or callables of the step (checked each time they are read).

    Args:
        factor: steps between factor updates.
        inv: steps between inversions.
    """

    def __init__(self, factor: IntSchedule = 1, inv: IntSchedule = 1) -> None:
        check_int("factor_interval", factor)
        check_int("inv_interval", inv)
        self.factor, self.inv = factor, inv
        self._last = self._at(0)

    def _at(self, step: int) -> Intervals:
        return Intervals(
            int(check_value("factor_interval", self.factor, step)),
            int(check_value("inv_interval", self.inv, step)),
        )

    def plan(self, step: int) -> StepPlan:
        iv = self._at(step)
        self._last = iv
        return StepPlan(factor=step % iv.factor == 0, inversion=step % iv.inv == 0, intervals=iv)

    @property
    def decided(self) -> Intervals:
        return self._last


@dataclass(frozen=True)
class _Block:
    """A stretch of a probe at one candidate's intervals, starting with an inversion."""

    start: int
    stop: int
    index: int
    intervals: Intervals


class AutoIntervals(IntervalController):
    """``"auto"`` intervals: time and progress, per phase of training.

    After `WARMUP_STEPS` steps at (1, 1), a probe runs blocks of candidate intervals in a
    palindrome (inversion intervals 1, 2, 4 the first time, then the decided one and its
    neighbours on the `LADDER`), each block starting with an inversion round and as long
    as the longest candidate's interval. It times every kind of step (the costs by
    difference of `IntervalPlanner`) and, when losses are given, fits each candidate's
    loss decrease per step (`fit_progress`). The decision takes the most progress per
    second (`choose_by_progress`), or the cost budget when progress was not measurable.
    Phases double: the next probe starts after twice the steps trained so far (at least
    twice the probe's length), and between probes a drift of the measured costs re-decides
    with the last progress measured. A fixed inversion interval leaves only the factor
    interval to the costs (one probe of `PROBE_ROUNDS` rounds, as `probe_intervals`).

    Args:
        factor: a fixed factor interval (None: chosen).
        inv: a fixed inversion interval (None: chosen).
        lazy: factors are exchanged only to be inverted (`FactorSync.LAZY`).
        rho, max_interval, drift, window: as `IntervalPlanner`.
    """

    def __init__(
        self,
        *,
        factor: int | None = None,
        inv: int | None = None,
        lazy: bool = False,
        rho: float = 0.25,
        max_interval: int = 100,
        drift: float = 2.0,
        window: int = 20,
    ) -> None:
        self.fixed_factor, self.fixed_inv, self.lazy = factor, inv, lazy
        self.planner = IntervalPlanner(rho=rho, max_interval=max_interval, drift=drift,
                                       window=window)  # fmt: skip
        self._decided = Intervals(factor or 1, inv or 1)
        self._anchor = 0
        self._blocks: list[_Block] = []
        self._candidates: list[Intervals] = []
        self._losses: dict[int, float] = {}
        self._next_probe = WARMUP_STEPS
        self._since = 0
        self.progress: Progress | None = None
        #: (step, decided intervals, progress or None) of every decision, for reports
        self.history: list[tuple[int, Intervals, Progress | None]] = []

    @property
    def decided(self) -> Intervals:
        return self._decided

    @property
    def probing(self) -> bool:
        return bool(self._blocks)

    def plan(self, step: int) -> StepPlan:
        if step < WARMUP_STEPS:
            return StepPlan(factor=True, inversion=True, intervals=Intervals(1, 1))
        iv, anchor = self._decided, self._anchor
        block = self._block(step)
        if block is not None:
            iv, anchor = block.intervals, block.start
        rel = step - anchor
        return StepPlan(factor=rel % iv.factor == 0, inversion=rel % iv.inv == 0, intervals=iv)

    def _block(self, step: int) -> _Block | None:
        for b in self._blocks:
            if b.start <= step < b.stop:
                return b
        return None

    def observe(self, step: int, sample: StepSample) -> None:
        if step < WARMUP_STEPS:
            return
        self.planner.observe(sample.total_s, factor_s=sample.factor_s,
                             inversion_s=sample.inversion_s)  # fmt: skip
        if self._block(step) is not None:
            self._losses[step] = math.nan if sample.loss is None else float(sample.loss)

    # ------------------------------------------------------------------ decisions
    def _factor_for(self, inv: int, costs: StepCosts | None) -> int:
        if self.fixed_factor is not None:
            return self.fixed_factor
        if costs is None:  # the first probe: every kind of step, before any cost is known
            return 1 if self.lazy else max(1, inv // 2)
        # the smallest divisor within the budget, else the cheapest (the inversion's part
        # of the overhead is the same for all)
        budget = self.planner.rho * costs.base_step_s
        divisors = [f for f in range(1, inv + 1) if inv % f == 0]
        return next((f for f in divisors if overhead_s(costs, f, inv) <= budget), inv)

    def _start_probe(self, step: int, costs: StepCosts | None) -> None:
        if self.fixed_inv is not None:
            iv = probe_intervals(self.fixed_factor, self.fixed_inv, lazy=self.lazy)
            self._candidates = [iv]
            self._blocks = [_Block(step, step + PROBE_ROUNDS * iv.inv, 0, iv)]
            return
        unit = self.fixed_factor or 1
        centre = FIRST_CENTRE * unit if costs is None else self._decided.inv
        invs = ladder(centre, max_interval=self.planner.max_interval,
                      unit=self.fixed_factor or 1)  # fmt: skip
        self._candidates = [Intervals(self._factor_for(i, costs), i) for i in invs]
        length = max(invs)
        order = list(range(len(invs))) + list(reversed(range(len(invs))))
        self._blocks = [
            _Block(step + j * length, step + (j + 1) * length, k, self._candidates[k])
            for j, k in enumerate(order)
        ]
        self._losses = {}

    def update(self, step: int, agree: Agree, priced: Priced) -> Intervals | None:
        nxt = step + 1
        if self._blocks:
            if nxt < self._blocks[-1].stop:
                return None
            return self._decide_after_probe(nxt, agree, priced)
        first = self.planner.decided_on is None
        if nxt >= self._next_probe and (first or self.fixed_inv is None):
            self._start_probe(nxt, None if first else self.planner.decided_on)
            return None
        self._since += 1
        if self.planner.decided_on is None or self._since < self.planner.window:
            return None
        self._since = 0
        costs = self._costs(agree, priced)
        if costs.base_step_s <= 0 or not self.planner.drifted(costs):
            return None
        logger.info("K-FAC's measured costs drifted: deciding the intervals again")
        self.planner.decided_on = costs
        return self._set(nxt, self._choose(costs, self.progress), progress=self.progress)

    def _costs(self, agree: Agree, priced: Priced) -> StepCosts:
        c = self.planner.costs(priced(self.planner.median() or 0.0))
        got = agree([c.base_step_s, c.factor_s, c.inversion_s], "max")
        return StepCosts(base_step_s=got[0], factor_s=got[1], inversion_s=got[2])

    def _choose(self, costs: StepCosts, progress: Progress | None) -> Intervals:
        return choose_by_progress(
            costs, self._candidates, progress, rho=self.planner.rho,
            max_interval=self.planner.max_interval, factor=self.fixed_factor, inv=self.fixed_inv,
        )  # fmt: skip

    def _decide_after_probe(self, nxt: int, agree: Agree, priced: Priced) -> Intervals | None:
        blocks, self._blocks = self._blocks, []
        costs = self._costs(agree, priced)
        progress = None
        if len(self._candidates) > 1:
            steps = [t for b in blocks for t in range(b.start, b.stop)]
            losses = agree([self._losses.get(t, math.nan) for t in steps], "mean")
            which = [b.index for b in blocks for _ in range(b.start, b.stop)]
            progress = fit_progress(losses, which, len(self._candidates))
            if progress is not None:
                # the probe's rates are those of its candidates' intervals, and they are
                # re-costed at each drift with the candidates they belong to
                self.progress = progress
            # re-price each candidate's factor interval now that the costs are measured
            self._candidates = [Intervals(self._factor_for(c.inv, costs), c.inv)
                                for c in self._candidates]  # fmt: skip
        self.planner.decided_on = costs
        probe_len = blocks[-1].stop - blocks[0].start
        self._next_probe = nxt + max(2 * probe_len, nxt)
        return self._set(nxt, self._choose(costs, progress), progress=progress)

    def _set(self, nxt: int, iv: Intervals, *, progress: Progress | None) -> Intervals | None:
        self.planner.decided = iv
        self._since = 0
        self._anchor = nxt
        old, self._decided = self._decided, iv
        self.history.append((nxt, iv, progress))
        c = self.planner.decided_on
        logger.info(
            "K-FAC intervals from step %d: factor=%d, inv=%d (base step %.3g s, factor update "
            "%.3g s, inversions %.3g s%s)", nxt, iv.factor, iv.inv,
            c.base_step_s if c else 0.0, c.factor_s if c else 0.0, c.inversion_s if c else 0.0,
            "" if progress is None else ", loss per step "
            + ", ".join(f"{r:.3g}" for r in progress.rates),
        )  # fmt: skip
        return iv if iv != old else None

    def state_dict(self) -> dict[str, Any]:
        return {"intervals": [self._decided.factor, self._decided.inv]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The intervals decided when saved, until a new probe (right away: the link and
        the phase of training may differ after a resume)."""
        if "intervals" in state:
            self._decided = Intervals(*map(int, state["intervals"]))
