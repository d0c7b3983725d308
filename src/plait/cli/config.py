"""TOML run configs: a file of flag values under the command line's own (``--config``)."""

from __future__ import annotations

import argparse
import tomllib
from collections.abc import Callable
from pathlib import Path

# ---------------------------------------------------------------------------- run configs
#: Parser entries a run config may not set: they steer the parser or this process itself.
_NOT_CONFIGURABLE = frozenset({"help", "config", "debug", "version", "verbose", "quiet"})


def subcommand(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            child: argparse.ArgumentParser = action.choices[name]
            return child
    raise AssertionError(f"no subcommand {name!r}")


def _config_flags(sub: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """The flags of a subcommand a run config may set, by long name with underscores
    (``no_progress`` for ``--no-progress``, whose destination ``progress`` would read the
    other way round)."""
    out = {}
    for a in sub._actions:
        if a.option_strings and a.dest not in _NOT_CONFIGURABLE:
            out[max(a.option_strings, key=len).lstrip("-").replace("-", "_")] = a
    return out


def _config_value(where: str, key: str, value: object, action: argparse.Action) -> object:
    """A TOML value as the flag's parsed value; ValueError naming the key otherwise."""
    if action.nargs == 0:  # an on/off switch
        if not isinstance(value, bool):
            raise ValueError(f"{where}: key {key!r}: expected true or false, got {value!r}")
        return action.const if value else action.default  # store_false flips it
    if isinstance(value, list):
        # a list of names stands for the flag's comma-separated text; strategy specs whose
        # options hold commas are separated by ';', as on the command line
        if action.type is not None or not all(isinstance(v, str) for v in value):
            raise ValueError(f"{where}: key {key!r}: expected one value, got a list")
        sep = ";" if action.dest == "strategies" and any("," in v for v in value) else ","
        value = sep.join(value)
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise ValueError(f"{where}: key {key!r}: expected a {_kind(action)}, got {value!r}")
    if action.type is None:
        value = str(value)
    elif action.type is int and isinstance(value, float):
        raise ValueError(f"{where}: key {key!r}: expected an integer, got {value!r}")
    elif not isinstance(value, str) and action.type in (int, float):
        value = action.type(value)
    else:
        convert: Callable[[str], object] = action.type  # type: ignore[assignment]
        try:
            value = convert(str(value))
        except (ValueError, TypeError, argparse.ArgumentTypeError) as exc:
            raise ValueError(f"{where}: key {key!r}: {exc}") from None
    if action.choices is not None and value not in action.choices:
        choices = ", ".join(map(str, action.choices))
        raise ValueError(f"{where}: key {key!r}: {value!r} is not one of {choices}")
    return value


def _kind(action: argparse.Action) -> str:
    if action.type is int:
        return "integer"
    return "number" if action.type is float else "string"


def load_run_config(path: str, sub: argparse.ArgumentParser) -> dict[str, object]:
    """The flag values a TOML run config sets for subcommand `sub`, by destination.

    Keys are the subcommand's flag names without the leading dashes, with dashes or
    underscores (``batch-size`` or ``batch_size``); values are TOML strings, numbers or
    booleans, and lists of strings for the comma-separated flags. Raises ValueError naming
    an unknown key (with the accepted ones) or a value the flag would refuse.
    """
    where = f"--config {path}"
    try:
        data = tomllib.loads(Path(path).expanduser().read_text())
    except FileNotFoundError:
        raise ValueError(f"{where}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{where}: cannot be read ({exc})") from None
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{where}: not valid TOML: {exc}") from None
    flags = _config_flags(sub)
    values: dict[str, object] = {}
    for key, value in data.items():
        action = flags.get(key.replace("-", "_"))
        if action is None:
            accepted = ", ".join(sorted(d.replace("_", "-") for d in flags))
            raise ValueError(f"{where}: unknown key {key!r} (accepted: {accepted})")
        if action.dest in values:
            raise ValueError(f"{where}: key {key!r} given twice (dashes and underscores)")
        values[action.dest] = _config_value(where, key, value, action)
    return values
