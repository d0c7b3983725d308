"""S-SGD (`AllReduce`, DDP's averaging hook counted by plait) equals single-process training
on the whole batch."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import plait
from plait.comm import stats
from plait.testing import run_distributed

STEPS = 5
BATCH = 16


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 3)
    )


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(STEPS, BATCH, 10, generator=g), torch.randint(
        0, 3, (STEPS, BATCH), generator=g
    )


def _reference() -> list[torch.Tensor]:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    xs, ys = _data()
    for x, y in zip(xs, ys, strict=True):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _distributed(rank: int, world: int) -> tuple[list[torch.Tensor], int]:
    ddp = plait.data_parallel(_model(), "ssgd", bucket_cap_mb=0.002)  # several buckets
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    xs, ys = _data()
    shard = BATCH // world
    stats.reset()
    for x, y in zip(xs, ys, strict=True):
        opt.zero_grad()
        sl = slice(rank * shard, (rank + 1) * shard)
        nn.functional.cross_entropy(ddp(x[sl]), y[sl]).backward()
        opt.step()
    return [p.detach().clone() for p in ddp.module.parameters()], stats.calls


@pytest.mark.parametrize("world", [1, 2, 4])
def test_ssgd_matches_single_process(world: int) -> None:
    ref = _reference()
    for params, calls in run_distributed(_distributed, world_size=world):
        # fp32 sums in another order: agreement to ~1e-6 relative after 5 momentum steps
        for p, r in zip(params, ref, strict=True):
            torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-6)
        if world > 1:
            assert calls > STEPS  # more than one bucket per step
