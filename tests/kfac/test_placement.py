from __future__ import annotations

import pytest

from plait.comm.cost import AlphaBeta
from plait.comm.stats import Collective
from plait.kfac.layers import FactorKind
from plait.kfac.placement import (
    LOCAL,
    Distribution,
    FactorWork,
    LayerWork,
    PlacementPolicy,
    assign,
    choose_distribution,
    lpt,
)

#: CIFAR ResNet-18's factor sides (A, G) per K-FAC layer, in registration order.
RESNET18 = (
    [(27, 64)] + [(576, 64)] * 4 + [(576, 128), (1152, 128), (64, 128), (1152, 128), (1152, 128)]
    + [(1152, 256), (2304, 256), (128, 256), (2304, 256), (2304, 256)]
    + [(2304, 512), (4608, 512), (256, 512), (4608, 512), (4608, 512)] + [(513, 10)]
)  # fmt: skip


def _layers(sides: list[tuple[int, int]], *, rate: float = 1e-10) -> list[LayerWork]:
    out = []
    for i, (a, g) in enumerate(sides):
        name = f"l{i}"
        out.append(
            LayerWork(
                name=name,
                a=FactorWork(layer=name, kind=FactorKind.A, inverse_s=rate * a**3,
                             result_bytes=4 * a * (a + 1) // 2),
                g=FactorWork(layer=name, kind=FactorKind.G, inverse_s=rate * g**3,
                             result_bytes=4 * g * (g + 1) // 2),
                grad_bytes=4 * a * g,
                precondition_s=rate * 2 * (g * g * a + g * a * a),
            )
        )  # fmt: skip
    return out


def test_lpt_is_optimal_on_a_small_case() -> None:
    ranks = lpt([7, 5, 4, 3, 3, 2], 2)
    loads = [0, 0]
    for c, r in zip([7, 5, 4, 3, 3, 2], ranks, strict=True):
        loads[r] += c
    assert sorted(loads) == [12, 12]


def test_lpt_beats_round_robin_on_resnet18() -> None:
    """The design's measured case: round-robin stacks 4608-sided factors on one worker."""
    layers = _layers(RESNET18)
    rr = assign(layers, world=4, policy=PlacementPolicy.ROUND_ROBIN,
                distribution=Distribution.COMM_OPT)  # fmt: skip
    best = assign(layers, world=4, policy=PlacementPolicy.LPT, distribution=Distribution.COMM_OPT)
    biggest = 1e-10 * 4608**3
    assert best.makespan_s == pytest.approx(biggest, rel=0.01)  # bounded by the largest
    assert rr.makespan_s > 1.9 * best.makespan_s
    assert set(best.inv_rank.values()) == {0, 1, 2, 3}


def test_greedy_keeps_a_layers_factors_together() -> None:
    asg = assign(_layers(RESNET18), world=4, policy=PlacementPolicy.GREEDY,
                 distribution=Distribution.COMM_OPT)  # fmt: skip
    for name, owner in asg.layer_rank.items():
        assert asg.inv_rank[f"{name}/A"] == asg.inv_rank[f"{name}/G"] == owner


def test_small_factors_are_inverted_locally_when_cheaper_than_broadcasting() -> None:
    ab = AlphaBeta(alpha=1e-3, beta=8 / 1e9)

    def bcast(nbytes: int, ranks: int) -> float:
        return ab.time(Collective.BROADCAST, nbytes, ranks)

    layers = _layers(RESNET18)
    asg = assign(layers, world=4, policy=PlacementPolicy.LPT, distribution=Distribution.COMM_OPT,
                 broadcast_s=bcast)  # fmt: skip
    for layer in layers:
        for f in (layer.a, layer.g):
            local = asg.inv_rank[f.key] == LOCAL
            assert local == (4 * f.inverse_s < bcast(f.result_bytes, 4))
    assert asg.inv_rank["l0/A"] == LOCAL  # 27 x 27
    assert asg.inv_rank["l17/A"] != LOCAL  # 4608 x 4608


def test_hybrid_blocks_and_receivers() -> None:
    asg = assign(_layers(RESNET18), world=4, policy=PlacementPolicy.LPT,
                 distribution=Distribution.HYBRID, group_size=2)  # fmt: skip
    assert asg.blocks() == [(0, 1), (2, 3)]
    assert asg.receiver_groups() == [(0, 2), (1, 3)]
    for name, owner in asg.layer_rank.items():
        workers = asg.grad_workers(name)
        assert owner in workers and len(workers) == 2
        for r in range(4):
            src = asg.grad_source(name, r)
            assert src in workers and r in asg.receivers_of(src)
    mem = assign(_layers(RESNET18), world=4, policy=PlacementPolicy.LPT,
                 distribution=Distribution.MEM_OPT)  # fmt: skip
    assert all(len(mem.grad_workers(n)) == 1 for n in mem.layer_rank)
    with pytest.raises(ValueError, match="divide"):
        assign(_layers(RESNET18), world=4, policy=PlacementPolicy.LPT,
               distribution=Distribution.HYBRID, group_size=3)  # fmt: skip


def test_auto_distribution_follows_the_network() -> None:
    layers = _layers(RESNET18, rate=2e-11)

    def model(rate_bps: float) -> AlphaBeta:
        return AlphaBeta(alpha=1e-4, beta=8 / rate_bps)

    def choose(rate_bps: float, interval: int) -> Distribution:
        ab = model(rate_bps)
        return choose_distribution(
            layers, world=4, inv_interval=interval,
            broadcast_s=lambda n, r: ab.time(Collective.BROADCAST, n, r),
        )[0]  # fmt: skip

    # a fast network: share the preconditioning (broadcast gradients)
    assert choose(100e9, 10) is Distribution.MEM_OPT
    # a slow network, rare inversions: broadcast inverses once, not gradients every step
    assert choose(100e6, 100) is Distribution.COMM_OPT
    assert choose_distribution(layers, world=1, broadcast_s=lambda n, r: 0.0)[0] is (
        Distribution.COMM_OPT
    )


def test_the_provider_replans_for_the_interval_without_a_process_group() -> None:
    """A slow link: inverting every step, broadcasting every inverse costs more than
    broadcasting gradients (mem-opt); inverting every 50 steps, the inverses' broadcast is
    amortised and every worker preconditions (comm-opt). The provider is asked again
    with each interval, for any world, and answers alike on every rank."""
    import torch
    from torch import nn

    from plait.kfac.costs import KFACCosts
    from plait.kfac.factors import Method
    from plait.kfac.layers import make_layer
    from plait.kfac.placement import PlacementProvider

    torch.manual_seed(0)
    layers = [make_layer(f"l{i}", nn.Linear(256, 256)) for i in range(4)]
    slow = KFACCosts(link=AlphaBeta.from_rate(1e7), inverse_s_per_n3=1e-9, flop_s=1e-11)
    provider = PlacementProvider(costs=slow, method=Method.EIGEN,
                                 distribution=Distribution.AUTO)  # fmt: skip
    often = provider.plan(layers, world=4, inv_interval=1)  # type: ignore[arg-type]
    rarely = provider.plan(layers, world=4, inv_interval=50)  # type: ignore[arg-type]
    assert often.distribution is Distribution.MEM_OPT
    assert rarely.distribution is Distribution.COMM_OPT
    assert provider.plan(layers, world=4, inv_interval=50) == rarely  # type: ignore[arg-type]
    assert PlacementProvider(costs=slow, method=Method.EIGEN).group_size(4) == 4
    hybrid = PlacementProvider(costs=slow, method=Method.EIGEN, distribution=Distribution.HYBRID,
                               grad_workers=3)  # fmt: skip
    with pytest.raises(ValueError, match="grad_workers=3 must divide the world size 4"):
        hybrid.group_size(4)
