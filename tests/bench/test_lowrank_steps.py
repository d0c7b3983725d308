"""`plait.bench.lowrank_steps`: the one-process emulation of W workers follows the real
distributed compressors step for step."""

from __future__ import annotations

from typing import Any

import pytest

from plait.bench.lowrank_steps import markdown, run
from plait.testing import run_distributed

STEPS = 5
OPTIONS: dict[str, Any] = dict(workload="digits-mlp", steps=STEPS, batch=8, lr=1e-3, seed=0)


def _trained(rank: int, world: int, spec: str) -> list[float]:
    from plait.train.loop import TrainConfig, Trainer

    cfg = TrainConfig(
        workload="digits-mlp",
        strategy=spec,
        steps=STEPS,
        batch_size=8,
        optimizer="adamw",
        lr=1e-3,
        seed=0,
        progress=False,
    )
    trainer = Trainer(cfg)
    try:
        trainer.run()
        return trainer.step_losses
    finally:
        trainer.close()


@pytest.mark.parametrize(
    ("emulated", "real"),
    [
        ("acpsgd:rank=2", "acpsgd:rank=2,warmup=0"),
        ("acpsgd:rank=2,warmup=2", "acpsgd:rank=2,warmup=2"),
        ("powersgd:rank=2", "powersgd:rank=2"),
    ],
)
def test_emulated_workers_follow_the_distributed_run(emulated: str, real: str) -> None:
    """Two trainer ranks with the real DDP hook against the emulation of two workers:
    the same losses step after step (fp32 sums of two ranks in another order, then Adam:
    1e-5)."""
    ranks = run_distributed(_trained, real, world_size=2, timeout_s=300)
    mean = [(a + b) / 2 for a, b in zip(*ranks, strict=True)]
    (trace,) = run(methods=[emulated], workers=2, eval_every=STEPS, **OPTIONS)
    assert trace.train_loss == pytest.approx(mean, abs=1e-5)
    assert max(trace.rel_error) > 1e-3  # compressed for real


def test_exact_average_and_report() -> None:
    (ssgd,) = run(methods=["ssgd"], workers=2, eval_every=STEPS, target=10.0, **OPTIONS)
    assert ssgd.rel_error == [0.0] * STEPS
    assert ssgd.steps_to_target == STEPS and set(ssgd.held_out) == {0, STEPS}
    assert "| ssgd | 5 |" in markdown([ssgd], 10.0)
    with pytest.raises(ValueError, match="unknown options"):
        run(methods=["acpsgd:rnak=2"], workers=2, **OPTIONS)
