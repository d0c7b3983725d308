"""Plans through the training loop and the benchmark harness (the ``plan`` strategy)."""

from __future__ import annotations

import tempfile
from typing import Any

import pytest

from plait.bench.harness import BenchSpec, run_benchmark
from plait.testing import run_distributed
from plait.train.loop import TrainConfig, Trainer
from plait.train.strategy import make_strategy


def _config(plan: str, **kw: Any) -> TrainConfig:
    return TrainConfig(
        workload="gpt", plan=plan, steps=4, batch_size=2, progress=False, lr=1e-3, **kw
    )


def _train(cfg: TrainConfig, steps: int) -> tuple[list[float], Trainer]:
    trainer = Trainer(cfg)
    trainer.maybe_resume()
    losses = []
    batches = trainer.batches(trainer.state.epoch, trainer.state.batch_in_epoch)
    for _ in range(steps):
        losses.append(trainer.train_step([next(batches)]))
        trainer.state.step += 1
        trainer.state.batch_in_epoch += 1
    return losses, trainer


def _worker(rank: int, world: int, ckpt: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    # the same global batch under three plans: the loop shards data by the data axis only
    for plan in ("dp=2", "pp=2", "tp=2,sp=true"):
        losses, trainer = _train(_config(plan), 4)
        out[plan] = losses
        if plan == "pp=2":
            out["eval"] = trainer.evaluate()  # a pipeline evaluates through its schedule
        trainer.close()
    # checkpoint under ZeRO-3 after two steps, resume under a pipeline
    first, trainer = _train(_config("dp=2,zero=3", checkpoint=ckpt), 2)
    trainer.save()
    trainer.close()
    rest, trainer = _train(_config("pp=2,schedule=gpipe", checkpoint=ckpt), 2)
    out["resumed"] = first + rest
    out["resumed_from"] = trainer.resumed_from
    trainer.close()
    # the automatic planner inside the job, then the harness with plans side by side
    losses, trainer = _train(_config("auto", memory="4GiB"), 1)
    out["auto"] = trainer.strategy.describe()
    trainer.close()
    spec = BenchSpec(
        workload="mlp",
        strategies=["ssgd", "plan:pp=2", "plan:dp=2,zero=3"],
        steps=1,
        warmup=0,
        batch_size=4,
        probe=False,
    )
    out["bench"] = run_benchmark(spec)
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as ckpt:
        return run_distributed(_worker, ckpt, world_size=2, timeout_s=400)


def test_loop_trains_the_same_under_every_plan(results: list[dict[str, Any]]) -> None:
    for r in results:
        assert len(r["dp=2"]) == 4
        # fp32 sums in another order (see test_parity)
        assert r["pp=2"] == pytest.approx(r["dp=2"], abs=1e-5)
        assert r["tp=2,sp=true"] == pytest.approx(r["dp=2"], abs=1e-5)


def test_loop_resumes_under_another_plan(results: list[dict[str, Any]]) -> None:
    for r in results:
        assert r["resumed_from"] == 2
        assert r["resumed"] == pytest.approx(r["dp=2"], abs=1e-5)


def test_pipeline_evaluates(results: list[dict[str, Any]]) -> None:
    evals = [r["eval"] for r in results]
    assert evals[0] == evals[1]  # every rank reports the same figures
    assert 0.0 <= evals[0]["test_accuracy"] <= 1.0 and evals[0]["test_loss"] > 0


def test_auto_plan_in_the_loop(results: list[dict[str, Any]]) -> None:
    assert results[0]["auto"] == results[1]["auto"]
    assert results[0]["auto"].startswith("plan:") and results[0]["auto"] != "plan:auto"


def test_harness_runs_plans(results: list[dict[str, Any]]) -> None:
    recs = results[0]["bench"]
    assert [r.strategy_spec for r in recs] == ["ssgd", "plan:pp=2", "plan:dp=2,zero=3"]
    assert all(r.iter_time_s > 0 and r.batch_size == 4 for r in recs)


def test_plan_strategy_options() -> None:
    assert make_strategy("plan:dp=2,zero=3").describe() == "plan:dp=2,zero=3"
    with pytest.raises(ValueError, match="unknown key"):
        make_strategy("plan:dq=2")
    with pytest.raises(ValueError, match="auto chooses"):
        make_strategy("plan:auto=true,tp=2")
    with pytest.raises(ValueError, match="compressor only"):
        TrainConfig(workload="gpt", plan="dp=2", strategy="ssgd:bucket_cap_mb=1")
