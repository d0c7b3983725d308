"""`KFACCosts`: given, saved, loaded or measured, and the decisions made from them.

Every test here runs without a process group: costs handed in by hand replace the network
probe and the timed decomposition, so placement and fusion decisions are pure functions.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from plait.comm.cost import AlphaBeta
from plait.kfac import KFAC, KFACConfig, KFACCosts
from plait.kfac import costs as costs_module
from plait.kfac.placement import LOCAL, Distribution, PlacementPolicy, plan_placement

#: One core's rough prices: seconds per n^3 of a Cholesky, and per matmul flop.
INVERSE_S, FLOP_S = 2e-11, 2e-11


def _costs(rate_bps: float, *, alpha: float = 1e-4) -> KFACCosts:
    return KFACCosts(
        link=AlphaBeta(alpha=alpha, beta=8 / rate_bps), inverse_s_per_n3=INVERSE_S, flop_s=FLOP_S
    )


def _cnn() -> nn.Module:
    """Factor sides from 28 to 1153: what decides local inversion is the spread."""
    return nn.Sequential(
        nn.Conv2d(3, 64, 3, padding=1),  # A 28, G 64
        nn.ReLU(),
        nn.Conv2d(64, 128, 3, padding=1),  # A 577, G 128
        nn.ReLU(),
        nn.Conv2d(128, 256, 3, padding=1),  # A 1153, G 256
        nn.Flatten(),
        nn.LazyLinear(10),
    )


def test_save_and_load_round_trip(tmp_path: Path) -> None:
    costs = _costs(1e9)
    path = tmp_path / "costs.json"
    costs.save(path)
    loaded = KFACCosts.load(path)
    assert loaded.link == costs.link and loaded.flop_s == costs.flop_s
    assert loaded.inverse_s_per_n3 == costs.inverse_s_per_n3
    assert loaded.source == str(path)


@pytest.mark.parametrize(
    ("data", "match"),
    [
        ({"inverse_s_per_n3": 1e-11, "flop_s": 1e-11}, "link"),
        ({"link": {"alpha": 0, "beta": 0}, "flop_s": 1e-11}, "inverse_s_per_n3"),
        ({"link": {"alpha": 0}, "inverse_s_per_n3": 1, "flop_s": 1}, "malformed"),
        ({"link": {"alpha": 0, "beta": 0}, "inverse_s_per_n3": 0, "flop_s": 1}, "> 0"),
    ],
)
def test_bad_costs_are_value_errors(data: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        KFACCosts.from_dict(data)


def test_a_file_that_is_not_costs_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "costs.json"
    path.write_text("[1, 2]")
    with pytest.raises(ValueError, match="not a K-FAC costs file"):
        KFACCosts.load(path)


def test_measure_on_one_process_times_compute_and_assumes_the_link() -> None:
    costs = KFACCosts.measure()
    assert costs.inverse_s_per_n3 > 0 and costs.flop_s > 0
    assert costs.link == costs_module.DEFAULT_LINK


def test_given_costs_build_kfac_without_timing_anything(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_timing(*_: object) -> tuple[float, float]:
        raise AssertionError("KFAC measured although costs were given")

    monkeypatch.setattr(costs_module, "_time_compute", no_timing)
    costs = _costs(1e9)
    kfac = KFAC(nn.Sequential(nn.Linear(4, 3)), KFACConfig(), costs=costs)
    assert kfac.costs is costs and kfac.pipeline.cost == costs.link
    with pytest.raises(ValueError, match="KFACCosts"):
        KFAC(nn.Sequential(nn.Linear(4, 3)), costs=costs.to_dict())  # type: ignore[arg-type]


def _placement(costs: KFACCosts, **kw: object) -> tuple[Distribution, dict[str, int]]:
    """Register the CNN in one process, then place its layers on four workers."""
    model = _cnn()
    model(torch.zeros(1, 3, 4, 4))  # materialise the lazy layer
    kfac = KFAC(model, KFACConfig(), costs=costs)
    args: dict[str, object] = {
        "method": KFACConfig().method,
        "packed": True,
        "policy": PlacementPolicy.LPT,
        "distribution": Distribution.COMM_OPT,
    } | kw
    p = plan_placement(list(kfac.layers.values()), world=4, costs=costs, **args)  # type: ignore[arg-type]
    return p.distribution, p.assignment.inv_rank


def test_placement_follows_the_given_link() -> None:
    """On a 1 Gbit/s link with 1 ms latency a small factor is inverted by every worker
    rather than broadcast; on a free link nothing is worth four copies of an inversion."""
    _, slow = _placement(_costs(1e9, alpha=1e-3))
    _, fast = _placement(_costs(float("inf"), alpha=0.0))
    assert slow["0/A"] == LOCAL  # 28 wide: 4 x 28^3 x 2e-11 s << one broadcast
    assert slow["4/A"] != LOCAL  # 1153 wide: 4 inversions cost more than a broadcast
    assert LOCAL not in fast.values()


def test_auto_distribution_follows_the_given_link() -> None:
    """The same model and compute, two networks: the decision is the costs' alone."""
    fast, _ = _placement(_costs(100e9), distribution=Distribution.AUTO, inv_interval=10)
    slow, _ = _placement(_costs(100e6), distribution=Distribution.AUTO, inv_interval=100)
    assert fast is not Distribution.COMM_OPT  # cheap gradients: share the preconditioning
    assert slow is Distribution.COMM_OPT  # dear gradients, rare inversions: broadcast those
