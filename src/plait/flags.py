"""Command-line flags generated from a typed config: the config is the schema.

A config dataclass declares each field a user may set with `option`, which keeps the
flag's help (and, where the type does not say it, its metavar, choices or a mutually
exclusive group) beside the field's type and default. `add_options` then writes the
flags into an argparse parser, and `values_of` reads a parsed namespace back into the
config's keyword arguments, so a field is declared once and its flag, default, type,
choices and help cannot drift from it (`plait train` and ``python -m plait.train`` both
build their flags from `plait.train.config.TrainConfig`). A command whose flags are one
config's reads them with `parse`; one with subcommands, a config each, with
`parse_command`.

The flag of field ``batch_size`` is ``--batch-size``; its type is the field's, with
``None`` dropped (``int | None`` parses as ``int``; the first of ``str``, ``int``,
``float`` and ``Path`` in a union is taken); a ``Literal`` type gives the choices. A boolean
field that defaults to True is turned off by ``--no-<name>``; one that defaults to False is
turned on by ``--<name>``. A field without a default (``option(MISSING, ...)``) is a
required flag. A ``tuple[X, ...]`` field takes several values, by repeating its flag
(``--run a --run b``) or, with ``nargs="+"``, after one (``--memory a b``). A positional
field is an argument without a flag. Fields without `option` have no flag.

Where the flag's text is not the field's type (``--seeds 0,1,2`` for a tuple of ints, a
size ``2GiB`` for a byte count), ``option(parse=...)`` names the function that reads it.
A field declared with `nested` holds another config whose flags are this one's too, in
an argument group of their own: commands that share a set of flags (an emulated
cluster's) share one config for them.
"""

from __future__ import annotations

import argparse
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import MISSING, Field, dataclass, field, fields
from pathlib import Path
from typing import Any, Literal, TypeVar

_KEY = "plait.flag"
_NESTED = "plait.flags"
_SCALARS = (str, int, float, bool, Path)
#: The namespace attribute `parse_command` stores the chosen subcommand under.
_COMMAND = "command"

#: The parser `parser_for` and `command_parser` build: modules that take their flags from
#: configs name its type through here, not argparse (they build no parser of their own).
Parser = argparse.ArgumentParser

T = TypeVar("T")


@dataclass(frozen=True)
class Option:
    """How one config field appears on the command line (see `option`)."""

    help: str
    metavar: str | None = None
    choices: tuple[str, ...] | None = None
    exclusive: str | None = None
    positional: bool = False
    nargs: Literal["+", "..."] | None = None
    hidden: bool = False
    aliases: tuple[str, ...] = ()
    parse: Callable[[str], Any] | None = None


@dataclass(frozen=True)
class Nested:
    """A field that holds another config, whose flags are its owner's (see `nested`)."""

    config: type
    group: str | None = None


def option(
    default: Any,
    help: str = "",
    *,
    metavar: str | None = None,
    choices: Sequence[str] | None = None,
    exclusive: str | None = None,
    positional: bool = False,
    nargs: Literal["+", "..."] | None = None,
    hidden: bool = False,
    aliases: Sequence[str] = (),
    parse: Callable[[str], Any] | None = None,
) -> Any:
    """A dataclass field with a flag: `default`, and the flag's `help`.

    Args:
        default: the field's default (also the flag's); ``dataclasses.MISSING`` for none,
            which makes the flag required (declare the config ``kw_only``).
        help: the flag's help text; empty gives the flag a bare line in ``--help``.
        metavar: the value's name in the usage line (default: argparse's).
        choices: allowed values, where the field's type is a plain ``str``.
        exclusive: fields naming the same group are mutually exclusive flags.
        positional: an argument without a flag, named by `metavar` (required: no default).
        nargs: ``"+"``: a ``tuple[X, ...]`` field's values follow one flag, not one each;
            ``"..."``: a positional ``tuple[str, ...]`` takes every argument left, flags
            included (a command line to run: ``plait run -- train.py --lr 0.1``).
        hidden: left out of ``--help``: a flag for the program's own use, not a user's.
        aliases: further spellings of the flag (``("--task",)``, an earlier name kept); a
            short one (``"-m"``) comes first, as argparse's help lists them.
        parse: reads the flag's text into the field's value where the type cannot
            (``--seeds 0,1,2`` into a tuple); it raises ``argparse.ArgumentTypeError``
            (or ValueError) for text it refuses. The flag then takes one value.
    """
    meta = Option(
        help,
        metavar,
        None if choices is None else tuple(choices),
        exclusive,
        positional,
        nargs,
        hidden,
        tuple(aliases),
        parse,
    )
    return field(default=default, metadata={_KEY: meta})


def nested(config: type, *, group: str | None = None) -> Any:
    """A dataclass field holding a `config` whose flags are its owner's too.

    A set of flags several commands take (an emulated cluster's) is declared once, as a
    config of its own; each command's config holds one. Its flags sit where the field
    does, in the argument group `group` of ``--help`` where one is named, and parse into
    the same namespace as the owner's (their names must not clash). The field's default
    is `config`'s defaults.
    """
    return field(default_factory=config, metadata={_NESTED: Nested(config, group)})


def _scalar(hint: Any) -> tuple[type, tuple[str, ...] | None]:
    """The type a flag parses into, and its choices where the hint is a ``Literal``."""
    if typing.get_origin(hint) is Literal:
        values = typing.get_args(hint)
        return type(values[0]), tuple(str(v) for v in values)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        for arg in typing.get_args(hint):
            if arg in _SCALARS or typing.get_origin(arg) is Literal:
                return _scalar(arg)
        raise TypeError(f"no flag type in {hint!r}")
    if hint in _SCALARS:
        return hint, None
    raise TypeError(f"no flag type for {hint!r}")


def _items(hint: Any) -> Any:
    """The item type of a ``tuple[X, ...]`` hint (a flag of several values), else None."""
    if typing.get_origin(hint) is not tuple:
        return None
    args = typing.get_args(hint)
    if len(args) != 2 or args[1] is not Ellipsis:
        raise TypeError(f"no flag type for {hint!r}: a flag's values are a tuple[X, ...]")
    return args[0]


def _flagged(config: type) -> list[tuple[Field[Any], Option, Any]]:
    """`config`'s fields declared with `option`: the field, its flag and its type hint."""
    hints = typing.get_type_hints(config)
    return [(f, f.metadata[_KEY], hints[f.name]) for f in fields(config) if _KEY in f.metadata]


def add_options(parser: Any, config: type) -> None:
    """Add a flag for every `option` field of the dataclass `config`, in field order, and
    those of every config a `nested` field holds where that field is.

    Args:
        parser: an ``argparse.ArgumentParser``, or an argument group of one.
        config: the dataclass.

    Raises:
        TypeError: a field's type has no flag form (a programming error in the config).
    """
    groups: dict[str, Any] = {}
    hints = typing.get_type_hints(config)
    for f in fields(config):
        if _NESTED in f.metadata:
            inner: Nested = f.metadata[_NESTED]
            target = parser if inner.group is None else parser.add_argument_group(inner.group)
            add_options(target, inner.config)
        elif _KEY in f.metadata:
            _add_option(parser, f, f.metadata[_KEY], hints[f.name], groups)


def _add_option(
    parser: Any, f: Field[Any], meta: Option, hint: Any, groups: dict[str, Any]
) -> None:
    """Add the flag of one `option` field (`groups`: the exclusive groups made so far)."""
    default = f.default
    target: Any = parser
    if meta.exclusive is not None:
        if meta.exclusive not in groups:
            groups[meta.exclusive] = parser.add_mutually_exclusive_group()
        target = groups[meta.exclusive]
    name = f.name.replace("_", "-")
    text = argparse.SUPPRESS if meta.hidden else meta.help
    item = None if meta.parse is not None else _items(hint)
    if meta.parse is not None:
        kind, choices = meta.parse, None
    else:
        kind, choices = _scalar(hint if item is None else item)
    short = [a for a in meta.aliases if not a.startswith("--")]
    long = [a for a in meta.aliases if a.startswith("--")]
    if kind is bool:
        flag = f"--no-{name}" if default else f"--{name}"
        action = "store_false" if default else "store_true"
        target.add_argument(*short, flag, *long, dest=f.name, action=action, help=text)
        return
    kw: dict[str, Any] = {"help": text}
    if default is MISSING:
        if not meta.positional:  # argparse: a positional is required by its nature
            kw["required"] = True
    elif meta.positional:
        raise TypeError(f"{f.name}: a positional argument has no default")
    elif item is not None and not meta.nargs and default:
        # argparse appends a repeated flag's values to its default, never replaces it
        raise TypeError(f"{f.name}: a repeated flag's default must be empty")
    else:
        kw["default"] = list(default) if item is not None else default
    if kind is not str:
        kw["type"] = kind
    if meta.choices or choices:
        kw["choices"] = list(meta.choices or choices or ())
    if meta.metavar is not None:
        kw["metavar"] = meta.metavar
    if item is not None:
        if meta.nargs == "...":
            if not meta.positional:
                raise TypeError(f"{f.name}: only a positional argument takes the remainder")
            kw["nargs"] = argparse.REMAINDER
        elif meta.nargs or meta.positional:
            kw["nargs"] = "+"
        else:
            kw["action"] = "append"
    if meta.positional:
        target.add_argument(f.name, **kw)
    else:
        target.add_argument(*short, f"--{name}", *long, dest=f.name, **kw)


def values_of(args: argparse.Namespace, config: type) -> dict[str, Any]:
    """The parsed values of `config`'s flagged fields, by field name (those present).

    A flag of several values, parsed into a list, comes back as the field's tuple; a
    `nested` field, as its config built from its flags (where any is present).

    Raises:
        ValueError: a nested config refuses its values (its constructor's message).
    """
    parsed = vars(args)
    out: dict[str, Any] = {}
    for f in fields(config):
        if _NESTED in f.metadata:
            inner: type = f.metadata[_NESTED].config
            values = values_of(args, inner)
            if values:
                out[f.name] = inner(**values)
        elif _KEY in f.metadata and f.name in parsed:
            value = parsed[f.name]
            out[f.name] = tuple(value) if isinstance(value, list) else value
    return out


def build(args: argparse.Namespace, config: type[T]) -> T:
    """The `config` that parsed `args` describe: its constructor checks the values.

    Raises:
        ValueError: `config` (or a config it nests) refuses a value.
    """
    return config(**values_of(args, config))


def _build(parser: argparse.ArgumentParser, config: type[T], args: argparse.Namespace) -> T:
    """`config` from the parsed `args`; its ValueError is the command line's usage error.

    A config's constructor checks its values (ranges, names), so a bad value is refused
    the way argparse refuses a bad type: the usage, the message, exit status 2.
    """
    try:
        return build(args, config)
    except ValueError as e:
        parser.error(str(e))


def parse(
    config: type[T],
    argv: Sequence[str] | None,
    *,
    prog: str,
    description: str | None = None,
    verbatim: bool = False,
) -> T:
    """The `config` a command line describes: `config`'s flags, parsed and built.

    Args:
        config: a dataclass whose `option` fields are the command's flags.
        argv: the arguments (``None``: ``sys.argv[1:]``).
        prog: the command's name in the usage line (``python -m plait.bench.fidelity``).
        description: the text ``--help`` prints above the flags.
        verbatim: print `description` as written, not refilled: a module docstring with
            a command line or a list keeps its layout.

    Raises:
        SystemExit: ``--help`` (status 0), or a bad command line or a value `config`
            refuses with ValueError (status 2, with the usage and the message).
    """
    parser = parser_for(config, prog=prog, description=description, verbatim=verbatim)
    return _build(parser, config, parser.parse_args(argv))


def parser_for(
    config: type, *, prog: str, description: str | None = None, verbatim: bool = False
) -> argparse.ArgumentParser:
    """The parser `parse` reads `config`'s command line with (the docs' command-line
    reference and the flag freeze read the same one)."""
    layout = argparse.RawDescriptionHelpFormatter if verbatim else argparse.HelpFormatter
    parser = argparse.ArgumentParser(prog=prog, description=description, formatter_class=layout)
    add_options(parser, config)
    return parser


def parse_command(
    commands: Mapping[str, tuple[type, str]],
    argv: Sequence[str] | None,
    *,
    prog: str,
    description: str | None = None,
) -> object:
    """The config of the subcommand a command line names, built from its flags.

    Args:
        commands: each subcommand's name, its config dataclass and its one-line help.
        argv: the arguments (``None``: ``sys.argv[1:]``), the subcommand first.
        prog: the command's name in the usage line.
        description: the text ``--help`` prints above the subcommands.

    Returns:
        An instance of the named subcommand's config (tell which with ``isinstance``).

    Raises:
        SystemExit: as `parse` does, a missing or unknown subcommand included.
    """
    parser = command_parser(commands, prog=prog, description=description)
    args = parser.parse_args(argv)
    name = getattr(args, _COMMAND)
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return _build(sub.choices[name], commands[name][0], args)


def command_parser(
    commands: Mapping[str, tuple[type, str]], *, prog: str, description: str | None = None
) -> argparse.ArgumentParser:
    """The parser `parse_command` reads a command line of `commands` with: one subparser
    per subcommand, with its config's flags."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    sub = parser.add_subparsers(dest=_COMMAND, required=True)
    for name, (config, help) in commands.items():
        add_options(sub.add_parser(name, help=help), config)
    return parser
