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
import statistics
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

#: The value of `KFACConfig.factor_interval` / `inv_interval` asking for this rule.
AUTO = "auto"

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
