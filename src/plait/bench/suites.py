"""The benchmark suites by name: one registry, and one way into every suite.

A suite is a module of `plait.bench` whose command line is a typed config (`plait.flags`)
and whose ``run_parsed(config, call)`` runs one parsed command line. The registry names
each suite with its config (or, for `project`, its table of subcommands), a line of help,
and how its ``--help`` describes it. Both ways in reach a suite through `main`:

    plait bench SUITE [flags]            # the command line (`plait.cli.bench`)
    python -m plait.bench.MODULE [flags] # each module's ``main``, one line that calls `main`

so a suite's flags, their checks and its errors are the same whichever way it starts, and
a new suite is one entry here.

The registry itself imports nothing heavy: a suite's module (torch, optuna) is imported
when that suite parses or runs, so ``plait --help`` and ``plait bench --help``, which
list the suites, stay fast.

Each suite that writes a results folder writes it with `plait.records.write_report`. The
exceptions, each documented in its module: `gpu_suite` writes a folder of parts (each
part's own report, ``suite.json`` and ``README.md``), `project`'s ``profile`` writes one
profile file, and `timeline` prints its table only.

Two modules of `plait.bench` keep an entry of their own, outside the registry: the
workers `plait.bench.harness` and `plait.bench.race`, which the ``plait bench`` and
``plait race`` commands launch on every rank with a spec file; users do not run them.
"""

from __future__ import annotations

import importlib
import shlex
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType, ModuleType
from typing import Any, Literal

from plait.flags import Parser, command_parser, parse, parse_command, parser_for

#: How a suite's ``--help`` describes it, from its module's docstring: not at all, its
#: first line, its first paragraph, or all of it.
Description = Literal["none", "line", "paragraph", "docstring"]

#: The function a suite's module defines to run a parsed command line.
RUN = "run_parsed"


@dataclass(frozen=True, kw_only=True)
class Suite:
    """One registered suite.

    Attributes:
        name: the suite's name after ``plait bench``.
        help: one line for ``plait bench --help``.
        module: the module that defines the config(s) and `RUN`.
        config: the name of the config dataclass in `module` (a suite without
            subcommands).
        commands: ``(subcommand, config name, help)`` of a suite with subcommands.
        entry: the ``python -m`` module that starts the suite (default: `module`).
        description: what of `module`'s docstring ``--help`` prints above the flags.
        verbatim: print that description as written (a docstring with a command line).
    """

    name: str
    help: str
    module: str
    config: str | None = None
    commands: tuple[tuple[str, str, str], ...] = ()
    entry: str | None = None
    description: Description = "none"
    verbatim: bool = False

    def __post_init__(self) -> None:
        if (self.config is None) == (not self.commands):
            raise ValueError(f"suite {self.name!r}: give one of a config and subcommands")

    @property
    def command(self) -> str:
        """The ``python -m`` form of the suite's command."""
        return f"python -m {self.entry or self.module}"

    def load(self) -> ModuleType:
        """The suite's module, imported now (the first time it is needed)."""
        return importlib.import_module(self.module)

    def table(self, module: ModuleType) -> dict[str, tuple[type, str]]:
        """Each subcommand's config class (from `module`) and help."""
        return {name: (getattr(module, config), text) for name, config, text in self.commands}

    def describe(self, module: ModuleType) -> str | None:
        """The text ``--help`` prints above the flags, from `module`'s docstring."""
        doc = module.__doc__ or ""
        if self.description == "line":
            return doc.splitlines()[0]
        if self.description == "paragraph":
            return doc.split("\n\n")[0]
        if self.description == "docstring":
            return doc
        return None


@dataclass(frozen=True)
class Call:
    """How a suite was started: its command (``plait bench membench`` or
    ``python -m plait.bench.membench``) and the arguments after it.

    A suite records the command that made its results next to them, so a reader can run
    it again; this is that command, whichever way the suite was started.
    """

    prog: str
    argv: tuple[str, ...]

    @property
    def command(self) -> str:
        """The command line, its arguments joined by spaces."""
        return " ".join([self.prog, *self.argv])

    @property
    def quoted(self) -> str:
        """The command line with its arguments quoted for a shell (a ``;`` or a space in
        an argument survives a copy and paste)."""
        return " ".join([self.prog, *map(shlex.quote, self.argv)])

    @property
    def module(self) -> str:
        """What follows ``python -m`` (or ``plait run -m --``) to start the same suite:
        ``plait.bench.membench``, or ``plait.cli bench membench``."""
        if self.prog.startswith("python -m "):
            return self.prog.removeprefix("python -m ")
        return "plait.cli " + self.prog.removeprefix("plait ")


def _suites(*suites: Suite) -> Mapping[str, Suite]:
    return MappingProxyType({s.name: s for s in sorted(suites, key=lambda s: s.name)})


#: Every suite, by name.
SUITES: Mapping[str, Suite] = _suites(
    Suite(
        name="convergence",
        help="iterations to a target test accuracy, strategies compared on real data",
        module="plait.bench.convergence",
        config="ConvergenceConfig",
        description="docstring",
        verbatim=True,
    ),
    Suite(
        name="dispatch",
        help="which floating-point dispatch choices change a training run; pinning",
        module="plait.bench.dispatch",
        config="DispatchConfig",
    ),
    Suite(
        name="fidelity",
        help="each data-parallel strategy's final test metric on an emulated cluster",
        module="plait.bench.fidelity",
        config="FidelityConfig",
        description="docstring",
    ),
    Suite(
        name="gpu-suite",
        help="every GPU measurement in one prepared command (--dry-run: on the CPU)",
        module="plait.bench.gpu_suite",
        config="SuiteConfig",
        description="paragraph",
    ),
    Suite(
        name="kfac-cuda",
        help="a K-FAC step against first-order steps on one CUDA device",
        module="plait.bench.kfac_cuda",
        config="KfacCudaConfig",
        description="paragraph",
    ),
    Suite(
        name="kfac-kernels",
        help="K-FAC's per-layer kernels on one core against the textbook ones",
        module="plait.bench.kfac_kernels",
        config="KernelsConfig",
        description="line",
    ),
    Suite(
        name="lowrank-steps",
        help="low-rank compressors step by step, W workers emulated in one process",
        module="plait.bench.lowrank_steps",
        config="LowrankStepsConfig",
    ),
    Suite(
        name="membench",
        help="per-rank memory of plans next to the planner's (run on every rank)",
        module="plait.bench.membench",
        config="MembenchConfig",
    ),
    Suite(
        name="project",
        help="step time and time to target projected to larger clusters",
        module="plait.bench.project.commands",
        entry="plait.bench.project",
        commands=(
            ("profile", "ProfileConfig", "measure a workload on this process"),
            ("validate", "ValidateConfig", "projection vs emulated `plait bench` results"),
            ("map", "MapConfig", "which strategy and optimizer wins where"),
        ),
    ),
    Suite(
        name="scorecard",
        help="the planner's choices against the measured-fastest plan that fits",
        module="plait.bench.scorecard",
        config="ScorecardConfig",
    ),
    Suite(
        name="sweep-race",
        help="a hyper-parameter sweep to the end: fused, sequential, concurrent",
        module="plait.bench.fused.sweep_race",
        config="RaceFlags",
        description="docstring",
        verbatim=True,
    ),
    Suite(
        name="timeline",
        help="where a step's time goes, from a merged `plait bench --trace`",
        module="plait.bench.timeline",
        config="TimelineConfig",
        description="paragraph",
    ),
)


def parse_suite(suite: Suite, argv: Sequence[str], *, prog: str) -> tuple[ModuleType, object]:
    """`suite`'s module and the config its command line `argv` describes.

    Raises:
        SystemExit: ``--help`` (status 0), or a bad command line (status 2, with the
            usage and the message), as `plait.flags.parse` does.
    """
    module = suite.load()
    description = suite.describe(module)
    if suite.config is not None:
        config = getattr(module, suite.config)
        return module, parse(
            config, argv, prog=prog, description=description, verbatim=suite.verbatim
        )
    return module, parse_command(suite.table(module), argv, prog=prog, description=description)


def parser(suite: Suite, *, prog: str) -> Parser:
    """The parser of `suite`'s command line, as `parse_suite` reads it (for the docs'
    command-line reference and the flag freeze)."""
    module = suite.load()
    description = suite.describe(module)
    if suite.config is not None:
        config = getattr(module, suite.config)
        return parser_for(config, prog=prog, description=description, verbatim=suite.verbatim)
    return command_parser(suite.table(module), prog=prog, description=description)


def main(name: str, argv: Sequence[str] | None = None, *, prog: str | None = None) -> int:
    """Run the suite `name` on the command line `argv`; its exit status.

    Args:
        name: a key of `SUITES`.
        argv: the suite's arguments (``None``: ``sys.argv[1:]``, as ``python -m`` gets).
        prog: the command's name in the usage line and the recorded command (default:
            ``python -m`` and the suite's module).

    Raises:
        SystemExit: as `parse_suite`, for ``--help`` and a bad command line.
    """
    suite = SUITES[name]
    args = tuple(sys.argv[1:] if argv is None else argv)
    prog = prog or suite.command
    module, config = parse_suite(suite, args, prog=prog)
    run: Callable[[Any, Call], int] = getattr(module, RUN)
    return run(config, Call(prog, args))
