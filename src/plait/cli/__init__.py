"""The `plait` command line; flag spellings are a public contract (see the README).

One module per command (`add_parser`, `validate`, `run`); what they share is in
`common` (the parser, cluster flags, checks) and `config` (TOML run configs). This
module assembles the parser and runs a command: parse, check every input, then run.
``plait bench SUITE ...`` is the one command line argparse does not see whole: it runs a
benchmark suite with the suite's own flags (`plait.cli.bench.split_suite`).
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from collections.abc import Callable
from typing import NoReturn

from plait._proc import interrupts_held
from plait.cli import (
    bench,
    bench_fused,
    cluster,
    crossover,
    demo,
    plan,
    race,
    run_script,
    sweep,
    train,
)
from plait.cli.common import (
    DEFAULT_NODES,
    NUMBER_BOUNDS,
    Parser,
    add_debug_flag,
    add_verbosity_flags,
    check_numbers,
    export_cluster_env,
    version_text,
)
from plait.cli.config import load_run_config, subcommand
from plait.log import configure, level_from

__all__ = [
    "COMMANDS",
    "DEFAULT_NODES",
    "NUMBER_BOUNDS",
    "VALIDATORS",
    "build_parser",
    "check_numbers",
    "load_run_config",
    "main",
    "parse_command_line",
]


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="plait",
        description="Braid computation and communication: faster PyTorch training where "
        "hardware sits idle.",
        epilog=f"Every command that builds an emulated cluster defaults to --nodes "
        f"{DEFAULT_NODES}. `plait train` and `plait bench` also read their flags from a TOML "
        "run config (--config run.toml; examples in configs/).",
    )
    parser.add_argument(
        "--debug", action="store_true", help="show the traceback of an error (also PLAIT_DEBUG=1)"
    )
    add_verbosity_flags(parser, default=False)
    parser.add_argument("--version", action="version", version=version_text())
    sub = parser.add_subparsers(dest="command", required=True)

    demo.add_parser(sub)
    train.add_parser(sub)
    run_script.add_parser(sub)
    cluster.add_parser(sub)
    bench.add_parser(sub)
    race.add_parser(sub)

    crossover.add_parser(sub)
    sweep.add_parser(sub)
    bench_fused.add_parser(sub)

    plan.add_parser(sub)
    add_debug_flag(parser)
    return parser


def parse_command_line(
    argv: list[str] | None = None, parser: argparse.ArgumentParser | None = None
) -> argparse.Namespace:
    """Parse `argv` with `parser` (default: a new `build_parser()`) and merge the
    ``--config`` run config under it.

    The config's values become the subcommand's defaults, so a flag given on the command
    line wins; it also wins over the config's value of a flag it excludes (``--epochs``
    over a config's ``steps``). Raises ValueError for a bad config (exit 2 in `main`).
    One parser serves every pass (building one imports every command's options).
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser() if parser is None else parser
    return _with_run_config(parser, parser.parse_args(argv), argv)


def _with_run_config(
    parser: argparse.ArgumentParser, args: argparse.Namespace, argv: list[str]
) -> argparse.Namespace:
    """`args`, which `parser` parsed from `argv`, with the ``--config`` run config merged
    under the command line (`args` itself without one)."""
    if getattr(args, "config", None) is None:
        return args
    sub = subcommand(parser, args.command)
    values = load_run_config(args.config, sub)
    given = _given_on_command_line(parser, sub, argv)
    for group in sub._mutually_exclusive_groups:
        dests = {a.dest for a in group._group_actions}
        if dests & given:
            for dest in dests - given:
                values.pop(dest, None)
    sub.set_defaults(**values)
    return parser.parse_args(argv)


def _given_on_command_line(
    parser: argparse.ArgumentParser, sub: argparse.ArgumentParser, argv: list[str]
) -> set[str]:
    """The destinations of the subcommand `sub`'s flags that `argv` sets itself: a parse
    with their defaults suppressed, which are put back after."""
    saved = [(action, action.default) for action in sub._actions]
    try:
        for action, _ in saved:
            action.default = argparse.SUPPRESS
        return set(vars(parser.parse_args(argv)))
    finally:
        for action, default in saved:
            action.default = default


VALIDATORS: dict[str, Callable[[argparse.Namespace], None]] = {
    "demo": demo.validate,
    "train": train.validate,
    "run": run_script.validate,
    "cluster": cluster.validate,
    "bench": bench.validate,
    "race": race.validate,
    "crossover": crossover.validate,
    "sweep": sweep.validate,
    "bench-fused": bench_fused.validate,
    "plan": plan.validate,
}


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "demo": demo.run,
    "train": train.run,
    "run": run_script.run,
    "cluster": cluster.run,
    "bench": bench.run,
    "race": race.run,
    "crossover": crossover.run,
    "sweep": sweep.run,
    "bench-fused": bench_fused.run,
    "plan": plan.run,
}


def _fail(args: argparse.Namespace, code: int, message: str) -> NoReturn:
    """Exit with one line on stderr (and the traceback first under --debug)."""
    if getattr(args, "debug", False) or os.environ.get("PLAIT_DEBUG") not in (None, "", "0"):
        traceback.print_exc()
    message = " ".join(message.split())  # one line, whatever the exception held
    sys.stderr.write(f"plait {args.command}: error: {message}\n")
    sys.stderr.flush()
    raise SystemExit(code)


def _run_suite(head: list[str], name: str, argv: list[str]) -> int:
    """``plait [flags] bench NAME ARGV...``: the suite `name`, with plait's logging and its
    errors as every command's (a usage error or a ValueError exits with code 2, any other
    error with 1, in one line unless ``--debug``)."""
    args = build_parser().parse_args(head)  # plait's own flags, before `bench`
    args.command = f"bench {name}"
    try:
        configure(level_from(args.verbose, args.quiet))
        return bench.run_suite(name, argv)
    except ValueError as exc:
        _fail(args, 2, str(exc))
    except KeyboardInterrupt:
        print("\nplait: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        _fail(args, 1, f"{type(exc).__name__}: {exc}")


def main(argv: list[str] | None = None) -> int:
    """Parse, check every input (exit 2 on a bad one), then run the command.

    Bad input, found before anything is built or in the command itself (ValueError), exits
    with code 2; any other error with code 1; both print one line unless ``--debug``.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        suite = bench.split_suite(argv)
    except ValueError as exc:  # a usage error, as argparse reports one
        sys.stderr.write(f"plait bench: error: {exc} (see plait bench --help)\n")
        raise SystemExit(2) from None
    if suite is not None:
        return _run_suite(*suite)
    parser = build_parser()
    try:
        # a Ctrl-C while torch imports (parsing, checking) stops the command once they end
        with interrupts_held():
            args = parser.parse_args(argv)
    except KeyboardInterrupt:
        print("\nplait: interrupted", file=sys.stderr)
        return 130
    try:
        with interrupts_held():
            args = _with_run_config(parser, args, argv)
            configure(level_from(args.verbose, args.quiet))
            check_numbers(args)
            VALIDATORS[args.command](args)
        if hasattr(args, "placement"):
            export_cluster_env(args)
        return COMMANDS[args.command](args)
    except ValueError as exc:
        _fail(args, 2, str(exc))
    except KeyboardInterrupt:
        print("\nplait: interrupted; cluster torn down", file=sys.stderr)
        return 130
    except Exception as exc:  # every other error ends as one line too; --debug shows all
        _fail(args, 1, f"{type(exc).__name__}: {exc}")
