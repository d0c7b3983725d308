"""The training flags: they describe every `TrainConfig` field and come back unchanged."""

from __future__ import annotations

import argparse
from dataclasses import asdict, fields

import pytest

from plait.train.args import add_train_args, config_from_args
from plait.train.loop import TrainConfig

#: fields that are not flags: the synthetic set's size is the benchmarks' business
NOT_FLAGS = {"synthetic_samples"}


def _parse(argv: list[str]) -> TrainConfig:
    p = argparse.ArgumentParser()
    add_train_args(p)
    return config_from_args(p.parse_args(argv))


def _argv(cfg: TrainConfig) -> list[str]:
    """The flags that describe `cfg` (fields at their default are left out)."""
    out: list[str] = []
    default = TrainConfig()
    for f in fields(TrainConfig):
        value = getattr(cfg, f.name)
        if f.name in NOT_FLAGS or value == getattr(default, f.name):
            continue
        if f.name == "progress":
            out.append("--no-progress")
        else:
            out += ["--" + f.name.replace("_", "-"), str(value)]
    return out


def test_no_flags_give_the_default_config() -> None:
    assert _parse([]) == TrainConfig()


def test_every_field_round_trips() -> None:
    cfg = TrainConfig(
        workload="gpt",
        strategy="acpsgd:rank=4",
        data="synthetic",
        steps=7,
        batch_size=3,
        accumulate=2,
        lr=0.125,
        optimizer="adamw",
        momentum=0.5,
        weight_decay=0.01,
        seed=9,
        checkpoint="ck",
        checkpoint_every=5,
        trace="t.json",
        out="o.json",
        progress=False,
        crossover="g",
        eval_every=4,
        tensorboard="tb",
    )
    planned = TrainConfig(epochs=3, plan="auto", memory="2GiB")  # auto picks the strategy
    default = TrainConfig()
    changed = {k for c in (cfg, planned) for k, v in asdict(c).items() if v != getattr(default, k)}
    # between them every flag-backed field is off its default, so the round trip covers all
    assert changed | NOT_FLAGS == {f.name for f in fields(TrainConfig)}
    assert _parse(_argv(cfg)) == cfg
    assert _parse(_argv(planned)) == planned


def test_invalid_values_are_refused() -> None:
    with pytest.raises(ValueError, match="accumulate must be >= 1"):
        _parse(["--accumulate", "0"])
    with pytest.raises(SystemExit):  # argparse: --epochs and --steps exclude each other
        _parse(["--epochs", "1", "--steps", "2"])
