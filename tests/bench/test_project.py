"""`plait.bench.project`: the step model on profiles built by hand (checked against the
alpha-beta arithmetic), a profile measured here, validation, races and the map."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from plait.bench import project as pj
from plait.bench.project import step
from plait.comm import AlphaBeta, Collective
from plait.comm.cost import Algorithms
from plait.comm.link import link_model

#: 4 parameters of 2 M floats (8 MB each): with DDP's 25 MiB threshold and 1 MiB final
#: bucket, three buckets of 8, 16 and 8 MB... planned by the same planner data_parallel uses.
GRADS = [pj.Grad(name=f"w{i}", shape=(1000, 2000), ready=(i + 1) / 4) for i in range(4)]


def _profile(**kw: object) -> pj.Profile:
    base = dict(
        workload="mlp", device="cpu", batch=8, threads=1, real=False, forward_s=0.1,
        backward_s=0.2, optimizer_s={"sgd": 0.05, "adamw": 0.08, "muon": 0.1}, grads=GRADS,
    )  # fmt: skip
    base.update(kw)
    return pj.Profile(**base)  # type: ignore[arg-type]


def test_a_free_link_leaves_the_compute() -> None:
    est = pj.project(_profile(), "ssgd", world=8, link=AlphaBeta(alpha=0.0, beta=0.0))
    assert est.step_s == pytest.approx(0.35)  # forward + backward + optimizer
    assert est.bytes_per_step == pytest.approx(4 * 8e6)


def test_a_slow_link_makes_the_step_its_wire_time() -> None:
    link = AlphaBeta(alpha=0.0, beta=1e-7)  # 80 Mbit/s
    est = pj.project(_profile(), "ssgd", world=4, link=link)
    wire = link.time(Collective.ALL_REDUCE, 32e6, 4)  # 4.8 s, the same in any bucketing
    assert est.wire_s == pytest.approx(wire)
    # the first bucket leaves when its last gradient is ready, and the wire is never idle
    # after: the step is that start + the wire time + the optimizer
    first = 0.1 + 0.2 * max(g.ready for g in step.grad_buckets(_profile(), "ssgd")[0][0])
    assert est.step_s == pytest.approx(first + wire + 0.05)


def test_compression_shrinks_the_wire_and_costs_its_compute() -> None:
    link = AlphaBeta(alpha=0.0, beta=1e-7)
    cost = {"acpsgd:rank=4": pj.StrategyCost(step_s=0.45, compute_s=0.35)}
    prof = _profile(strategies=cost)
    acp = pj.project(prof, "acpsgd:rank=4", world=4, link=link)
    ssgd = pj.project(prof, "ssgd", world=4, link=link)
    comp = step.compressor("acpsgd:rank=4")
    sent = sum(comp.payload_nbytes(g.name, step.torch.empty(g.shape, device="meta")) for g in GRADS)
    assert acp.bytes_per_step == pytest.approx(sent) and sent < 4 * 8e6 / 100
    assert acp.step_s < ssgd.step_s / 10
    assert acp.step_s >= 0.45  # its compression (0.1 s) is on the autograd thread


def test_compute_is_scaled_to_the_targets_compute_only_step() -> None:
    link = AlphaBeta(alpha=0.0, beta=0.0)
    assert pj.project(_profile(), "ssgd", world=2, link=link, compute_s=0.7).step_s == (
        pytest.approx(0.7)
    )


def test_gloo_and_ring_price_only_their_broadcasts_apart() -> None:
    link = AlphaBeta(alpha=1e-4, beta=1e-9)
    a = pj.project(_profile(), "ssgd", world=4, link=link, algorithms=Algorithms.GLOO)
    b = pj.project(_profile(), "ssgd", world=4, link=link, algorithms=Algorithms.RING)
    assert a.step_s == pytest.approx(b.step_s)  # all-reduce is a ring in both


def test_measured_profile_and_kfac_projection() -> None:
    prof = pj.measure_profile(
        "digits-mlp", ["ssgd", "kfac-naive", "spd-kfac"], steps=2, warmup=1, real=True
    )
    assert prof.forward_s > 0 and prof.backward_s > 0 and prof.real
    assert [g.ready for g in prof.grads] == sorted(g.ready for g in prof.grads)
    assert all(0.0 <= g.ready <= 1.0 for g in prof.grads)
    assert set(prof.strategies) == {"ssgd", "kfac-naive", "spd-kfac"}
    assert prof.decompose_s and prof.factor_ready
    assert pj.Profile.from_dict(json.loads(json.dumps(prof.to_dict()))) == prof
    slow = link_model(1e7)
    naive = pj.project(prof, "kfac-naive", world=8, link=slow)
    spd = pj.project(prof, "spd-kfac", world=8, link=slow)
    # dense factors after backward against packed triangles from the hooks
    assert spd.bytes_per_step < naive.bytes_per_step
    assert spd.step_s < naive.step_s
    lazy = pj.project(prof, "spd-kfac:inv_interval=10", world=8, link=slow)
    assert lazy.step_s < spd.step_s  # factors and inversions every tenth step only
    # the host's work per byte sent delays the passes only for what is sent while they
    # run (the gradient buckets); after backward it hides in the slower wire's time
    host = 1e-9
    hosted = pj.project(prof, "kfac-naive", world=8, link=slow, host_s_per_byte=host)
    grads = sum(4.0 * math.prod(g.shape) for g in prof.grads)
    ring = 2 * 7 / 8  # bytes a worker sends per byte of a ring all-reduce among 8
    assert naive.step_s <= hosted.step_s <= naive.step_s + host * ring * grads + 1e-12


def test_validate_checks_each_record_against_its_projection() -> None:
    prof = _profile()
    rec = {
        "workload": "mlp", "strategy_spec": "ssgd", "world_size": 2, "nodes": 2,
        "bandwidth": "slow", "rate": "100mbit", "compute_time_s": 0.35,
        "iter_time_s": 3.0,
    }  # fmt: skip
    (check,) = pj.validate({"mlp": prof}, [rec])
    link = link_model(1e8)
    expected = pj.project(prof, "ssgd", world=2, link=link, algorithms=Algorithms.GLOO)
    assert check.predicted_s == pytest.approx(expected.step_s)
    assert check.error == pytest.approx(expected.step_s / 3.0 - 1)
    assert check.ok == (abs(check.error) <= 0.15)
    assert "| mlp | ssgd | 2 |" in pj.checks_markdown([check])


def test_race_candidates_and_the_map(tmp_path: Path) -> None:
    race = [
        {"workload": "mlp", "spec": "ssgd", "optimizer": "sgd", "steps_to_target": 100.0},
        {"workload": "mlp", "spec": "acpsgd:rank=4", "optimizer": "sgd", "steps_to_target": 140},
        {"workload": "mlp", "spec": "fp16", "optimizer": "sgd", "steps_to_target": None},
        {"workload": "gpt", "spec": "ssgd", "optimizer": "adamw", "steps_to_target": 5.0},
    ]
    (tmp_path / "results.json").write_text(json.dumps(race))
    study = tmp_path / "study.json"  # another record kept beside the races: skipped
    study.write_text(json.dumps({"workload": "mlp", "runs": []}))
    cands = pj.race_candidates([study, tmp_path / "results.json"], "mlp")
    assert [(c.name, c.steps) for c in cands] == [
        ("acpsgd:rank=4+sgd", 140.0), ("ssgd+sgd", 100.0)
    ]  # fmt: skip
    prof = _profile(strategies={"acpsgd:rank=4": pj.StrategyCost(step_s=0.4, compute_s=0.35)})
    cells = pj.cluster_map(prof, cands, nodes=(8, 64), rates=("1gbit", "100gbit"))
    by = {(c.nodes, c.rate): c for c in cells}
    # 32 MB of gradients: compression wins on 1 Gbit/s despite 1.4x the steps, not on 100
    assert by[8, "1gbit"].winner == "acpsgd:rank=4+sgd"
    assert by[8, "100gbit"].winner == "ssgd+sgd"
    c = by[64, "1gbit"]
    assert c.to_target_s[c.winner] == pytest.approx(c.steps_s[c.winner] * 140)
    assert "| 8 |" in pj.map_markdown(cells, title="t")
    pj.plot_map(cells, tmp_path / "map.png", title="t")
    assert (tmp_path / "map.png").stat().st_size > 1000


def test_projectable_fixes_automatic_intervals() -> None:
    spec = "spd-kfac:factor_interval=auto,inv_interval=auto,kl_clip=0.01,approximation=reduce"
    assert pj.projectable(spec) == (
        f"spd-kfac:factor_interval={pj.AUTO_INTERVAL},inv_interval={pj.AUTO_INTERVAL},"
        "approximation=reduce"
    )
    # a projectable spec finds the profile's measurement of the same factor computation
    assert pj.profile_key(spec) == pj.profile_key(pj.projectable(spec))
    assert pj.profile_key(spec) == "spd-kfac:approximation=reduce"
    assert pj.profile_key("acpsgd:rank=4") == "acpsgd:rank=4"
    assert math.isfinite(pj.TOLERANCE)


def test_recommend_ranks_by_time_to_target_where_races_reached_it(tmp_path: Path) -> None:
    race = [
        {"workload": "digits-mlp", "spec": "ssgd", "optimizer": "adamw", "steps_to_target": 50},
        {"workload": "digits-mlp", "spec": "ssgd", "optimizer": "sgd", "steps_to_target": 500},
    ]
    (tmp_path / "results.json").write_text(json.dumps(race))
    rec = pj.recommend(
        "digits-mlp", world=16, rate="10gbit", races=[tmp_path / "results.json"], real=True
    )
    assert rec.by_target and rec.best == "ssgd+adamw"  # a tenth of the steps
    assert [r[0] for r in rec.rows] == ["ssgd+adamw", "ssgd+sgd"]
    assert "ssgd+adamw" in rec.text() and "time to the races' target" in rec.text()
    plain = pj.recommend("digits-mlp", world=16, rate="1gbit", real=True)
    assert not plain.by_target  # no race: ranked by step, the workload's own optimizer
    assert {r[0] for r in plain.rows} == {f"{s}+sgd" for s in pj.DEFAULT_CANDIDATES}
    steps = [r[1] for r in plain.rows]
    assert steps == sorted(steps) and all(r[2] is None for r in plain.rows)
