"""`FactorPipeline` in one process: discovery, running averages, bucket plans, state.

With no process group the pipeline stores and averages factors exactly as it does in a
job, only without collectives; the bucket plan is a pure function of the costs
(`bucket_plan`), checked here for a world of four without starting one.
"""

from __future__ import annotations

import pytest
import torch

from plait.comm.cost import AlphaBeta
from plait.comm.fusion import FusionItem
from plait.kfac.layers import FactorKind, FactorShape
from plait.kfac.pipeline import (
    FactorComm,
    FactorPipeline,
    FactorSync,
    PipelineConfig,
    bucket_plan,
)

SHAPES = {"l0/A": FactorShape(dim=3), "l0/G": FactorShape(dim=2), "l1/A": FactorShape(dim=4)}


def _wire(pipe: FactorPipeline, key: str, value: float) -> torch.Tensor:
    return torch.full((pipe.layout.numel(SHAPES[key]),), value, dtype=torch.float64)


def _step(pipe: FactorPipeline, values: dict[str, float], *, decay: float) -> None:
    pipe.begin_step(communicate=True, decay=decay)
    for key, v in values.items():
        layer, kind = key.split("/")
        pipe.put(
            key, layer=layer, kind=FactorKind(kind), shape=SHAPES[key], wire=_wire(pipe, key, v)
        )
    for _ in pipe.completed():
        pass
    pipe.end_step()


@pytest.mark.parametrize("sync", list(FactorSync))
@pytest.mark.parametrize("packed", [True, False])
def test_discovery_lays_out_the_factors_in_ready_order(sync: FactorSync, packed: bool) -> None:
    pipe = FactorPipeline(PipelineConfig(sync=sync, packed=packed))
    assert not pipe.discovered
    _step(pipe, {"l1/A": 1.0, "l0/G": 2.0, "l0/A": 3.0}, decay=0.5)
    assert pipe.discovered and [s.key for s in pipe.slots] == ["l1/A", "l0/G", "l0/A"]
    offsets = [s.offset for s in pipe.slots]
    assert offsets == sorted(offsets) and offsets[0] == 0
    numel = sum(s.numel for s in pipe.slots)
    assert pipe.running is not None and pipe.running.numel() == numel
    assert pipe.wire_bytes() == 8 * numel  # float64 factors travel as they are
    assert all(pipe.is_initialized(k) for k in SHAPES) and not pipe.is_initialized("nope")


def test_running_average_folds_with_the_decay() -> None:
    """The first value is taken as it is; later ones fold in as d * old + (1 - d) * new."""
    pipe = FactorPipeline(PipelineConfig(packed=False))
    _step(pipe, {"l0/A": 2.0, "l0/G": 4.0}, decay=0.9)
    _step(pipe, {"l0/A": 12.0, "l0/G": 4.0}, decay=0.9)
    a = pipe.factor_upper("l0/A")
    assert a.shape == (1, 3, 3)  # [groups, n, n]
    torch.testing.assert_close(
        a, torch.full((1, 3, 3), 0.9 * 2.0 + 0.1 * 12.0, dtype=torch.float64)
    )
    # a factor that did not fire this step keeps its average
    _step(pipe, {"l0/A": 2.0}, decay=0.5)
    torch.testing.assert_close(pipe.factor_upper("l0/G"), torch.full((1, 2, 2), 4.0).double())


def test_a_factor_appearing_after_discovery_is_ignored() -> None:
    pipe = FactorPipeline(PipelineConfig())
    _step(pipe, {"l0/A": 1.0}, decay=0.5)
    _step(pipe, {"l0/A": 1.0, "l1/A": 5.0}, decay=0.5)
    assert not pipe.has("l1/A") and [s.key for s in pipe.slots] == ["l0/A"]


def test_state_dict_round_trips_and_refuses_another_packing() -> None:
    pipe = FactorPipeline(PipelineConfig(comm=FactorComm.STATIC))
    _step(pipe, {"l0/A": 1.0, "l0/G": 2.0}, decay=0.5)
    state = pipe.state_dict()
    other = FactorPipeline(PipelineConfig(comm=FactorComm.STATIC))
    other.load_state_dict(state)
    assert [s.key for s in other.slots] == ["l0/A", "l0/G"]
    assert other.running is not None and pipe.running is not None
    assert torch.equal(other.running, pipe.running) and other.plan == pipe.plan
    with pytest.raises(ValueError, match="packing"):
        FactorPipeline(PipelineConfig(packed=False)).load_state_dict(state)


def _items(n: int, *, gap_s: float, nbytes: int = 4096) -> list[FusionItem]:
    return [FusionItem(name=f"f{i}", nbytes=nbytes, ready_s=i * gap_s) for i in range(n)]


def test_after_backward_sends_each_factor_alone() -> None:
    cfg = PipelineConfig(comm=FactorComm.AFTER_BACKWARD)
    assert bucket_plan(cfg, _items(4, gap_s=0.0), cost=AlphaBeta.from_rate(1e9), world=4) == [
        [0],
        [1],
        [2],
        [3],
    ]


def test_static_buckets_close_at_the_cap() -> None:
    cfg = PipelineConfig(comm=FactorComm.STATIC, bucket_cap_mb=0.01)  # 10 kB: 3 x 4096 B
    plan = bucket_plan(cfg, _items(6, gap_s=0.0), cost=AlphaBeta.from_rate(1e9), world=4)
    assert plan == [[0, 1, 2], [3, 4, 5]]


def test_dynamic_buckets_follow_the_given_latency() -> None:
    """Factors ready 1 ms apart: a 10 ms start-up latency makes waiting for the next one
    cheaper than a collective of its own (one bucket); a zero-latency link sends each as
    soon as it is ready."""
    cfg = PipelineConfig(comm=FactorComm.DYNAMIC)
    items = _items(5, gap_s=1e-3)
    slow = bucket_plan(cfg, items, cost=AlphaBeta(alpha=1e-2, beta=8 / 1e9), world=4)
    fast = bucket_plan(cfg, items, cost=AlphaBeta(alpha=0.0, beta=8 / 1e12), world=4)
    assert slow == [[0, 1, 2, 3, 4]]
    assert fast == [[0], [1], [2], [3], [4]]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"bucket_cap_mb": 0}, "bucket_cap_mb"),
        ({"replan_every": 0}, "replan_every"),
        ({"drift": 0}, "drift"),
    ],
)
def test_bad_pipeline_settings_are_value_errors(kwargs: dict[str, float], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        PipelineConfig(**kwargs)  # type: ignore[arg-type]
