"""EF-SignSGD under DDP against a single-process reference."""

from __future__ import annotations

from typing import Any

import pytest
import torch

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


@pytest.mark.parametrize("n", [1, 7, 8, 9, 64, 1001])
def test_bits_pack_as_numpy_does_on_any_device(n: int) -> None:
    """torch's packing (which runs where the gradient lives, CUDA included) writes the
    bytes numpy's ``packbits`` writes, and unpacking gives the mask back."""
    import numpy as np

    from plait.dp.compress.sign import packbits, unpackbits

    mask = torch.rand(n, generator=torch.Generator().manual_seed(n)) > 0.5
    packed = packbits(mask)
    assert torch.equal(packed, torch.from_numpy(np.packbits(mask.numpy())))
    assert torch.equal(unpackbits(packed, n).bool(), mask)
