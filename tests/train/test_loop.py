from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from plait.specs import OptionValue
from plait.testing import run_distributed
from plait.train.config import StrategyChoice
from plait.train.loop import TrainConfig, Trainer


def _train(rank: int, world: int, cfg: TrainConfig) -> dict[str, object]:
    trainer = Trainer(cfg)
    trainer.run()
    summary = trainer.summary()
    summary["params"] = [
        p.detach().clone() for p in trainer.strategy.unwrap(trainer.model).parameters()
    ]
    trainer.close()
    return summary


# world 4 repeats world 2 with twice the processes: `make test-all` only
@pytest.mark.parametrize("world", [1, 2, pytest.param(4, marks=pytest.mark.slow)])
def test_mlp_learns_digits(world: int) -> None:
    cfg = TrainConfig(workload="mlp", epochs=6, batch_size=32 // world, progress=False)
    (summary, *_) = run_distributed(_train, cfg, world_size=world)
    # the same global batch (32) at every world size; a 2-layer MLP reaches ~95% on digits
    assert summary["final"]["test_accuracy"] > 0.90
    assert summary["world_size"] == world


def test_accumulation_equals_large_batch() -> None:
    """4 micro-batches of 8 with no_sync == one batch of 32 (world 2, plain SGD)."""
    big = TrainConfig(workload="mlp", steps=6, batch_size=16, momentum=0.0, progress=False)
    acc = TrainConfig(
        workload="mlp", steps=6, batch_size=4, accumulate=4, momentum=0.0, progress=False
    )
    p_big = run_distributed(_train, big, world_size=2)[0]["params"]
    p_acc = run_distributed(_train, acc, world_size=2)[0]["params"]
    for a, b in zip(p_big, p_acc, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)  # fp32 sums in another order


def test_checkpoint_resume_in_process(tmp_path: Path) -> None:
    full = TrainConfig(
        workload="mlp", steps=12, checkpoint=str(tmp_path / "a"), checkpoint_every=4, progress=False
    )
    part = TrainConfig(
        workload="mlp", steps=6, checkpoint=str(tmp_path / "b"), checkpoint_every=4, progress=False
    )
    rest = TrainConfig(
        workload="mlp", steps=12, checkpoint=str(tmp_path / "b"), checkpoint_every=4, progress=False
    )
    ref = run_distributed(_train, full, world_size=2)[0]
    run_distributed(_train, part, world_size=2)
    resumed = run_distributed(_train, rest, world_size=2)[0]
    assert resumed["resumed_from"] == 6  # the end-of-run checkpoint of the first part
    for a, b in zip(ref["params"], resumed["params"], strict=True):
        assert torch.equal(a, b)
    kept = sorted(p.name for p in (tmp_path / "b").iterdir())
    assert kept == ["step_00000008", "step_00000012"]  # the newest two


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"workload": "nope"}, "unknown workload"),
        ({"strategy": "nope"}, "unknown strategy"),
        ({"steps": 0}, "steps"),
        ({"accumulate": 0}, "accumulate"),
        ({"optimizer": "lbfgs"}, "optimizer"),
        ({"data": "imagenet"}, "data"),
        ({"lr": -1.0}, "lr"),
    ],
)
def test_bad_config(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        cfg = TrainConfig(**kwargs)  # type: ignore[arg-type]
        Trainer(cfg)


@pytest.mark.parametrize(
    ("kwargs", "name", "options", "spec"),
    [
        ({"strategy": "acpsgd:rank=4"}, "acpsgd", {"rank": 4}, "acpsgd:rank=4"),
        ({"plan": "dp=2,tp=2,zero=3"}, "plan", {"dp": 2, "tp": 2, "zero": 3}, None),
        (
            {"plan": "dp=4", "strategy": "acpsgd"},
            "plan",
            {"dp": 4, "compression": "acpsgd"},
            "plan:dp=4,compression=acpsgd",
        ),
        (
            {"plan": "auto", "memory": "2GiB"},
            "plan",
            {"auto": True, "memory": "2GiB"},
            "plan:auto=true,memory=2GiB",
        ),
    ],
)
def test_strategy_resolved_once_typed(
    kwargs: dict[str, object], name: str, options: dict[str, OptionValue], spec: str | None
) -> None:
    cfg = TrainConfig(**kwargs)  # type: ignore[arg-type]
    assert cfg.strategy_choice == StrategyChoice(name, options)
    assert cfg.strategy_spec() == (spec or f"plan:{kwargs['plan']}")
    # the spec text is the choice's rendering: it parses back to the same choice
    assert StrategyChoice.parse(cfg.strategy_spec()) == cfg.strategy_choice


def test_typed_strategy_stays_plain_data() -> None:
    cfg = TrainConfig(strategy=StrategyChoice("powersgd", {"rank": 2}), steps=1)
    assert cfg.strategy == "powersgd:rank=2"  # JSON for the workers, checkpoints
    assert asdict(cfg)["strategy"] == "powersgd:rank=2"
    assert TrainConfig(**asdict(cfg)).strategy_choice == cfg.strategy_choice
    with pytest.raises(ValueError, match="unknown option 'rnak' for strategy 'acpsgd'"):
        TrainConfig(strategy=StrategyChoice("acpsgd", {"rnak": 4}))
