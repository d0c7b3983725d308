"""``torchft-diloco``: torchft's own DiLoCo driven by plait, at world size 2.

- The strategy registers without torchft and then refuses with the extra to install;
  bad options fail at construction, before anything starts.
- Two rounds of H = 4: the ranks hold identical parameters after each synchronisation,
  evaluation sees that shared copy in the middle of a round, and the loss falls.
- Against plait's own ``diloco`` with the same H, outer lr and Nesterov momentum, inner
  optimizer, initial weights and data: the two implement the same algorithm (see
  `test_torchft_and_plait_diloco_agree`).
- A run saved in the middle of a round, with a fragment's all-reduce in flight, resumes
  to the parameters of the uninterrupted run.
- A peer lost in the middle of a round stops the survivor within the timeout.
- ``plait race`` on two nodes runs it beside ``diloco`` in one job.
"""

from __future__ import annotations

import importlib.util
import itertools
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from plait.testing import Outcome, run_distributed, run_faulty

needs_torchft = pytest.mark.skipif(
    importlib.util.find_spec("torchft") is None, reason="torchft (the bench extra) is missing"
)

BATCH = 8  # per rank
LR = 0.1
H = 4


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(BATCH, 6, generator=g)
    return x, (x[:, 0] > 0).long() + (x[:, 1] > 0).long()  # learnable: the loss must fall


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _build(spec: str, rank: int, opt: str = "sgd") -> tuple[Any, nn.Module, torch.optim.Optimizer]:
    from plait.train.strategy import make_strategy

    strategy = make_strategy(spec)
    model = _model()
    if rank == 1:  # a different start on rank 1: both strategies must begin from rank 0's
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
    model = strategy.wrap(model)
    optimizer = (
        torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
        if opt == "sgd"
        else torch.optim.AdamW(model.parameters(), lr=0.01)
    )
    strategy.attach_optimizer(optimizer)
    return strategy, model, optimizer


def _step(model: nn.Module, opt: torch.optim.Optimizer, rank: int, step: int) -> float:
    x, y = _batch(rank, step)
    opt.zero_grad(set_to_none=True)
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    return float(loss.detach())


def _train(spec: str, rank: int, steps: int) -> dict[str, Any]:
    """`steps` steps; the parameters after every step and the shared copy at step 6."""
    strategy, model, opt = _build(spec, rank)
    params, losses, shared = [], [], None
    try:
        for step in range(steps):
            losses.append(_step(model, opt, rank, step))
            params.append(_flat(model))
            if step + 1 == H + 2:
                with strategy.eval_context(model):
                    shared = _flat(model)
                assert torch.equal(_flat(model), params[-1]), "evaluation changed the model"
    finally:
        strategy.close()
    return {"params": params, "losses": losses, "shared": shared}


def _resume(rank: int) -> dict[str, torch.Tensor]:
    """9 steps straight, and 5 steps + save + a fresh strategy + load + 4 steps, with
    fragments synchronised on a stagger and an all-reduce in flight at the save."""
    spec = f"torchft-diloco:sync_every={H},fragments=2,fragment_sync_delay=1"

    strategy, model, opt = _build(spec, rank, opt="adamw")
    for step in range(9):
        _step(model, opt, rank, step)
    straight = _flat(model)
    strategy.close()

    strategy, model, opt = _build(spec, rank, opt="adamw")
    for step in range(5):  # fragment 0's all-reduce starts after step 5, lands after 6
        _step(model, opt, rank, step)
    saved = strategy.state_dict()
    assert saved["in_flight"], "an all-reduce must be in flight when the state is saved"
    strategy.close()
    strategy, model, opt = _build(spec, rank, opt="adamw")
    strategy.load_state_dict(saved)
    for step in range(5, 9):
        _step(model, opt, rank, step)
    resumed = _flat(model)
    strategy.close()
    return {"straight": straight, "resumed": resumed}


def _job(rank: int, world: int) -> dict[str, Any]:
    steps = 2 * H
    return {
        "torchft": _train(f"torchft-diloco:sync_every={H}", rank, steps),
        "plait": _train(f"diloco:inner_steps={H}", rank, steps),
        "resume": _resume(rank),
    }


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return run_distributed(_job, world_size=2, timeout_s=120)


# --------------------------------------------------------------------- options
def test_registered_without_torchft_and_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    from plait.train import strategy as registry
    from plait.train.strategies import torchft_diloco

    real = importlib.util.find_spec
    monkeypatch.setattr(
        torchft_diloco.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "torchft" else real(name, *a),
    )
    assert "torchft-diloco" in registry.available_strategies()
    with pytest.raises(ValueError, match=r"plait\[bench\]"):
        registry.make_strategy("torchft-diloco:sync_every=4")


@needs_torchft
@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("torchft-diloco:sync_every=6,fragments=4", "multiple of fragments"),
        ("torchft-diloco:sync_every=4,fragments=2,fragment_sync_delay=2", "below sync_every"),
        ("torchft-diloco:outer_momentum=1", "outer_momentum"),
        ("torchft-diloco:fragment_update_alpha=1.5", "fragment_update_alpha"),
        ("torchft-diloco:sync_evry=4", "unknown option 'sync_evry'"),
        ("torchft-diloco:timeout_s=0", "timeout_s"),
    ],
)
def test_bad_options_fail_at_construction(spec: str, match: str) -> None:
    from plait.train.strategy import make_strategy

    with pytest.raises(ValueError, match=match):
        make_strategy(spec)


@needs_torchft
@pytest.mark.skipif(torch.cuda.is_available(), reason="quantisation is refused on CPU only")
def test_quantisation_is_refused_where_torchft_would_send_fp32() -> None:
    from plait.train.strategy import make_strategy

    with pytest.raises(ValueError, match="Triton"):
        make_strategy("torchft-diloco:should_quantize=true")


@needs_torchft
def test_more_fragments_than_units_fail_before_launch() -> None:
    from plait.train.strategy import make_strategy

    with pytest.raises(ValueError, match="fewer than fragments=4"):
        make_strategy("torchft-diloco:sync_every=4,fragments=4").check(_model(), world=2)


# ------------------------------------------------------------------- training
@needs_torchft
def test_ranks_agree_after_every_sync_and_the_loss_falls(ranks: list[dict[str, Any]]) -> None:
    a, b = (r["torchft"] for r in ranks)
    for step in (H - 1, 2 * H - 1):  # after each round's outer step
        assert torch.equal(a["params"][step], b["params"][step]), step
    assert not torch.equal(a["params"][H], b["params"][H])  # local steps differ between
    # evaluation in the middle of round 2 sees the copy agreed at the end of round 1
    assert torch.equal(a["shared"], b["shared"])
    assert torch.equal(a["shared"], a["params"][H - 1])
    for r in (a, b):
        assert sum(r["losses"][-2:]) < sum(r["losses"][:2]), r["losses"]


@needs_torchft
def test_torchft_and_plait_diloco_agree(ranks: list[dict[str, Any]]) -> None:
    """fragments = 1, no quantisation: the same algorithm, to the bit.

    Both start from rank 0's weights (plait broadcasts them for torchft too, whose own
    start-up sync is off), run the same inner steps, and take the outer step with
    torch's own SGD (lr 0.7, Nesterov momentum 0.9) on the mean pseudo-gradient,
    parameters at the round's start minus now. The means are computed differently:
    torchft sums per parameter and divides by the participants, plait halves a flat
    buffer and sums; with two ranks both are exact in binary floating point (halving is
    exact, and a + b = b + a is rounded once either way), so no tolerance is needed. With
    more ranks gloo's ring adds the ranks' values in an order that depends on where a
    value sits in the buffer, which differs between plait's one buffer and torchft's
    tensor per parameter: float32 rounding (on 4 emulated nodes, 40 steps of the mlp
    race: the same accuracies, test losses within 1e-6 relative).
    """
    for r in ranks:
        for step in range(2 * H):
            assert torch.equal(r["torchft"]["params"][step], r["plait"]["params"][step]), step
        assert torch.equal(r["torchft"]["shared"], r["plait"]["shared"])


@needs_torchft
def test_resume_in_the_middle_of_a_round_is_exact(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        assert torch.equal(r["resume"]["straight"], r["resume"]["resumed"])
    assert not torch.equal(ranks[0]["resume"]["resumed"], ranks[1]["resume"]["resumed"])


TIMEOUT_S = 6.0
SLACK_S = 20.0


def _lost(rank: int, world: int) -> int:
    strategy, model, opt = _build(f"torchft-diloco:sync_every={H},timeout_s={TIMEOUT_S}", rank)
    try:
        for step in range(3 * H):
            if rank == 1 and step == H + 1:  # after one round, in the middle of the next
                os._exit(17)
            _step(model, opt, rank, step)
    finally:
        strategy.close()
    return 3 * H


@needs_torchft
def test_a_lost_peer_stops_the_survivor() -> None:
    # a generous grace: on a loaded host spawning and importing take most of the default
    outcomes: list[Outcome] = run_faulty(_lost, collective_timeout_s=TIMEOUT_S, grace_s=120)
    survivor, victim = outcomes
    assert victim.status == "died", victim
    assert survivor.status == "raised", survivor
    assert "CollectiveError: torchft's quorum did not form on rank 0" in survivor.message, (
        survivor.error
    )
    assert survivor.elapsed_s is not None and survivor.elapsed_s < TIMEOUT_S + SLACK_S


# ------------------------------------------------------------------ the race
@needs_torchft
def test_race_beside_plait_diloco_on_two_nodes(tmp_path: Path) -> None:
    """One seed, 24 steps on the mlp workload, both at H = 4: torchft's entry runs in the
    race job, its all-reduces are counted, and as the same algorithm as plait's (see
    `test_torchft_and_plait_diloco_agree`) it follows the same learning curve."""
    from plait.bench.race import Entry, RaceSpec, run_race

    spec = RaceSpec(
        workload="mlp",
        target=0.5,
        seeds=[0],
        max_steps=24,
        eval_every=4,
        chunk=6,
        batch_size=16,
        entries=[
            Entry(spec="diloco:inner_steps=4", optimizer="sgd", lr=0.1),
            Entry(spec="torchft-diloco:sync_every=4", optimizer="sgd", lr=0.1),
        ],
    )
    plait_run, ft_run = (
        r.runs[0] for r in run_race(spec, nodes=2, out=tmp_path, timeout_s=300, progress=False)
    )
    assert ft_run.bytes_per_worker > 0
    assert ft_run.bytes_per_worker == plait_run.bytes_per_worker  # one fp32 model per round
    assert [p.step for p in ft_run.curve] == [p.step for p in plait_run.curve]
    for a, b in itertools.zip_longest(ft_run.curve, plait_run.curve):
        assert a.metric == b.metric and a.test_loss == b.test_loss, (a, b)
    assert (tmp_path / "results.md").exists()
