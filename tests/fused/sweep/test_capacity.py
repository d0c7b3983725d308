"""The largest array that fits: doubling then bisection, and the CPU memory probe."""

from __future__ import annotations

import pytest
import torch

import plait
from plait.fused import FusedAdam
from plait.fused.sweep import largest_fitting, step_memory
from plait.models.small import DigitsCNN


@pytest.mark.parametrize("threshold", [1, 2, 3, 5, 8, 13, 31, 32, 33, 64, 100])
def test_finds_the_largest_fitting_size(threshold: int) -> None:
    probes: list[int] = []

    def fits(n: int) -> bool:
        probes.append(n)
        return n <= threshold

    limit = 64
    assert largest_fitting(fits, limit=limit) == min(threshold, limit)
    assert len(probes) <= 2 * limit.bit_length() + 1  # logarithmic, not linear
    assert probes[:3] == [1, 2, 4][: len(probes[:3])]  # doubling first


def test_nothing_fits() -> None:
    with pytest.raises(ValueError, match="not even one model fits"):
        largest_fitting(lambda n: False, limit=8)


def test_step_memory_grows_with_the_array() -> None:
    def measure(n: int) -> int:
        array = plait.fuse(lambda: DigitsCNN(width=4), n=n)
        opt = FusedAdam(array.parameters(), lr=1e-3)
        x, y = torch.randn(n, 16, 1, 8, 8), torch.randint(0, 10, (16,))

        def step() -> None:
            plait.fused.cross_entropy(array(x), y).sum().backward()
            opt.step()

        def state() -> list[torch.Tensor]:
            return [
                t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)
            ]

        return step_memory(step, params=list(array.parameters()), state=state)

    small, large = measure(2), measure(8)
    assert small > 0
    assert 3.0 < large / small < 5.0  # about linear in the number of models


def test_step_memory_of_a_captured_array_measured_at_its_first_step() -> None:
    """The first call of a captured array exports the model inside the measured step;
    export's fake tensors pass the saved-tensor hooks too and hold no memory."""
    from plait.fused.capture import CapturedArray, clear_cache

    class Gated(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x) * torch.sigmoid(x)

    clear_cache()
    array = CapturedArray([Gated() for _ in range(2)])
    x = torch.randn(2, 4, 8)

    def step() -> None:
        array(x).sum().backward()

    params = list(array.parameters())
    assert step_memory(step, params=params, state=list) > 0
