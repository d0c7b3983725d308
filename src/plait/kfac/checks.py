"""Checks of hyper-parameter values: constants when a config is built, callables of the
step each time they are read (so a schedule that goes out of range fails at that step)."""

from __future__ import annotations

from typing import Any


def check_float(
    name: str, value: Any, *, low: float, high: float | None = None, low_open: bool = False
) -> None:
    if callable(value):
        return
    v = float(value)
    bad = v < low or (low_open and v <= low) or (high is not None and v >= high)
    if bad:
        rng = f"{'>' if low_open else '>='} {low}" + (f" and < {high}" if high is not None else "")
        raise ValueError(f"{name} must be {rng}, got {value}")


def check_int(name: str, value: Any) -> None:
    if callable(value):
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


def check_value(name: str, schedule: Any, step: int, **check: Any) -> Any:
    """A hyper-parameter at `step`, validated when it comes from a callable."""
    if not callable(schedule):
        return schedule
    v = schedule(step)
    if name.endswith("interval"):
        check_int(name, v)
    else:
        check_float(name, v, **check)
    return v
