from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from plait.cli import DEFAULT_NODES, build_parser, main, parse_command_line
from plait.log import LEVEL_ENV, configure, level_from
from tests.bench.test_harness import CONTRACT as HARNESS_FIELDS
from tests.test_configs import scalars as _scalars

CONTRACT = HARNESS_FIELDS | {"torch", "commit", "command"}


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["train", "--strategy", "bogus", "--steps", "1"], "unknown strategy 'bogus'"),
        (["train", "--workload", "alexnet"], "unknown workload"),
        (["bench", "--bandwidth", "warp9", "--strategies", "ssgd"], "invalid rate"),
        (["run", "--nodes", "1"], "give the script"),
    ],
)
def test_bad_input_exits_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_device_cuda_is_refused_without_a_gpu_and_pipelines_on_a_shared_one(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import torch

    import plait.cluster

    def no_cluster(*_: object, **__: object) -> None:
        raise AssertionError("a cluster was built before the input was refused")

    monkeypatch.setattr(plait.cluster.Cluster, "create", no_cluster)
    argv = ["bench", "--device", "cuda", "--nodes", "2", "--strategies", "ssgd"]
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 2 and "no CUDA device" in capsys.readouterr().err
        # one GPU, as the lent machines have: four ranks share it through gloo
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    argv = ["bench", "--device", "cuda", "--workload", "gpt", "--strategies", "plan:pp=2"]
    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "strategy 'plan:" in err
    assert "send and receive take host memory only" in err


def test_contract_flags_parse() -> None:
    p = build_parser()
    a = p.parse_args(
        [
            "train",
            "--workload",
            "gpt",
            "--strategy",
            "ssgd",
            "--nodes",
            "4",
            "--nproc-per-node",
            "2",
            "--bandwidth",
            "slow",
            "--latency",
            "1ms",
            "--loss",
            "0.1",
            "--steps",
            "5",
            "--trace",
            "t.json",
            "--checkpoint",
            "c",
        ]
    )
    assert (a.nodes, a.nproc_per_node, a.bandwidth, a.steps) == (4, 2, "slow", 5)
    b = p.parse_args(
        [
            "bench",
            "--workload",
            "mlp,gpt",
            "--strategies",
            "ssgd",
            "--bandwidth",
            "slow,fast",
            "--steps",
            "3",
            "--out",
            "x",
        ]
    )
    assert b.nodes == 4 and b.bandwidth == "slow,fast"


def test_bench_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "bench"
    cmd = [
        sys.executable,
        "-m",
        "plait.cli",
        "bench",
        "--workload",
        "mlp",
        "--strategies",
        "ssgd",
        "--nodes",
        "2",
        "--bandwidth",
        "1gbit",
        "--steps",
        "2",
        "--warmup",
        "1",
        "--batch-size",
        "8",
        "--out",
        str(out),
        "--tensorboard",
        str(tmp_path / "tb"),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (rec,) = json.loads((out / "results.json").read_text())
    scalars = _scalars(tmp_path / "tb" / "mlp" / "1gbit" / "ssgd")
    assert scalars["bench/samples_per_s"] == [pytest.approx(rec["samples_per_s"])]
    assert len(scalars["bench/step_time_s"]) == 2  # --steps
    assert set(rec) >= CONTRACT
    assert rec["bandwidth"] == "1gbit" and rec["nodes"] == 2 and rec["batch_size"] == 8
    assert (out / "results.md").read_text().count("| mlp |") == 1
    assert (out / "results.png").stat().st_size > 1000


def test_version_flag_and_module_entry_point() -> None:
    import subprocess
    import sys

    from plait import __version__

    out = subprocess.run(
        [sys.executable, "-m", "plait", "--version"],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"plait {__version__} (torch ")


def _parsers(
    parser: argparse.ArgumentParser, path: tuple[str, ...] = ()
) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield from _parsers(child, (*path, name))


def test_every_flag_of_every_command_has_help() -> None:
    missing = [
        f"plait {' '.join(path)} {action.option_strings or action.dest}"
        for path, parser in _parsers(build_parser())
        for action in parser._actions
        if not isinstance(action, argparse._SubParsersAction) and not (action.help or "").strip()
    ]
    assert missing == []


def test_help_shows_defaults_and_nodes_agree() -> None:
    parsers = dict(_parsers(build_parser()))
    text = parsers[("bench",)].format_help()
    assert "(default: 10)" in " ".join(text.split())  # --steps
    nodes = {
        path: action.default
        for path, parser in parsers.items()
        for action in parser._actions
        if "--nodes" in action.option_strings
    }
    assert len(nodes) >= 6  # demo, train, run, cluster, bench, crossover run, plan
    assert set(nodes.values()) == {DEFAULT_NODES}, nodes


def test_config_file_under_the_command_line(tmp_path: Path) -> None:
    cfg = tmp_path / "run.toml"
    cfg.write_text(
        'workload = "mlp"\nstrategy = "acpsgd:rank=4"\nepochs = 2\nbatch_size = 16\n'
        'no-progress = true\nbandwidth = "slow"\n'
    )
    args = parse_command_line(["train", "--config", str(cfg), "--steps", "5", "--nodes", "2"])
    assert (args.strategy, args.batch_size, args.progress) == ("acpsgd:rank=4", 16, False)
    assert (args.steps, args.epochs, args.nodes) == (5, None, 2)  # --steps drops epochs
    args = parse_command_line(["train", "--config", str(cfg), "--batch-size", "8"])
    assert (args.batch_size, args.epochs, args.nodes) == (8, 2, DEFAULT_NODES)


def test_a_command_builds_its_parser_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Parsing, the run config's merge and the flags given on the command line all read
    one parser (each build imports every command's options), and the config's merge
    leaves that parser's defaults as they were."""
    import plait.cli as cli

    builds = []
    real = cli.build_parser

    def counted() -> argparse.ArgumentParser:
        builds.append(1)
        return real()

    monkeypatch.setattr(cli, "build_parser", counted)
    cfg = tmp_path / "run.toml"
    cfg.write_text('workload = "mlp"\nbatch_size = 16\n')
    with pytest.raises(SystemExit) as exc:
        cli.main(["train", "--config", str(cfg), "--steps", "5", "--nodes", "0"])
    assert exc.value.code == 2 and "--nodes 0" in capsys.readouterr().err
    assert len(builds) == 1
    parser = real()
    args = parse_command_line(["train", "--config", str(cfg), "--steps", "5"], parser)
    assert (args.batch_size, args.steps, args.epochs) == (16, 5, None)
    assert parser.parse_args(["train"]).steps is None  # the suppressed defaults came back


def test_a_negated_switch_is_configured_by_its_own_name(tmp_path: Path) -> None:
    """``no-progress = true`` turns the bar off; ``progress``, the flag's destination, is
    not a key: it would read the other way round."""
    cfg = tmp_path / "run.toml"
    cfg.write_text("no-progress = false\n")
    assert parse_command_line(["train", "--config", str(cfg)]).progress is True
    cfg.write_text("progress = true\n")
    with pytest.raises(ValueError, match="unknown key 'progress'"):
        parse_command_line(["train", "--config", str(cfg)])


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("stepz = 3\n", "unknown key 'stepz' (accepted: "),
        ('steps = "three"\n', "key 'steps': invalid literal"),
        ("steps = 2.5\n", "key 'steps': expected an integer"),
        ('data = "imagenet"\n', "key 'data': 'imagenet' is not one of real, synthetic"),
        ('no_progress = "yes"\n', "key 'no_progress': expected true or false"),
        ("steps = \n", "not valid TOML"),
    ],
)
def test_bad_config_exits_2_with_one_line(
    tmp_path: Path, text: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = tmp_path / "run.toml"
    cfg.write_text(text)
    with pytest.raises(SystemExit) as exc:
        main(["train", "--config", str(cfg)])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and message in err, err


def test_verbosity_flags_set_the_plait_logger(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(LEVEL_ENV, raising=False)  # restored after: workers read it
    before = logging.getLogger("plait").level
    try:
        for argv, level in ((["--quiet"], logging.WARNING), (["--verbose"], logging.DEBUG)):
            args = parse_command_line(["cluster", "status", *argv])
            assert configure(level_from(args.verbose, args.quiet)).level == level
            assert os.environ[LEVEL_ENV] == logging.getLevelName(level)
        with pytest.raises(SystemExit):  # one or the other
            parse_command_line(["cluster", "status", "--verbose", "--quiet"])
        with pytest.raises(ValueError, match="exclude each other"):  # before and after
            level_from(verbose=True, quiet=True)
    finally:
        logging.getLogger("plait").setLevel(before)
