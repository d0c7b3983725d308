"""EF-SignSGD under DDP against a single-process reference."""

from __future__ import annotations

from typing import Any

from tests.dp.compress._check import check, check_resume
from tests.dp.compress._scenario import Scenario, SignReference, per_tensor, run_reference


def test_signsgd(
    world1: list[dict[str, Any]], world2: list[dict[str, Any]], world4: list[dict[str, Any]]
) -> None:
    check(world1, "signsgd", run_reference(1, Scenario(), per_tensor(SignReference())))
    check(world2, "signsgd", run_reference(2, Scenario(), per_tensor(SignReference())))
    check(world4, "signsgd", run_reference(4, Scenario(), per_tensor(SignReference())))


def test_resume_continues_exactly(world2: list[dict[str, Any]]) -> None:
    check_resume(world2, "signsgd")
