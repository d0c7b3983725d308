"""The race protocol's constants (`plait.bench.race`), importable without torch: the
command line's parser reads them, and ``plait --help`` must not wait for torch."""

from __future__ import annotations

#: Seeds of a race by default: five, the fewest that give a bootstrap interval over seeds
#: some meaning (with three, a single seed decides a median).
DEFAULT_SEEDS = (0, 1, 2, 3, 4)
#: The fewest seeds whose interval may make a verdict: with fewer, a bootstrap over seeds
#: has too few distinct resamples to mean anything (one seed gives a zero-width interval).
MIN_VERDICT_SEEDS = 5
#: Bootstrap resamples behind every interval, and the interval's coverage. The resampling
#: generator is seeded, so the same results always give the same interval.
BOOTSTRAP_RESAMPLES = 10_000
CONFIDENCE = 0.95

#: Held-out metrics a race can target: the evaluation key and whether higher is better.
METRICS: dict[str, tuple[str, bool]] = {
    "accuracy": ("test_accuracy", True),
    "loss": ("test_loss", False),
}
