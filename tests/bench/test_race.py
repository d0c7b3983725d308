from __future__ import annotations

import itertools
import json
import math
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import pytest

from plait.bench.race import (
    Entry,
    RacePoint,
    RaceResult,
    RaceRun,
    RaceSpec,
    compare,
    median_range,
    merge,
    parse_entry,
    parse_lr_map,
    parse_pairs,
    ratio_interval,
    read_results,
    run_race,
    should_stop,
    summarise,
    verdict,
    write_reports,
)

RESULT_FIELDS = {
    "workload",
    "label",
    "spec",
    "optimizer",
    "lr",
    "metric",
    "target",
    "seeds",
    "reached",
    "time_to_target_s",
    "time_to_target_min_s",
    "time_to_target_max_s",
    "steps_to_target",
    "steps_to_target_min",
    "steps_to_target_max",
    "final_metric",
    "final_metric_min",
    "final_metric_max",
    "bytes_per_worker",
    "bytes_per_worker_min",
    "bytes_per_worker_max",
    "time_ratio",
    "nodes",
    "nproc_per_node",
    "world_size",
    "bandwidth",
    "rate",
    "batch_size",
    "max_steps",
    "eval_every",
    "chunk",
    "runs",
    "torch",
    "commit",
    "command",
    "machine",
}


# ----------------------------------------------------------------- entries and flags
def test_parse_entry_and_lr_map() -> None:
    assert parse_entry("acpsgd:rank=4+sgd@0.1") == Entry(
        spec="acpsgd:rank=4", optimizer="sgd", lr=0.1
    )
    assert parse_entry("ssgd") == Entry(spec="ssgd")
    default, lrs = parse_lr_map(["0.05", "ssgd+muon=0.02", "acpsgd:rank=4=0.3"])
    assert default == 0.05 and lrs == {"ssgd+muon": 0.02, "acpsgd:rank=4": 0.3}
    # @LR wins over the map, the map (by label, then bare spec) over the default
    assert parse_entry("ssgd+muon@0.5", lrs=lrs, lr=default).lr == 0.5
    assert parse_entry("ssgd+muon", lrs=lrs, lr=default).lr == 0.02
    assert parse_entry("acpsgd:rank=4+sgd", lrs=lrs, lr=default).lr == 0.3
    assert parse_entry("ssgd", optimizer="adamw", lrs=lrs, lr=default) == Entry(
        spec="ssgd", optimizer="adamw", lr=0.05
    )
    with pytest.raises(ValueError, match="unknown optimizer 'lion'"):
        parse_entry("ssgd+lion")
    with pytest.raises(ValueError, match="expected a number > 0"):
        parse_entry("ssgd@0")
    with pytest.raises(ValueError, match="given twice"):
        parse_lr_map(["ssgd=0.1", "ssgd=0.2"])


def test_one_strategy_at_several_learning_rates_is_a_learning_rate_sweep() -> None:
    lrs = [Entry(spec="ssgd", optimizer="sgd", lr=lr) for lr in (0.05, 0.1)]
    spec = RaceSpec(
        workload="mlp", entries=[*lrs, Entry(spec="ssgd", optimizer="adamw")], target=0.9
    )
    assert [e.label for e in spec.entries] == ["ssgd+sgd@0.05", "ssgd+sgd@0.1", "ssgd+adamw"]
    again = RaceSpec(**json.loads(json.dumps(asdict(spec))))  # as the workers read it
    assert [e.label for e in again.entries] == [e.label for e in spec.entries]
    with pytest.raises(ValueError, match=r"given twice: ssgd\+sgd@0.1"):
        RaceSpec(workload="mlp", entries=[lrs[1], lrs[1]], target=0.9)


def test_spec_refuses_bad_races() -> None:
    ok: dict[str, Any] = {"workload": "mlp", "entries": [Entry(spec="ssgd")], "target": 0.9}
    RaceSpec(**ok)
    for bad, match in (
        ({"entries": []}, "at least one entry"),
        ({"entries": [Entry(spec="ssgd"), Entry(spec="ssgd")]}, "given twice"),
        ({"target": 1.5}, r"fraction in \(0, 1\]"),
        ({"metric": "f1"}, "metric 'f1'"),
        ({"seeds": []}, "at least one seed"),
        ({"chunk": 0}, "chunk must be >= 1"),
        ({"entries": [Entry(spec="acpsgd:rnak=2")]}, "unknown option 'rnak'"),
    ):
        with pytest.raises(ValueError, match=match):
            RaceSpec(**{**ok, **bad})
    assert RaceSpec(**{**ok, "metric": "loss", "target": 1.7}).reached(1.6)


# ------------------------------------------------------------------------ stop rule
def test_stop_rule() -> None:
    acc: dict[str, Any] = {
        "target": 0.9,
        "metric": "accuracy",
        "max_steps": 100,
        "full_budget": False,
    }
    assert not should_stop(step=10, value=None, **acc)  # between evaluations
    assert not should_stop(step=10, value=0.89, **acc)
    assert should_stop(step=10, value=0.9, **acc)  # the target itself counts
    assert should_stop(step=100, value=0.1, **acc)  # the budget
    assert should_stop(step=100, value=None, **acc)
    assert not should_stop(step=10, value=0.95, **{**acc, "full_budget": True})
    assert should_stop(step=100, value=0.95, **{**acc, "full_budget": True})
    loss = {**acc, "metric": "loss", "target": 1.5}
    assert should_stop(step=5, value=1.5, **loss) and not should_stop(step=5, value=1.6, **loss)
    assert should_stop(step=5, value=math.nan, **loss)  # a diverged run never arrives: it stops
    assert should_stop(step=5, value=math.inf, **{**loss, "full_budget": True})


# ------------------------------------------------------------------------ statistics
def test_median_range_counts_misses_as_never() -> None:
    assert median_range([3.0, 1.0, 2.0]) == (2.0, 1.0, 3.0)
    assert median_range([3.0, None, 1.0]) == (3.0, 1.0, None)  # one miss: still a median
    assert median_range([None, 1.0, None]) == (None, 1.0, None)  # two of three: not reached
    assert median_range([None]) == (None, None, None)
    assert median_range([4, 2]) == (3.0, 2, 4)
    assert median_range([]) == (None, None, None)


def _run(label: str, seed: int, hit: int | None, *, per_step_s: float, steps: int = 40) -> RaceRun:
    curve = []
    for step in range(0, steps + 1, 10):
        metric = 0.95 if hit is not None and step >= hit else 0.5 + step / 1000
        curve.append(
            RacePoint(
                step=step,
                train_time_s=step * per_step_s,
                metric=metric,
                test_loss=1 - metric,
                test_accuracy=metric,
                train_loss=None if step == 0 else 0.3,
            )
        )
        if hit is not None and step >= hit:
            break
    last = curve[-1]
    return RaceRun(
        label=label,
        spec=label.partition("+")[0],
        optimizer="sgd",
        lr=0.1,
        seed=seed,
        reached=hit is not None,
        steps_to_target=hit,
        time_to_target_s=None if hit is None else hit * per_step_s,
        steps=last.step,
        train_time_s=last.train_time_s,
        eval_time_s=0.01,
        final_metric=last.metric,
        bytes_per_worker=1e6 * last.step,
        payload_bytes=int(1e6 * last.step),
        curve=curve,
    )


def test_summary_and_reports_without_a_cluster(tmp_path: Path) -> None:
    spec = RaceSpec(
        workload="mlp",
        target=0.9,
        seeds=[0, 1, 2],
        max_steps=40,
        eval_every=10,
        entries=[
            Entry(spec="ssgd", optimizer="sgd", lr=0.1),
            Entry(spec="acpsgd:rank=4", optimizer="sgd", lr=0.1),
        ],
    )
    runs = [
        _run("ssgd+sgd", 0, 20, per_step_s=1.0),
        _run("ssgd+sgd", 1, 30, per_step_s=1.0),
        _run("ssgd+sgd", 2, 20, per_step_s=1.5),
        _run("acpsgd:rank=4+sgd", 0, 30, per_step_s=0.25),
        _run("acpsgd:rank=4+sgd", 1, None, per_step_s=0.25),
        _run("acpsgd:rank=4+sgd", 2, 20, per_step_s=0.25),
    ]
    base, acp = summarise(spec, runs, nodes=2, nproc_per_node=1, batch_size=16)
    assert (base.time_to_target_s, base.time_to_target_min_s, base.time_to_target_max_s) == (
        30.0,
        20.0,
        30.0,
    )
    assert (base.steps_to_target, base.steps_to_target_min, base.steps_to_target_max) == (
        20,
        20,
        30,
    )
    assert base.reached == 3 and base.time_ratio == 1.0 and base.seeds == [0, 1, 2]
    # the miss counts as never: median of (5, 7.5, never) is 7.5, max is never
    assert (acp.time_to_target_s, acp.time_to_target_min_s, acp.time_to_target_max_s) == (
        7.5,
        5.0,
        None,
    )
    assert acp.reached == 2 and acp.time_ratio == pytest.approx(7.5 / 30)
    assert acp.final_metric_min == pytest.approx(0.54) and acp.final_metric_max == 0.95
    assert acp.bytes_per_worker == 30e6 and acp.world_size == 2

    base.provenance = {
        "command": "plait race --target 0.9",
        "torch": "x",
        "commit": "c",
        "machine": {},
    }
    acp.provenance = dict(base.provenance)
    write_reports([base, acp], tmp_path)
    records = json.loads((tmp_path / "results.json").read_text())
    assert [r["label"] for r in records] == ["ssgd+sgd", "acpsgd:rank=4+sgd"]
    assert set(records[1]) >= RESULT_FIELDS
    assert len(records[1]["runs"]) == 3 and records[1]["runs"][1]["steps_to_target"] is None
    md = (tmp_path / "results.md").read_text()
    assert "`plait race --target 0.9`" in md and "evaluation excluded" in md
    assert "| acpsgd:rank=4+sgd | 0.1 | 2/3 | 7.50 [5.00-never] | 30 [20-never] |" in md
    # 0.25x: an interval over three seeds, with a miss, that does not exclude 1
    acp_row = next(line for line in md.splitlines() if line.startswith("| acpsgd"))
    assert "| 0.25x [" in acp_row and acp_row.endswith(f"| {acp.verdict} |")
    assert acp.bytes_per_step == pytest.approx(1e6)
    assert (tmp_path / "results.png").read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "results.png").stat().st_size > 10_000  # two panels of lines, not blank
    assert read_results(tmp_path / "results.json") == [base, acp]  # to re-plot or compare


def test_ratio_interval_pairs_seeds_and_counts_misses_as_never() -> None:
    # every seed twice as fast: the ratio and both ends of its interval are 0.5
    assert ratio_interval([1.0, 2.0, 3.0, 4.0, 5.0], [2.0, 4.0, 6.0, 8.0, 10.0]) == (
        0.5,
        0.5,
        0.5,
    )
    assert verdict(0.5, 0.5) == "faster" and verdict(1.1, 2.0) == "slower"
    assert verdict(0.8, 1.2) == "no verdict" and verdict(None, None) == "no verdict"
    # one seed's interval has no width: it must not make a verdict
    assert verdict(0.5, 0.5, seeds=1) == "too few seeds" == verdict(0.5, 0.6, seeds=4)
    # seeds that disagree: the interval spans 1, whatever the point ratio says
    ratio, lo, hi = ratio_interval([1.0, 3.0, 1.0, 3.0, 2.0], [2.0, 2.0, 2.0, 2.0, 2.0])
    assert ratio == 1.0 and lo is not None and hi is not None and lo < 1 < hi
    # a miss is never: a numerator that misses on most seeds is infinitely slow
    assert ratio_interval([None, None, None, 1.0, 1.0], [1.0] * 5)[0] == math.inf
    # both never on every seed: no ratio and no interval
    assert ratio_interval([None, None], [None, None]) == (None, None, None)
    # the same results give the same interval (a seeded generator)
    times = ([1.0, 2.5, 2.0, 4.0, 3.0], [2.0, 2.0, 3.0, 3.5, 5.0])
    assert ratio_interval(*times) == ratio_interval(*times)
    with pytest.raises(ValueError, match="paired"):
        ratio_interval([1.0], [1.0, 2.0])


def test_compare_pairs_and_report_of_old_results(tmp_path: Path) -> None:
    assert parse_pairs("a+sgd/b+sgd; c:rank=4/d") == [("a+sgd", "b+sgd"), ("c:rank=4", "d")]
    with pytest.raises(ValueError, match="expected A/B"):
        parse_pairs("a+sgd")
    spec = RaceSpec(
        workload="mlp",
        target=0.9,
        seeds=[0, 1, 2, 3, 4],
        max_steps=40,
        entries=[Entry(spec="ssgd", optimizer="sgd", lr=0.1), Entry(spec="fp16", optimizer="sgd")],
    )
    runs = [_run("ssgd+sgd", s, 20, per_step_s=1.0 + s / 10) for s in range(5)]
    runs += [_run("fp16+sgd", s, 20, per_step_s=0.5 + s / 20) for s in range(5)]
    results = summarise(spec, runs, nodes=2, nproc_per_node=1, batch_size=8)
    c = compare(results, "fp16+sgd", "ssgd+sgd")
    assert c.ratio == pytest.approx(0.5) and c.verdict == "faster" and c.seeds == 5
    with pytest.raises(ValueError, match="no race entry 'adam'"):
        compare(results, "adam", "ssgd+sgd")
    # results written before intervals existed: --report adds them
    for r in results:
        r.time_ratio_lo = r.time_ratio_hi = r.verdict = r.bytes_per_step = None
    write_reports(results, tmp_path)
    from plait import cli

    assert cli.main(["race", "--report", str(tmp_path), "--compare", "fp16+sgd/ssgd+sgd"]) == 0
    again = read_results(tmp_path / "results.json")
    assert again[1].verdict == "faster" and again[1].time_ratio_hi is not None
    md = (tmp_path / "results.md").read_text()
    assert "| fp16+sgd / ssgd+sgd | 0.50x [0.50-0.50] | 5 | faster |" in md


def test_merge_pools_seeds_run_apart(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Two batches of seeds of one race make the race of all its seeds: the same medians
    and verdicts as if they had run in one invocation."""
    entries = [Entry(spec="ssgd", optimizer="sgd", lr=0.1), Entry(spec="fp16", optimizer="sgd")]

    def race(seeds: list[int], command: str) -> list[RaceResult]:
        spec = RaceSpec(workload="mlp", target=0.9, seeds=seeds, max_steps=40, entries=entries)
        runs = [_run("ssgd+sgd", s, 20, per_step_s=1.0 + s / 10) for s in seeds]
        runs += [_run("fp16+sgd", s, 20 if s else None, per_step_s=0.5) for s in seeds]
        out = summarise(spec, runs, nodes=2, nproc_per_node=1, batch_size=8)
        for r in out:
            r.provenance = {"command": command, "commit": "c"}
        return out

    whole = race([0, 1, 2, 3, 4], "all")
    merged = merge([race([0], "first"), race([1, 2, 3, 4], "rest")])
    assert [r.seeds for r in merged] == [[0, 1, 2, 3, 4]] * 2
    for a, b in zip(merged, whole, strict=True):  # only the provenance differs
        assert replace(a, provenance={}) == replace(b, provenance={})
    assert merged[1].reached == 4 and merged[1].time_ratio == pytest.approx(0.5 / 1.2)
    assert merged[0].provenance["commands"] == ["first", "rest"]
    write_reports(merged, tmp_path)
    md = (tmp_path / "results.md").read_text()
    assert "several invocations" in md and "- `first`" in md and "- `rest`" in md
    # the CLI: --report DIR --merge OTHER rewrites DIR with the runs of both
    for name, part in (("a", race([0, 1], "a")), ("b", race([2, 3, 4], "b"))):
        write_reports(part, tmp_path / name)
    from plait import cli

    argv = ["race", "--report", str(tmp_path / "a"), "--merge", str(tmp_path / "b")]
    assert cli.main(argv) == 0
    assert read_results(tmp_path / "a" / "results.json")[1].seeds == [0, 1, 2, 3, 4]
    # what makes two races not one
    with pytest.raises(ValueError, match="seed 1 ran in two"):
        merge([race([0, 1], "a"), race([1, 2], "b")])
    other = race([5], "b")
    other[1].lr = 0.2
    with pytest.raises(ValueError, match=r"'fp16\+sgd': lr is 0.1 in race 1, 0.2 in race 2"):
        merge([race([0], "a"), other])
    with pytest.raises(ValueError, match=r"race 2 has entries ssgd\+sgd;"):
        merge([race([0], "a"), race([1], "b")[:1]])
    with pytest.raises(SystemExit) as exc:
        cli.main(["race", "--merge", str(tmp_path / "b"), "--target", "0.9"])
    assert exc.value.code == 2 and "it needs --report DIR" in capsys.readouterr().err


# --------------------------------------------------------- the runner on a cluster
def test_race_on_two_nodes(tmp_path: Path) -> None:
    """2 entries x 2 seeds on a 2-node cluster (emulated, or loopback without
    CAP_NET_ADMIN), 24 steps: S-SGD at lr 0.1 on digits passes 60% held-out accuracy within
    16 steps at batch 16 on every seed tried, so 0.5 is reachable; Muon's and K-FAC's runs
    are only checked for consistency, and K-FAC's records the intervals it decided."""
    spec = RaceSpec(
        workload="mlp",
        target=0.5,
        seeds=[0, 1],
        max_steps=24,
        eval_every=4,
        chunk=6,
        batch_size=16,
        entries=[
            Entry(spec="ssgd", optimizer="sgd", lr=0.1),
            Entry(spec="ssgd", optimizer="muon", lr=0.01),
            Entry(spec="spd-kfac:factor_interval=auto,inv_interval=auto", optimizer="sgd",
                  lr=0.02),
        ],
    )  # fmt: skip
    results = run_race(
        spec, nodes=2, out=tmp_path, timeout_s=300, progress=False, command="test race"
    )
    assert [r.label for r in results] == [
        "ssgd+sgd",
        "ssgd+muon",
        "spd-kfac:factor_interval=auto,inv_interval=auto+sgd",
    ]
    sgd, muon, kfac = results
    for run in kfac.runs:  # (1, 1) before the first step; then what "auto" had decided
        intervals = [p.kfac_intervals for p in run.curve]
        assert intervals[0] == [1, 1]
        assert all(iv is not None and 1 <= iv[0] <= iv[1] and iv[1] % iv[0] == 0
                   for iv in intervals)  # fmt: skip
    assert all(p.kfac_intervals is None for r in (sgd, muon) for run in r.runs for p in run.curve)
    assert sgd.reached == 2 and sgd.time_ratio == 1.0
    for res in results:
        assert set(res.to_dict()) >= RESULT_FIELDS
        assert (
            res.world_size == 2 and res.batch_size == 16 and res.to_dict()["command"] == "test race"
        )
        assert [run.seed for run in res.runs] == [0, 1]
        for run in res.runs:
            c = run.curve
            assert c[0].step == 0 and c[0].train_time_s == 0.0
            assert all(
                a.step < b.step and a.train_time_s <= b.train_time_s
                for a, b in itertools.pairwise(c)
            )
            assert all(p.step % 4 == 0 or p.step == 24 for p in c)
            assert run.bytes_per_worker > 0 and run.eval_time_s > 0
            assert run.final_metric == c[-1].metric and run.train_time_s == c[-1].train_time_s
            if run.reached:
                # the first evaluation at the target, with the training time at that step,
                # and the run stopped there
                first = next(p for p in c if p.metric >= 0.5)
                assert run.steps_to_target == first.step == run.steps == c[-1].step
                assert run.time_to_target_s == first.train_time_s == run.train_time_s
                assert run.time_to_target_s is not None and run.time_to_target_s > 0
            else:
                assert run.steps == 24 and all(p.metric < 0.5 for p in c)
                assert run.time_to_target_s is None and run.steps_to_target is None
    for seed in (0, 1):  # same seed: same initial weights, so the same metric at step 0
        assert sgd.runs[seed].curve[0].metric == muon.runs[seed].curve[0].metric
    assert sgd.runs[0].curve[0].metric != sgd.runs[1].curve[0].metric
    assert {p.name for p in tmp_path.iterdir()} >= {"results.json", "results.md", "results.png"}


def test_cli_refuses_before_building_a_cluster(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from plait import cli
    from plait.cluster import Cluster

    def no_cluster(*a: object, **k: object) -> None:
        raise AssertionError("a cluster was built for a bad command")

    monkeypatch.setattr(Cluster, "create", no_cluster)
    for argv, message in (
        (["--target", "1.5"], "--target 1.5"),
        (["--target", "0.9", "--strategies", "ssgd+lion"], "unknown optimizer 'lion'"),
        (["--target", "0.9", "--lr", "adam=0.1"], "--lr adam=...: no such entry"),
        (["--target", "0.9", "--seeds", "1,1"], "a seed given twice"),
        ([], "--target is required"),
        (["--target", "0.9", "--compare", "ssgd+sgd/adam"], "--compare: no entry 'adam'"),
        (["--report", "/nonexistent"], "no results.json there"),
    ):
        with pytest.raises(SystemExit) as exc:
            cli.main(["race", *argv])
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err
