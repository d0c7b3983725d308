"""The command line's flags are frozen: none appears or disappears by accident.

`tests/cli_flags.txt` lists every command's flags and positional arguments, one per line,
the benchmark suites' (``plait bench SUITE``, generated from their configs) among them.
A change to the parser that adds, removes or renames one fails here until the list is
rewritten on purpose (``python -m tests.test_cli_flags``), so the diff shows it in review.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from plait.bench.suites import SUITES, parser
from plait.cli import build_parser

FROZEN = Path(__file__).with_name("cli_flags.txt")


def flags(parser: argparse.ArgumentParser, command: str = "") -> list[str]:
    """``COMMAND --flag -f`` per option and ``COMMAND <dest>`` per positional argument."""
    out = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                out += flags(sub, f"{command} {name}".strip())
        elif action.option_strings:
            out.append(f"{command or 'plait'} {' '.join(sorted(action.option_strings))}")
        else:
            out.append(f"{command or 'plait'} <{action.dest}>")
    return out


def suite_flags() -> list[str]:
    """``bench SUITE [SUBCOMMAND] --flag`` for every flag of every registered suite."""
    out = []
    for name, suite in SUITES.items():
        out += flags(parser(suite, prog=name), f"bench {name}")
    return out


def every_flag() -> list[str]:
    return flags(build_parser()) + suite_flags()


def test_flags_are_frozen() -> None:
    now = every_flag()
    assert len(now) == len(set(now)), "a flag is declared twice"
    frozen = FROZEN.read_text().splitlines()
    added = sorted(set(now) - set(frozen))
    removed = sorted(set(frozen) - set(now))
    assert not added and not removed, (
        f"flags added: {added}; removed: {removed}. If on purpose, rewrite "
        f"{FROZEN.name} with `python -m tests.test_cli_flags`"
    )


if __name__ == "__main__":
    FROZEN.write_text("\n".join(sorted(every_flag())) + "\n")
