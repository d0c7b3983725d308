from __future__ import annotations

import pytest
import torch
from torch import nn

from plait.crossover.inprocess import InterleavedModels
from plait.testing import run_distributed

STEPS, BATCH = 4, 8


def _models() -> list[nn.Module]:
    torch.manual_seed(0)
    return [
        nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3)),
        nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3)),
    ]


def _data(k: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10 + k)
    return torch.randn(STEPS, BATCH, 6, generator=g), torch.randint(
        0, 3, (STEPS, BATCH), generator=g
    )


def _reference(n_models: int) -> list[list[torch.Tensor]]:
    out = []
    for k, model in enumerate(_models()[:n_models]):
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        xs, ys = _data(k)
        for x, y in zip(xs, ys, strict=True):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        out.append([p.detach().clone() for p in model.parameters()])
    return out


def _interleaved(rank: int, world: int, n_models: int) -> list[list[torch.Tensor]]:
    models = _models()[:n_models]
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in models]
    runner = InterleavedModels(models, opts, bucket_cap_mb=0.0005)  # several buckets each
    data = [_data(k) for k in range(n_models)]
    shard = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    for s in range(STEPS):
        runner.step([(xs[s][shard], ys[s][shard]) for xs, ys in data], nn.functional.cross_entropy)
    runner.synchronize()
    return [[p.detach().clone() for p in m.parameters()] for m in models]


@pytest.mark.parametrize(("world", "n_models"), [(1, 1), (2, 2), (4, 2)])
def test_each_model_trains_as_alone(world: int, n_models: int) -> None:
    ref = _reference(n_models)
    for result in run_distributed(_interleaved, n_models, world_size=world):
        for got, want in zip(result, ref, strict=True):
            for a, b in zip(got, want, strict=True):
                # fp32 sums in another order over 4 momentum steps: 1e-5 relative
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_bad_input() -> None:
    m = _models()[0]
    with pytest.raises(ValueError, match="one optimizer per model"):
        InterleavedModels([m], [])
    with pytest.raises(ValueError, match="one optimizer per model"):
        InterleavedModels([], [])
    with pytest.raises(ValueError, match="one process group per model, got 2"):
        InterleavedModels([m], [torch.optim.SGD(m.parameters(), lr=0.1)], groups=[None, None])
    runner = InterleavedModels([m], [torch.optim.SGD(m.parameters(), lr=0.1)])
    with pytest.raises(ValueError, match="one batch per model"):
        runner.step([], nn.functional.cross_entropy)
