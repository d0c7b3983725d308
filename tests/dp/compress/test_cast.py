"""fp16 and bf16 gradient casts under DDP against single-process references."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.dp.compress._check import check
from tests.dp.compress._scenario import Scenario, cast_mean, per_tensor, run_reference


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cast(world2: list[dict[str, Any]], dtype: torch.dtype) -> None:
    key = "fp16" if dtype is torch.float16 else "bf16"
    check(world2, key, run_reference(2, Scenario(), per_tensor(cast_mean(dtype))))


def test_cast_world_1(world1: list[dict[str, Any]]) -> None:
    check(world1, "fp16", run_reference(1, Scenario(), per_tensor(cast_mean(torch.float16))))
