"""Command-line reference, rendered from `plait.cli.build_parser()` and the benchmark
suites' parsers (`plait.bench.suites`) at build time.

Every (sub)command gets its usage line and one table per argument group: the flag, its
default and its help, exactly as the parser defines them, so the page cannot drift from
the command line.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import mkdocs_gen_files

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))  # this tree's parser, whatever is installed
os.environ["COLUMNS"] = "92"  # argparse wraps usage lines to this width

from plait.bench.suites import SUITES, parser as suite_parser  # noqa: E402
from plait.cli import build_parser  # noqa: E402

PAGE = "cli.md"


def cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def code(text: str) -> str:
    text = cell(text)
    fence = "``" if "`" in text else "`"
    pad = " " if fence == "``" else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def expand_help(action: argparse.Action, prog: str) -> str:
    """The help text with %(default)s and the like filled in, as argparse prints it."""
    if not action.help or action.help == argparse.SUPPRESS:
        return ""
    params: dict[str, Any] = dict(vars(action), prog=prog)
    for name, value in list(params.items()):
        if value is argparse.SUPPRESS:
            del params[name]
        elif hasattr(value, "__name__"):
            params[name] = value.__name__
    if params.get("choices") is not None:
        params["choices"] = ", ".join(str(c) for c in params["choices"])
    return action.help % params


def default_of(action: argparse.Action) -> str:
    if isinstance(action, argparse._StoreTrueAction | argparse._StoreFalseAction):
        return "off" if isinstance(action, argparse._StoreTrueAction) else "on"
    value = action.default
    if value is None or value is argparse.SUPPRESS or action.nargs == argparse.REMAINDER:
        return ""
    if isinstance(value, list | tuple):
        value = ",".join(str(v) for v in value)
    return code(str(value))


def invocation(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    formatter = parser._get_formatter()
    if action.option_strings:
        return ", ".join(code(s) for s in formatter._format_action_invocation(action).split(", "))
    if action.nargs == argparse.REMAINDER:
        return code(f"{action.metavar or action.dest.upper()} ...")
    return code(formatter._format_args(action, action.dest))


def subcommands(parser: argparse.ArgumentParser) -> list[tuple[str, str, argparse.ArgumentParser]]:
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            for name, sub in action.choices.items():
                found.append((name, helps.get(name, ""), sub))
    return found


def render(parser: argparse.ArgumentParser, level: int, summary: str, out: list[str]) -> None:
    prog = parser.prog
    out.append(f"{'#' * level} `{prog}`\n")
    if summary:
        text = summary[0].upper() + summary[1:]
        out.append(text + ("\n" if text.endswith(".") else ".\n"))
    if parser.description:
        out.append(parser.description + "\n")
    out.append("```text\n" + parser.format_usage().strip() + "\n```\n")

    exclusive = [
        [a for a in group._group_actions if a.help != argparse.SUPPRESS]
        for group in parser._mutually_exclusive_groups
    ]
    for group in parser._action_groups:
        actions = [
            a
            for a in group._group_actions
            if not isinstance(a, argparse._HelpAction | argparse._SubParsersAction)
            and a.help != argparse.SUPPRESS
        ]
        if not actions:
            continue
        out.append(f"**{group.title}**\n")
        if group.description:
            out.append(group.description + "\n")
        out.append("| argument | default | help |\n|---|---|---|")
        for action in actions:
            text = expand_help(action, prog)
            if action.choices is not None and action.metavar is not None:
                text += f" (one of {', '.join(code(str(c)) for c in action.choices)})"
            for members in exclusive:
                if action in members and len(members) > 1:
                    others = [invocation(parser, a) for a in members if a is not action]
                    text += f" (not with {', '.join(others)})"
            row = f"| {invocation(parser, action)} | {default_of(action)} | {cell(text)} |"
            out.append(row)
        out.append("")

    subs = subcommands(parser)
    if subs:
        out.append("| command | what it does |\n|---|---|")
        for _, text, sub in subs:
            anchor = sub.prog.replace(" ", "-").lower()
            out.append(f"| [`{sub.prog}`](#{anchor}) | {cell(text)} |")
        out.append("")
        for _, text, sub in subs:
            render(sub, min(level + 1, 3), text, out)


parser = build_parser()
lines = [
    "# Command line\n",
    "The `plait` command and every subcommand, rendered from the argument parser "
    "(`plait.cli.build_parser()`) when this site was built. `plait COMMAND --help` prints "
    "the same. Rates take a tc rate (`100mbit`, `1gbit`) or a named setting (`slow`, "
    "`balanced`, `fast`; see [the emulated cluster](cluster.md)); strategies take a name "
    "with options after a colon (`acpsgd:rank=4`; see the [user guide](guide/data-parallel.md)).\n",
]
render(parser, 2, "", lines)
lines += [
    "## Benchmark suites: `plait bench SUITE`\n",
    "Each suite has flags of its own, generated from its config; `python -m` of its module "
    "takes the same.\n",
]
for name, suite in SUITES.items():
    render(suite_parser(suite, prog=f"plait bench {name}"), 3, suite.help, lines)
with mkdocs_gen_files.open(PAGE, "w") as fh:
    fh.write("\n".join(lines) + "\n")
mkdocs_gen_files.set_edit_path(PAGE, "src/plait/cli/__init__.py")
