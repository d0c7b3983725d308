"""Choosing K-FAC's factor and inversion intervals from measured costs (``"auto"``).

K-FAC's extra work per step is the factor update (computing the factors in the layer hooks
and, under eager sync, their all-reduce, every `f` steps) and the inversion round (every `i`
steps: the decompositions, the broadcasts of their results and, under lazy sync, the
all-reduce of the running factors). Amortised over the steps that reuse them, the overhead
per step is

    overhead(f, i) = factor_s / f + inversion_s / i

The three costs are measured on the live run (`plait.kfac.KFAC` times each part of its
steps; `IntervalPlanner` keeps their medians), the same on every rank once agreed.

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

#: Steps at intervals (1, 1) before the first decision, which takes the medians of their
#: measurements: step 0's inversions pay one-time costs (on a 6-8-3 MLP, several times a
#: later round's), and deciding on step 0 alone chose inv=2 where later rounds give 1.
FIRST_DECISION_STEPS = 3


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
    _seen: list[float] = field(default_factory=list)
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
        self._seen.clear()
        logger.info(
            "K-FAC intervals: factor=%d, inv=%d (base step %.3g s, factor update %.3g s, "
            "inversions %.3g s, budget %.0f%%)",
            self.decided.factor, self.decided.inv, costs.base_step_s, costs.factor_s,
            costs.inversion_s, 100 * self.rho,
        )  # fmt: skip
        return self.decided

    def observe(
        self,
        base_step_s: float,
        *,
        factor_s: float | None = None,
        inversion_s: float | None = None,
    ) -> None:
        """Record one step's measured parts (each window keeps its latest `window`): the
        base step always, the factor update and the inversions on the steps that had them."""
        for seen, value in (
            (self._seen, base_step_s),
            (self._factor, factor_s),
            (self._inversion, inversion_s),
        ):
            if value is not None:
                seen.append(value)
                del seen[: -self.window]

    def costs(self, priced: StepCosts) -> StepCosts:
        """The median measured costs; a part not measured yet takes its `priced` value."""
        return StepCosts(
            base_step_s=statistics.median(self._seen) if self._seen else priced.base_step_s,
            factor_s=statistics.median(self._factor) if self._factor else priced.factor_s,
            inversion_s=(
                statistics.median(self._inversion) if self._inversion else priced.inversion_s
            ),
        )

    def window_full(self) -> bool:
        return len(self._seen) >= self.window

    def median(self) -> float | None:
        """The median base step of the window (None while it is empty)."""
        return statistics.median(self._seen) if self._seen else None

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
