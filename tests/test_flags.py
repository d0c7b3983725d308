"""Flags generated from a typed config: types, choices, switches and groups come from the
fields, and parsing hands back the config's own keyword arguments."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields
from typing import Literal

import pytest

from plait.flags import add_options, option, values_of


@dataclass(kw_only=True)
class _Config:
    name: str = option("a", "a name")
    mode: Literal["x", "y"] = option("x", "a mode")
    count: int | None = option(None, "how many", exclusive="size")
    share: float | None = option(None, "what share", exclusive="size")
    colour: str | None = option(None, "a colour", choices=("red", "blue"), metavar="C")
    progress: bool = option(True, "no progress bar")
    loud: bool = option(False, "speak up")
    hidden: int = 7


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(exit_on_error=False)
    add_options(p, _Config)
    return p.parse_args(argv)


def test_defaults_are_the_fields_defaults() -> None:
    values = values_of(_parse([]), _Config)
    assert values == {
        "name": "a",
        "mode": "x",
        "count": None,
        "share": None,
        "colour": None,
        "progress": True,
        "loud": False,
    }
    assert _Config(**values) == _Config()  # a field without option() has no flag


def test_types_choices_and_switches_come_from_the_fields() -> None:
    args = _parse(["--count", "3", "--mode", "y", "--colour", "red", "--no-progress", "--loud"])
    assert values_of(args, _Config) | {"name": "a"} == {
        "name": "a",
        "mode": "y",
        "count": 3,
        "share": None,
        "colour": "red",
        "progress": False,
        "loud": True,
    }
    with pytest.raises(argparse.ArgumentError, match="invalid choice"):
        _parse(["--mode", "z"])  # the Literal's values
    with pytest.raises(argparse.ArgumentError, match="invalid choice"):
        _parse(["--colour", "green"])
    with pytest.raises(argparse.ArgumentError, match="invalid int"):
        _parse(["--count", "2.5"])


def test_an_exclusive_group_refuses_both() -> None:
    with pytest.raises(argparse.ArgumentError, match="not allowed with"):
        _parse(["--count", "1", "--share", "0.5"])
    p = argparse.ArgumentParser()
    add_options(p, _Config)
    assert "[--count COUNT | --share SHARE]" in p.format_usage()
    assert "--colour C" in p.format_usage()


def test_a_field_type_without_a_flag_form_is_a_programming_error() -> None:
    @dataclass
    class Bad:
        pairs: list[int] = option(None, "pairs")

    with pytest.raises(TypeError, match="no flag type"):
        add_options(argparse.ArgumentParser(), Bad)


def test_train_config_is_its_flags_schema() -> None:
    """Every field a user sets has a flag whose default is the field's, so the flags and
    the config cannot drift apart (the synthetic data's size is set by benchmarks only)."""
    from plait.train.args import add_train_args, config_from_args
    from plait.train.config import TrainConfig

    p = argparse.ArgumentParser()
    add_train_args(p)
    parsed = p.parse_args([])
    values = values_of(parsed, TrainConfig)
    assert set(values) == {f.name for f in fields(TrainConfig)} - {"synthetic_samples"}
    assert config_from_args(parsed) == TrainConfig()
