"""Flags generated from a typed config: types, choices, switches and groups come from the
fields, and parsing hands back the config's own keyword arguments (or the config itself)."""

from __future__ import annotations

import argparse
import ast
from dataclasses import MISSING, dataclass, fields
from pathlib import Path
from typing import Literal

import pytest

from plait.flags import add_options, build, nested, option, parse, parse_command, values_of


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


@dataclass(frozen=True, kw_only=True)
class _Command:
    inputs: tuple[Path, ...] = option(MISSING, "input files", positional=True, metavar="IN")
    out: Path = option(MISSING, "output folder")
    memory: tuple[str, ...] = option(MISSING, "memory files", nargs="+")
    run: tuple[str, ...] = option((), "a run; repeat the flag for more")
    child: str | None = option(None, "for the program itself", hidden=True)
    repeats: int = option(5)

    def __post_init__(self) -> None:
        if self.repeats < 1:
            raise ValueError("--repeats must be >= 1")


def test_parse_builds_the_config_with_required_positional_and_repeated_flags() -> None:
    cfg = parse(_Command, ["a", "b", "--out", "o", "--memory", "m", "n"], prog="cmd")
    assert cfg == _Command(inputs=(Path("a"), Path("b")), out=Path("o"), memory=("m", "n"))
    argv = ["a", "--out", "o", "--memory", "m", "--run", "x", "--run", "y", "--child", "c"]
    cfg = parse(_Command, argv, prog="cmd")
    assert cfg.run == ("x", "y") and cfg.child == "c"  # lists come back as the tuples typed


def test_parse_refuses_missing_required_flags_and_values_the_config_refuses(
    capsys: pytest.CaptureFixture[str],
) -> None:
    for argv, message in (
        (["a", "--memory", "m"], "the following arguments are required: --out"),
        (["--out", "o", "--memory", "m"], "the following arguments are required: IN"),
        (["a", "--out", "o", "--memory", "m", "--repeats", "0"], "--repeats must be >= 1"),
    ):
        with pytest.raises(SystemExit) as exc:
            parse(_Command, argv, prog="cmd")
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert err.startswith("usage: cmd") and message in err


def test_help_lists_the_flags_but_a_hidden_one(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        parse(_Command, ["--help"], prog="cmd", description="what it does")
    assert exc.value.code == 0
    text = capsys.readouterr().out
    usage = "usage: cmd [-h] --out OUT --memory MEMORY [MEMORY ...] [--run RUN]"
    assert text.startswith(usage) and "IN [IN ...]" in text
    assert "what it does" in text and "--repeats REPEATS\n" in text  # empty help: bare
    assert "--child" not in text


def test_parse_command_builds_the_named_subcommands_config(
    capsys: pytest.CaptureFixture[str],
) -> None:
    commands = {"one": (_Config, "the first"), "two": (_Command, "the second")}
    assert parse_command(commands, ["one", "--count", "2"], prog="cmd") == _Config(count=2)
    two = parse_command(commands, ["two", "a", "--out", "o", "--memory", "m"], prog="cmd")
    assert isinstance(two, _Command) and two.inputs == (Path("a"),)
    with pytest.raises(SystemExit):
        parse_command(commands, ["two", "a", "--out", "o", "--memory", "m", "--repeats", "0"],
                      prog="cmd")  # fmt: skip
    assert capsys.readouterr().err.startswith("usage: cmd two")  # the subcommand's usage
    with pytest.raises(SystemExit):
        parse_command(commands, [], prog="cmd")
    assert "required: command" in capsys.readouterr().err


@pytest.mark.parametrize(
    "declared",
    [
        option((Path("x"),), "a repeated flag with a default"),  # argparse would append to it
        option("x", "a positional with a default", positional=True),
    ],
)
def test_flag_forms_argparse_gets_wrong_are_programming_errors(declared: object) -> None:
    @dataclass
    class Bad:
        value: tuple[Path, ...] = declared  # type: ignore[assignment]

    with pytest.raises(TypeError, match="default"):
        add_options(argparse.ArgumentParser(), Bad)


def test_benchmarks_take_their_flags_from_configs() -> None:
    """No benchmark module builds a parser of its own: its command line is generated from
    a config dataclass (`plait.flags`), so flags and config cannot drift apart."""
    bench = Path(__file__).parents[1] / "src" / "plait" / "bench"
    offenders = []
    for path in sorted(bench.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            if "argparse" in names:
                offenders.append(str(path.relative_to(bench)))
    assert not offenders, f"argparse imported in {offenders}; declare a config (plait.flags)"


def _pair(text: str) -> tuple[int, ...]:
    """``LO,HI`` as two integers (a flag whose text is not its field's type)."""
    try:
        return tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected LO,HI") from None


@dataclass(frozen=True, kw_only=True)
class _Shared:
    size: int = option(2, "how big")
    speed: str | None = option(None, "how fast")

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError("--size must be >= 1")


@dataclass(frozen=True, kw_only=True)
class _Owner:
    task: str = option("a", "the task (--job is the earlier name)", aliases=("--job",))
    shared: _Shared = nested(_Shared, group="shared things")
    span: tuple[int, ...] | None = option(None, "a range LO,HI", parse=_pair)
    last: int = option(0, "the last flag")


def test_an_alias_a_parser_and_a_nested_config_are_flags_of_the_owner() -> None:
    p = argparse.ArgumentParser(exit_on_error=False)
    add_options(p, _Owner)
    assert build(p.parse_args([]), _Owner) == _Owner()
    args = p.parse_args(["--job", "b", "--size", "3", "--span", "1,5", "--speed", "fast"])
    assert build(args, _Owner) == _Owner(
        task="b", shared=_Shared(size=3, speed="fast"), span=(1, 5)
    )
    with pytest.raises(argparse.ArgumentError, match="expected LO,HI"):
        p.parse_args(["--span", "x"])
    with pytest.raises(ValueError, match="--size must be >= 1"):
        build(p.parse_args(["--size", "0"]), _Owner)  # the nested config checks its own
    # the nested flags sit where the field is, in their own group of --help
    options = [a.option_strings for a in p._actions]
    assert options == [["-h", "--help"], ["--task", "--job"], ["--size"], ["--speed"],
                       ["--span"], ["--last"]]  # fmt: skip
    group = next(g for g in p._action_groups if g.title == "shared things")
    assert [a.dest for a in group._group_actions] == ["size", "speed"]
    assert "--task TASK, --job TASK" in p.format_help()


def test_parse_reports_a_nested_configs_refusal_as_a_usage_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exc:
        parse(_Owner, ["--size", "0"], prog="cmd")
    assert exc.value.code == 2 and "--size must be >= 1" in capsys.readouterr().err


def test_the_cluster_flags_are_one_shared_config() -> None:
    """Every command's emulated-cluster flags come from `ClusterConfig`, whose constructor
    checks and normalises them as `check_cluster_args` does."""
    from plait.cli.common import (
        CLUSTER_GROUP,
        ClusterConfig,
        MultiRateClusterConfig,
        add_cluster_args,
    )

    p = argparse.ArgumentParser()
    add_cluster_args(p, multi_bandwidth=True)
    cluster = build(p.parse_args(["--bandwidth", " Slow,FAST", "--latency", "2MS"]),
                    MultiRateClusterConfig)  # fmt: skip
    assert (cluster.bandwidth, cluster.latency) == ("slow,fast", "2ms")
    assert cluster.bandwidths() == ["slow", "fast"] and cluster.world == 4
    assert [g.title for g in p._action_groups][-1] == CLUSTER_GROUP
    with pytest.raises(ValueError, match="--bandwidth"):
        ClusterConfig(bandwidth="slow,fast")  # one rate only
    with pytest.raises(ValueError, match="a modelled link loses no packets"):
        ClusterConfig(loss=1.0, link="model")


@pytest.mark.parametrize(
    ("argv", "config", "required"),
    [
        (["crossover", "run", "a/b", "c/d"], "crossover:CrossoverConfig", {"jobs": ("a/b", "c/d")}),
        (["race", "--target", "0.9"], "race:RaceConfig", {"target": 0.9}),
        (["sweep"], "sweep:SweepCommandConfig", {}),
        (["bench"], "bench:BenchCommandConfig", {}),
        (["bench-fused"], "bench_fused:BenchFusedCommandConfig", {}),
        (["demo"], "demo:DemoConfig", {}),
        (["cluster", "up"], "cluster:ClusterCommandConfig", {"action": "up"}),
        (
            ["run", "--", "x.py", "--lr", "1"],
            "run_script:RunConfig",
            {"script": ("x.py", "--lr", "1")},
        ),
    ],
)
def test_commands_take_their_flags_from_their_configs(
    argv: list[str], config: str, required: dict[str, object]
) -> None:
    """Each command's defaults are its config's and every field is a flag, so a
    command's flags and its config cannot drift apart."""
    import importlib

    from plait.cli import build_parser

    module, name = config.split(":")
    cls = getattr(importlib.import_module(f"plait.cli.{module}"), name)
    args = build_parser().parse_args(argv)
    assert set(values_of(args, cls)) == {f.name for f in fields(cls)}
    assert build(args, cls) == cls(**required)


def test_a_short_alias_comes_first_and_a_positional_takes_the_remainder() -> None:
    @dataclass(frozen=True, kw_only=True)
    class Launch:
        module: bool = option(False, "run as a module", aliases=("-m",))
        command: tuple[str, ...] = option(MISSING, "the rest", positional=True, nargs="...")

    p = argparse.ArgumentParser()
    add_options(p, Launch)
    flags = next(a for a in p._actions if a.dest == "module").option_strings
    assert flags == ["-m", "--module"]  # as argparse's help lists a short flag and its long
    cfg = build(p.parse_args(["-m", "pkg.train", "--lr", "0.1", "-m"]), Launch)
    assert cfg == Launch(module=True, command=("pkg.train", "--lr", "0.1", "-m"))

    @dataclass(frozen=True, kw_only=True)
    class Bad:
        rest: tuple[str, ...] = option((), "not positional", nargs="...")

    with pytest.raises(TypeError, match="remainder"):
        add_options(argparse.ArgumentParser(), Bad)
