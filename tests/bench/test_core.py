"""The harness core: interleaved rounds, warm-up, summaries, CPU accounting."""

from __future__ import annotations

import time

import pytest

from plait.bench.core import Order, Stats, Stopwatch, Turn, run_rounds, schedule


def test_fixed_rounds_interleave_and_flag_the_warmup() -> None:
    turns = list(schedule(["a", "b"], rounds=2, warmup=1))
    assert [(t.round, t.contestant, t.kept) for t in turns] == [
        (0, "a", False),
        (0, "b", False),
        (1, "a", True),
        (1, "b", True),
        (2, "a", True),
        (2, "b", True),
    ]


def test_rotated_rounds_start_with_the_next_contestant() -> None:
    turns = schedule(["a", "b", "c"], rounds=4, order=Order.ROTATE)
    assert "".join(t.contestant for t in turns) == "abc" + "bca" + "cab" + "abc"


def test_run_rounds_keeps_measured_rounds_only_and_reports_every_turn() -> None:
    seen: list[tuple[int, str, float]] = []

    def measure(turn: Turn[str]) -> float:
        return 10.0 * turn.round + (1.0 if turn.contestant == "b" else 0.0)

    kept = run_rounds(
        ["a", "b"],
        measure,
        rounds=3,
        warmup=2,
        after_turn=lambda t, r: seen.append((t.round, t.contestant, r)),
    )
    assert kept == {"a": [20.0, 30.0, 40.0], "b": [21.0, 31.0, 41.0]}
    assert len(seen) == 10 and seen[0] == (0, "a", 0.0)


def test_bad_rounds() -> None:
    with pytest.raises(ValueError, match="distinct"):
        list(schedule(["a", "a"], rounds=1))
    with pytest.raises(ValueError, match=">= 0"):
        list(schedule(["a"], rounds=-1))


def test_stats_are_median_min_max_mean_and_spread() -> None:
    s = Stats.of([0.3, 0.1, 0.2, 0.6])
    assert s.median == pytest.approx(0.25) and (s.min, s.max, s.n) == (0.1, 0.6, 4)
    assert s.mean == pytest.approx(0.3)
    assert s.spread == pytest.approx(0.5 / 0.25)
    with pytest.raises(ValueError, match="no measurements"):
        Stats.of([])


def test_stopwatch_counts_wall_time_and_this_process_cpu() -> None:
    with Stopwatch() as idle:
        time.sleep(0.05)
    with Stopwatch() as busy:
        end = time.perf_counter() + 0.05
        while time.perf_counter() < end:
            pass
    assert idle.wall_s >= 0.05 and idle.cpu_s < idle.wall_s / 2  # sleeping costs no CPU
    # spinning costs about its wall time (less when the machine steals the core)
    assert busy.wall_s >= 0.05 and busy.cpu_s > 0.01
