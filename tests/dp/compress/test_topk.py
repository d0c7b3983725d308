"""Top-k sparsification under DDP against a single-process reference."""

from __future__ import annotations

from typing import Any

import pytest

from plait.dp.compress import TopK
from tests.dp.compress._check import check, check_resume
from tests.dp.compress._scenario import Scenario, TopKReference, run_reference


def test_topk(world1: list[dict[str, Any]], world2: list[dict[str, Any]]) -> None:
    check(world1, "topk", run_reference(1, Scenario(), TopKReference(ratio=0.2)))
    check(world2, "topk", run_reference(2, Scenario(), TopKReference(ratio=0.2)))


def test_resume_continues_exactly(world2: list[dict[str, Any]]) -> None:
    check_resume(world2, "topk")


def test_bad_options() -> None:
    with pytest.raises(ValueError, match="ratio must be > 0"):
        TopK(ratio=0)
    with pytest.raises(ValueError, match="ratio must be <= 1"):
        TopK(ratio=1.5)
