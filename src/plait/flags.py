"""Command-line flags generated from a typed config: the config is the schema.

A config dataclass declares each field a user may set with `option`, which keeps the
flag's help (and, where the type does not say it, its metavar, choices or a mutually
exclusive group) beside the field's type and default. `add_options` then writes the
flags into an argparse parser, and `values_of` reads a parsed namespace back into the
config's keyword arguments, so a field is declared once and its flag, default, type,
choices and help cannot drift from it (`plait train` and ``python -m plait.train`` both
build their flags from `plait.train.config.TrainConfig`).

The flag of field ``batch_size`` is ``--batch-size``; its type is the field's, with
``None`` dropped (``int | None`` parses as ``int``; the first of ``str``, ``int`` and
``float`` in a union is taken); a ``Literal`` type gives the choices. A boolean field that
defaults to True is turned off by ``--no-<name>``; one that defaults to False is turned on
by ``--<name>``. Fields without `option` have no flag.
"""

from __future__ import annotations

import argparse
import types
import typing
from collections.abc import Sequence
from dataclasses import Field, dataclass, field, fields
from typing import Any, Literal

_KEY = "plait.flag"


@dataclass(frozen=True)
class Option:
    """How one config field appears on the command line (see `option`)."""

    help: str
    metavar: str | None = None
    choices: tuple[str, ...] | None = None
    exclusive: str | None = None


def option(
    default: Any,
    help: str,
    *,
    metavar: str | None = None,
    choices: Sequence[str] | None = None,
    exclusive: str | None = None,
) -> Any:
    """A dataclass field with a flag: `default`, and the flag's `help`.

    Args:
        default: the field's default (also the flag's).
        help: the flag's help text.
        metavar: the value's name in the usage line (default: argparse's).
        choices: allowed values, where the field's type is a plain ``str``.
        exclusive: fields naming the same group are mutually exclusive flags.
    """
    meta = Option(help, metavar, None if choices is None else tuple(choices), exclusive)
    return field(default=default, metadata={_KEY: meta})


def _scalar(hint: Any) -> tuple[type, tuple[str, ...] | None]:
    """The type a flag parses into, and its choices where the hint is a ``Literal``."""
    if typing.get_origin(hint) is Literal:
        values = typing.get_args(hint)
        return type(values[0]), tuple(str(v) for v in values)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        for arg in typing.get_args(hint):
            if arg in (str, int, float, bool) or typing.get_origin(arg) is Literal:
                return _scalar(arg)
        raise TypeError(f"no flag type in {hint!r}")
    if hint in (str, int, float, bool):
        return hint, None
    raise TypeError(f"no flag type for {hint!r}")


def _flagged(config: type) -> list[tuple[Field[Any], Option, Any]]:
    """`config`'s fields declared with `option`: the field, its flag and its type hint."""
    hints = typing.get_type_hints(config)
    return [(f, f.metadata[_KEY], hints[f.name]) for f in fields(config) if _KEY in f.metadata]


def add_options(parser: argparse.ArgumentParser, config: type) -> None:
    """Add a flag for every `option` field of the dataclass `config`.

    Raises:
        TypeError: a field's type has no flag form (a programming error in the config).
    """
    groups: dict[str, Any] = {}
    for f, meta, hint in _flagged(config):
        default = f.default  # `option` always gives one
        target: Any = parser
        if meta.exclusive is not None:
            if meta.exclusive not in groups:
                groups[meta.exclusive] = parser.add_mutually_exclusive_group()
            target = groups[meta.exclusive]
        name = f.name.replace("_", "-")
        kind, choices = _scalar(hint)
        if kind is bool:
            if default:
                target.add_argument(
                    f"--no-{name}", dest=f.name, action="store_false", help=meta.help
                )
            else:
                target.add_argument(f"--{name}", action="store_true", help=meta.help)
            continue
        kw: dict[str, Any] = {"default": default, "help": meta.help}
        if kind is not str:
            kw["type"] = kind
        if meta.choices or choices:
            kw["choices"] = list(meta.choices or choices or ())
        if meta.metavar is not None:
            kw["metavar"] = meta.metavar
        target.add_argument(f"--{name}", **kw)


def values_of(args: argparse.Namespace, config: type) -> dict[str, Any]:
    """The parsed values of `config`'s flagged fields, by field name (those present)."""
    parsed = vars(args)
    return {f.name: parsed[f.name] for f, _, _ in _flagged(config) if f.name in parsed}
