"""`LocalUpdate` (DiLoCo): against single-process references, by hand, across a resume,
and with a lost peer.

- With H = 1 and an outer SGD at lr 1 it is synchronous data parallelism: equal to one
  process training stock SGD on the concatenated batch (with and without momentum).
- Two rounds of H = 3 match the outer Nesterov step computed by hand from two stock
  single-process inner runs.
- A run saved in the middle of a round, with a fragment's exchange in flight, resumes to
  the same parameters as the uninterrupted run, bit for bit.
- The optimizer is found without `attach`, also when one optimizer steps two inner ones.
- A peer lost in the middle of a round makes the survivor raise a CollectiveError naming it.
"""

from __future__ import annotations

import copy
import os
import time
from typing import Any

import pytest
import torch
from torch import nn

from plait.testing import Outcome, run_distributed, run_faulty

BATCH = 8  # per rank
LR = 0.1


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(BATCH, 6, generator=g), torch.randint(0, 3, (BATCH,), generator=g)


def _step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> None:
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _train_local(
    rank: int, steps: int, spec: str, *, momentum: float = 0.0, **options: Any
) -> torch.Tensor:
    import plait

    model = plait.data_parallel(_model(), spec, **options)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=momentum)
    for step in range(steps):
        _step(model, opt, *_batch(rank, step))
    model.close()
    return _flat(model)


def _nested(rank: int) -> tuple[int, int]:
    """An optimizer holding two inner ones (as plait's Muon + AdamW does): the wrapper
    must count one step per iteration, on the outer optimizer's step."""
    import plait

    class Pair(torch.optim.Optimizer):
        def __init__(self, params: list[nn.Parameter]) -> None:
            self.a = torch.optim.SGD(params[:2], lr=LR)
            self.b = torch.optim.SGD(params[2:], lr=LR)
            super().__init__(params, {"lr": LR})

        def step(self, closure: Any = None) -> None:  # type: ignore[override]
            self.a.step()
            self.b.step()

    model = plait.data_parallel(_model(), "diloco", inner_steps=2)
    opt = Pair(list(model.parameters()))
    for step in range(5):
        _step(model, opt, *_batch(rank, step))
    model.close()
    return model.steps, 5


def _resume(rank: int, world: int) -> dict[str, torch.Tensor]:
    """9 steps straight, and 6 steps + save + a fresh wrapper + load + 3 steps."""
    import plait

    spec = "diloco:inner_steps=4,fragments=2,delay=1,compression=int4,block=8"

    def build() -> tuple[nn.Module, torch.optim.Optimizer]:
        model = plait.data_parallel(_model(), spec)
        return model, torch.optim.AdamW(model.parameters(), lr=0.01)

    model, opt = build()
    for step in range(9):
        _step(model, opt, *_batch(rank, step))
    straight = _flat(model)
    model.close()

    model, opt = build()
    for step in range(6):  # fragment 0's exchange starts after step 6, lands after step 7
        _step(model, opt, *_batch(rank, step))
    assert model._pending, "an exchange must be in flight when the state is saved"
    # a copy, as torch.save makes: state_dict() hands out the live parameters
    saved = copy.deepcopy((model.state_dict(), opt.state_dict()))
    model.close()
    model, opt = build()
    model.load_state_dict(saved[0])
    opt.load_state_dict(saved[1])
    for step in range(6, 9):
        _step(model, opt, *_batch(rank, step))
    resumed = _flat(model)
    model.close()
    return {"straight": straight, "resumed": resumed}


def _job(rank: int, world: int) -> dict[str, Any]:
    return {
        "sgd": _train_local(rank, 4, "localsgd", inner_steps=1),
        # outer momentum over plain inner SGD is SGD with momentum on the averaged gradient
        "momentum": _train_local(
            rank, 4, "diloco", inner_steps=1, outer_optimizer="sgd", outer_lr=1.0
        ),
        "nesterov": _train_local(rank, 6, "diloco", inner_steps=3),
        "nested": _nested(rank),
        "resume": _resume(rank, world),
    }


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return run_distributed(_job, world_size=2, timeout_s=180)


def _reference_sgd(steps: int, momentum: float) -> torch.Tensor:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=momentum)
    for step in range(steps):
        xs, ys = zip(*(_batch(r, step) for r in range(2)), strict=True)
        _step(model, opt, torch.cat(xs), torch.cat(ys))
    return _flat(model)


def test_one_inner_step_is_synchronous_sgd(ranks: list[dict[str, Any]]) -> None:
    """H = 1, outer SGD lr 1: S-SGD. The reference is one process on the concatenated
    batch, whose mean loss's gradient is the mean of the ranks' (float32 sums in another
    order: 1e-6)."""
    assert torch.equal(ranks[0]["sgd"], ranks[1]["sgd"])
    torch.testing.assert_close(ranks[0]["sgd"], _reference_sgd(4, 0.0), atol=1e-6, rtol=0)
    # the outer momentum (0.9, DiLoCo's) on lr-scaled pseudo-gradients is stock momentum
    torch.testing.assert_close(ranks[0]["momentum"], _reference_sgd(4, 0.9), atol=1e-6, rtol=0)


def test_outer_nesterov_step_matches_the_hand_computed_one(ranks: list[dict[str, Any]]) -> None:
    """Two rounds of H = 3: each rank's inner run is stock single-process SGD from the
    round's shared start; the outer step is Nesterov SGD written out (lr 0.7, momentum
    0.9, torch's form: buf = mu buf + d; theta -= lr (d + mu buf))."""
    shared = _flat(_model())
    buf = torch.zeros_like(shared)
    for rnd in range(2):
        deltas = []
        for rank in range(2):
            model = _model()
            nn.utils.vector_to_parameters(shared.clone(), model.parameters())
            opt = torch.optim.SGD(model.parameters(), lr=LR)
            for step in range(3 * rnd, 3 * rnd + 3):
                _step(model, opt, *_batch(rank, step))
            deltas.append(shared - _flat(model))
        d = (deltas[0] + deltas[1]) / 2
        buf = 0.9 * buf + d
        shared = shared - 0.7 * (d + 0.9 * buf)
    assert torch.equal(ranks[0]["nesterov"], ranks[1]["nesterov"])
    torch.testing.assert_close(ranks[0]["nesterov"], shared, atol=1e-6, rtol=0)


def test_the_optimizer_is_found_and_stepped_once_per_iteration(
    ranks: list[dict[str, Any]],
) -> None:
    for r in ranks:
        counted, taken = r["nested"]
        assert counted == taken


def test_resume_in_the_middle_of_a_round_is_exact(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        assert torch.equal(r["resume"]["straight"], r["resume"]["resumed"])
    # the ranks differ between exchanges (their local steps), so the check is per rank
    assert not torch.equal(ranks[0]["resume"]["resumed"], ranks[1]["resume"]["resumed"])


TIMEOUT_S = 6.0
SLACK_S = 20.0


def _lost(rank: int, world: int, delay: int) -> int:
    import plait

    model = plait.data_parallel(_model(), "diloco", inner_steps=4, fragments=2, delay=delay)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(12):
        if rank == world - 1 and step == 5:  # after one exchange, in the middle of a round
            os._exit(17)
        _step(model, opt, *_batch(rank, step))
        time.sleep(0.02)
    return 12


@pytest.mark.parametrize("delay", [0, 1])
def test_a_lost_peer_stops_the_survivor(delay: int) -> None:
    outcomes: list[Outcome] = run_faulty(_lost, delay, collective_timeout_s=TIMEOUT_S)
    victim, survivor = outcomes[1], outcomes[0]
    assert victim.status == "died", victim
    assert survivor.status == "raised", survivor
    assert "CollectiveError" in survivor.message, survivor.error
    assert "peer rank 1" in survivor.message, survivor.message
    assert survivor.elapsed_s is not None and survivor.elapsed_s < TIMEOUT_S + SLACK_S
