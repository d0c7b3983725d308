"""`plait.bench.suites`: every suite reached by name through ``plait bench``, with the
same help as its ``python -m`` module, and ``plait bench`` without a suite unchanged."""

from __future__ import annotations

import ast
import contextlib
import importlib
import io
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from plait import cli
from plait.bench.suites import SUITES, Call, Suite
from plait.cli import bench as bench_cli
from plait.cli import parse_command_line

BENCH = Path(__file__).resolve().parents[2] / "src" / "plait" / "bench"
#: Modules with a ``main`` that are not suites: the registry's own, and the workers the
#: ``plait bench`` and ``plait race`` jobs launch on every rank (entry points of their own).
NOT_SUITES = {"plait.bench.suites", "plait.bench.harness", "plait.bench.race"}


def _help(main: Callable[[list[str]], int], argv: list[str]) -> str:
    """What ``--help`` prints (it exits with status 0)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 0
    return out.getvalue()


def _same(text: str, prog: str) -> str:
    """`text` with its usage line's command name replaced and its lines joined: argparse
    wraps the usage line by the name's length, so the words, not the line breaks, must
    agree (a description may name a command too, the same in both)."""
    return " ".join(text.replace(prog, "PROG", 1).split())


def _module_main(suite: Suite) -> Callable[[list[str]], int]:
    """The ``main`` that ``python -m`` runs for `suite` (a package's ``__main__``)."""
    entry = suite.entry or suite.module
    module = importlib.import_module(entry)
    if not hasattr(module, "main"):
        module = importlib.import_module(f"{entry}.__main__")
    main: Callable[[list[str]], int] = module.main
    return main


def _commands(suite: Suite) -> list[list[str]]:
    return [[], *([name] for name, _, _ in suite.commands)]


@pytest.mark.parametrize("name", list(SUITES))
def test_every_suite_helps_through_plait_bench_as_its_module_does(name: str) -> None:
    suite = SUITES[name]
    for sub in _commands(suite):
        via_plait = _help(cli.main, ["bench", name, *sub, "--help"])
        via_module = _help(_module_main(suite), [*sub, "--help"])
        assert via_plait.startswith(f"usage: plait bench {name} {' '.join(sub)}".strip())
        assert _same(via_plait, f"plait bench {name}") == _same(via_module, suite.command)


def test_python_m_and_plait_bench_start_the_same_suite() -> None:
    """The real ``python -m`` entry of one suite, and ``plait bench`` in a fresh process
    (the GPU suite: its help imports no torch)."""

    def run(argv: Sequence[str]) -> str:
        proc = subprocess.run(
            [sys.executable, "-m", *argv, "--help"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert proc.returncode == 0, proc.stderr
        return proc.stdout

    plait = run(["plait.cli", "bench", "gpu-suite"])
    module = run(["plait.bench.gpu_suite"])
    assert "--dry-run" in plait
    assert _same(plait, "plait bench gpu-suite") == _same(module, "python -m plait.bench.gpu_suite")


def test_every_suite_module_is_registered_and_enters_through_the_registry() -> None:
    """Each module of `plait.bench` with a ``main`` (but `NOT_SUITES`) is a suite, and its
    ``main`` is one call of `plait.bench.suites.main` with the suite's name."""
    registered = {s.entry or s.module: s.name for s in SUITES.values()}
    found = set()
    for path in BENCH.rglob("*.py"):
        tree = ast.parse(path.read_text())
        mains = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main"]
        if not mains:
            continue
        parts = path.relative_to(BENCH.parent.parent).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__main__" else parts)
        if module in NOT_SUITES:
            continue
        found.add(module)
        assert module in registered, f"{module} has a main but no suite"
        body = [n for n in mains[0].body if not isinstance(n, ast.Expr)]  # the docstring
        assert len(body) == 1 and isinstance(body[0], ast.Return), module
        assert ast.unparse(body[0].value or ast.Constant(None)) == (
            f"suites.main({registered[module]!r}, argv)"
        ), module
    assert found == set(registered)


def test_plait_bench_without_a_suite_keeps_its_flags(tmp_path: Path) -> None:
    argv = ["bench", "--workload", "mlp", "--strategies", "ssgd;acpsgd:rank=4", "--nodes", "2"]
    argv += ["--bandwidth", "slow,fast", "--steps", "3", "--warmup", "1", "--batch-size", "8"]
    argv += ["--out", str(tmp_path), "--trace", "--link", "model", "--threads", "1"]
    args = parse_command_line(argv)
    assert args.command == "bench" and args.workload == "mlp"
    assert (args.strategies, args.nodes, args.bandwidth) == ("ssgd;acpsgd:rank=4", 2, "slow,fast")
    assert (args.steps, args.warmup, args.batch_size, args.trace) == (3, 1, 8, True)
    assert bench_cli.split_suite(argv) is None
    assert bench_cli.split_suite(["-v", "bench", "timeline", "x.json"]) == (
        ["-v", "bench"],
        "timeline",
        ["x.json"],
    )


def test_plait_bench_help_lists_the_suites() -> None:
    text = _help(cli.main, ["bench", "--help"])
    assert "--strategies" in text
    for name, suite in SUITES.items():
        assert f"  {name}" in text and suite.help in text


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["bench", "nosuch"], "no suite 'nosuch'"),
        (["bench", "timeline", "t.json", "--bogus"], "unrecognized arguments: --bogus"),
        (["bench", "kfac-kernels", "--repeats", "0"], "--repeats must be >= 1"),
        (["bench", "kfac-kernels", "--repeats", "x"], "invalid int value: 'x'"),
        (["bench", "project", "nosuch"], "invalid choice: 'nosuch'"),
    ],
)
def test_a_bad_suite_command_line_is_a_usage_error(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_an_error_of_a_suite_is_one_line_through_plait(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "timeline", str(tmp_path / "missing.json")])
    assert exc.value.code == 1
    err = capsys.readouterr().err
    assert err.startswith("plait bench timeline: error: FileNotFoundError") and err.count("\n") == 1


def test_the_recorded_command_is_the_one_that_ran() -> None:
    call = Call("plait bench lowrank-steps", ("--methods", "ssgd;acpsgd:rank=4"))
    assert call.command == "plait bench lowrank-steps --methods ssgd;acpsgd:rank=4"
    assert call.quoted == "plait bench lowrank-steps --methods 'ssgd;acpsgd:rank=4'"
    assert call.module == "plait.cli bench lowrank-steps"
    assert Call("python -m plait.bench.membench", ()).module == "plait.bench.membench"


def test_a_suite_has_a_config_or_subcommands() -> None:
    with pytest.raises(ValueError, match="one of a config and subcommands"):
        Suite(name="x", help="", module="m")
    with pytest.raises(ValueError, match="one of a config and subcommands"):
        Suite(name="x", help="", module="m", config="C", commands=(("a", "A", ""),))
