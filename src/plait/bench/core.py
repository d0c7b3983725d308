"""The harness core every benchmark suite measures with.

A benchmark compares *contestants* (strategies, a strategy at a thread count, a way of
co-locating jobs) on a machine that other work shares. Measuring them one after another
lets a slow drift of that machine (another job starting, the CPU clocking down) land on
one contestant and read as its cost, so every suite runs them in interleaved rounds: a
round gives every contestant one turn, A B C, A B C, ... (or rotated, A B C, B C A, ...,
so that no contestant always follows the same one). The first `warmup` rounds run but are
not kept: allocators, caches and lazily built state settle there.

A turn's figures are summarised by median, min and max over the kept rounds (`Stats`):
the median is robust to the odd interrupted turn, and min-max is the spread that a ratio
of two contestants must clear to mean anything.

CPU accounting has two sides. `Stopwatch` measures a turn's wall time and the CPU time of
this process (every thread: autograd, the collective library's threads, the kernel's
network path charged to them), which on a shared machine measures the work itself; the
host's busy share over a window (co-located jobs, which run in other processes) comes
from `plait.cpu.CpuSampler`, re-exported here.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Generic, TypeVar

from plait.cpu import CpuSampler

__all__ = [
    "CpuSampler",
    "Order",
    "Stats",
    "Stopwatch",
    "Turn",
    "run_rounds",
    "schedule",
]

K = TypeVar("K", bound=Hashable)
R = TypeVar("R")


@dataclass(frozen=True)
class Stats:
    """Median, min, max and mean of one figure over the kept rounds."""

    median: float
    min: float
    max: float
    mean: float
    n: int

    @classmethod
    def of(cls, values: Sequence[float]) -> Stats:
        """The summary of `values` (at least one)."""
        if not values:
            raise ValueError("no measurements to summarise (every round was warm-up?)")
        return cls(
            median=statistics.median(values),
            min=min(values),
            max=max(values),
            mean=statistics.mean(values),
            n=len(values),
        )

    @property
    def spread(self) -> float:
        """(max - min) / median: how far apart the rounds were, relative to the figure;
        a ratio of two contestants closer to 1 than this is within the noise."""
        return (self.max - self.min) / self.median if self.median else 0.0


class Stopwatch:
    """Wall-clock and process CPU seconds of the block it wraps.

    ``with Stopwatch() as sw: step()`` leaves ``sw.wall_s`` and ``sw.cpu_s``. The CPU time
    is the whole process's (user + system, all threads), the measure of work that other
    load on the machine does not inflate.
    """

    def __init__(self) -> None:
        self.wall_s = 0.0
        self.cpu_s = 0.0
        self._t0 = 0.0
        self._c0 = 0.0

    def __enter__(self) -> Stopwatch:
        self._c0 = time.process_time()
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall_s = time.perf_counter() - self._t0
        self.cpu_s = time.process_time() - self._c0


class Order(StrEnum):
    """The order of the contestants within a round."""

    FIXED = "fixed"  # A B C, A B C, ...
    ROTATE = "rotate"  # A B C, B C A, C A B, ...: nobody always goes first


@dataclass(frozen=True)
class Turn(Generic[K]):
    """One contestant's turn: the round (counting warm-up rounds from 0), and whether the
    round is kept (past the warm-up)."""

    round: int
    contestant: K
    kept: bool


def schedule(
    contestants: Sequence[K], *, rounds: int, warmup: int = 0, order: Order = Order.FIXED
) -> Iterator[Turn[K]]:
    """The turns of `warmup` discarded rounds then `rounds` kept ones, in `order`."""
    if rounds < 0 or warmup < 0:
        raise ValueError(f"rounds and warmup must be >= 0, got {rounds}, {warmup}")
    if len(set(contestants)) != len(contestants):
        raise ValueError(f"contestants must be distinct, got {list(contestants)}")
    n = len(contestants)
    for rnd in range(warmup + rounds):
        shift = rnd % n if order is Order.ROTATE and n else 0
        for c in [*contestants[shift:], *contestants[:shift]]:
            yield Turn(round=rnd, contestant=c, kept=rnd >= warmup)


def run_rounds(
    contestants: Sequence[K],
    measure: Callable[[Turn[K]], R],
    *,
    rounds: int,
    warmup: int = 0,
    order: Order = Order.FIXED,
    after_turn: Callable[[Turn[K], R], None] | None = None,
) -> dict[K, list[R]]:
    """Run every turn of `schedule` through `measure`; return each contestant's kept
    results in round order (warm-up turns run, and reach `after_turn`, but are dropped).

    `measure` gets the whole `Turn`, so a suite can vary inputs by round or skip
    bookkeeping in warm-up; `after_turn` sees every result (a progress bar, a log line).
    """
    kept: dict[K, list[R]] = {c: [] for c in contestants}
    for turn in schedule(contestants, rounds=rounds, warmup=warmup, order=order):
        result = measure(turn)
        if turn.kept:
            kept[turn.contestant].append(result)
        if after_turn is not None:
            after_turn(turn, result)
    return kept
