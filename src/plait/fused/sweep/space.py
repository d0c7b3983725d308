"""Search spaces: what a sweep samples for each trial.

A search space is any callable ``space(trial) -> dict`` that asks an `optuna.Trial` for
values (``trial.suggest_float("lr", 1e-4, 1e-1, log=True)``) and returns the trial's
hyper-parameters. Three kinds ship here:

- `SearchSpace`: the built-in space of the ``plait sweep`` flags (learning-rate and
  weight-decay ranges, momentum, batch sizes, widths);
- `SpecSpace`: a space written as data (a JSON or TOML file, or a dict), so a sweep's space
  can be changed without writing Python;
- a user's own function, named on the command line as ``pkg.module:func`` or
  ``path/to/file.py:func`` (`load_space`).

How the sweep uses each returned key (optimizer option, batch size, model option) is
decided by `plait.fused.sweep.task.SweepTask`.

Spec format (JSON or TOML), one entry per hyper-parameter::

    lr = {low = 1e-4, high = 0.1, log = true}   # float range (log-uniform with log)
    weight_decay = {low = 1e-6, high = 1e-2, log = true}
    width = {low = 8, high = 32, step = 8}      # integer range: low and high are integers
    batch_size = [32, 64]                       # choices (also {choices = [32, 64]})
    momentum = 0.9                              # a fixed value
    betas = {value = [0.9, 0.99]}               # a fixed value that is itself a list
"""

from __future__ import annotations

import json
import tomllib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeAlias

import optuna

from plait.specs import import_target

#: A search space: returns one trial's hyper-parameters, sampled through the trial.
Space: TypeAlias = Callable[[optuna.Trial], Mapping[str, Any]]

#: File suffixes read as a spec (data) rather than imported as Python.
SPEC_SUFFIXES = (".json", ".toml")


@dataclass(frozen=True, kw_only=True)
class SearchSpace:
    """The space of ``plait sweep``'s flags.

    Attributes:
        lr: log-uniform range of the learning rate.
        weight_decay: log-uniform range of the weight decay.
        momentum: fixed momentum (SGD, RMSprop); None leaves it out, for optimizers
            without one (Adam, AdamW, Adagrad).
        batch_sizes: choices of batch size (non-fusible; one value means no choice).
        widths: choices of the model's ``width`` option (non-fusible); None keeps the
            workload's own default and leaves ``width`` out of the trial's parameters.
    """

    lr: tuple[float, float] = (1e-3, 1.0)
    weight_decay: tuple[float, float] = (1e-6, 1e-2)
    momentum: float | None = 0.9
    batch_sizes: Sequence[int] = (32,)
    widths: Sequence[int] | None = None

    def __post_init__(self) -> None:
        for name in ("lr", "weight_decay"):
            lo, hi = getattr(self, name)
            if not 0 < lo <= hi:
                raise ValueError(f"{name} range must satisfy 0 < low <= high, got {(lo, hi)}")
        if not self.batch_sizes or any(b < 1 for b in self.batch_sizes):
            raise ValueError(f"batch sizes must be >= 1, got {list(self.batch_sizes)}")
        if self.widths is not None and (not self.widths or any(w < 1 for w in self.widths)):
            raise ValueError(f"widths must be >= 1, got {list(self.widths)}")

    def suggest(self, trial: optuna.Trial) -> dict[str, Any]:
        """One trial's hyper-parameters."""
        params: dict[str, Any] = {
            "lr": trial.suggest_float("lr", *self.lr, log=True),
            "weight_decay": trial.suggest_float("weight_decay", *self.weight_decay, log=True),
        }
        if self.momentum is not None:
            params["momentum"] = self.momentum
        params["batch_size"] = _choose(trial, "batch_size", self.batch_sizes)
        if self.widths is not None:
            params["width"] = _choose(trial, "width", self.widths)
        return params

    __call__ = suggest


def _choose(trial: optuna.Trial, name: str, choices: Sequence[Any]) -> Any:
    """A categorical choice, or the value itself when there is only one (no search)."""
    return trial.suggest_categorical(name, list(choices)) if len(choices) > 1 else choices[0]


_RANGE_KEYS = {"low", "high", "log", "step"}


@dataclass(frozen=True)
class SpecSpace:
    """A space written as data: see the module docstring for the format.

    Args:
        spec: hyper-parameter name -> a fixed value, a list of choices, or a table with
            ``low``/``high`` (``log``, ``step``), ``choices`` or ``value``.
        source: where the spec came from, for error messages.
    """

    spec: Mapping[str, Any]
    source: str = "the search-space spec"

    def __post_init__(self) -> None:
        if not isinstance(self.spec, Mapping) or not self.spec:
            raise ValueError(f"{self.source}: expected a table of hyper-parameters")
        for name, entry in self.spec.items():
            self._check(name, entry)

    def _check(self, name: str, entry: Any) -> None:
        where = f"{self.source}: {name!r}"
        if isinstance(entry, list):
            if not entry:
                raise ValueError(f"{where}: an empty list of choices")
            return
        if not isinstance(entry, Mapping):
            return  # a fixed value
        keys = set(entry)
        if keys == {"value"}:
            return
        if keys == {"choices"}:
            if not isinstance(entry["choices"], list) or not entry["choices"]:
                raise ValueError(f"{where}: 'choices' must be a non-empty list")
            return
        if not {"low", "high"} <= keys or not keys <= _RANGE_KEYS:
            raise ValueError(
                f"{where}: expected a number, a list of choices, or a table with "
                f"low/high (and log, step), choices or value; got keys {sorted(keys)}"
            )
        lo, hi = entry["low"], entry["high"]
        if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in (lo, hi)):
            raise ValueError(f"{where}: low and high must be numbers, got {lo!r}, {hi!r}")
        if not lo <= hi or (entry.get("log") and lo <= 0):
            raise ValueError(
                f"{where}: expected low <= high (and low > 0 with log), got {lo!r}, {hi!r}"
            )

    def suggest(self, trial: optuna.Trial) -> dict[str, Any]:
        """One trial's hyper-parameters."""
        params: dict[str, Any] = {}
        for name, entry in self.spec.items():
            if isinstance(entry, list):
                params[name] = _choose(trial, name, entry)
            elif not isinstance(entry, Mapping):
                params[name] = entry
            elif "value" in entry:
                params[name] = entry["value"]
            elif "choices" in entry:
                params[name] = _choose(trial, name, entry["choices"])
            else:
                lo, hi, log = entry["low"], entry["high"], bool(entry.get("log", False))
                step = entry.get("step")
                if isinstance(lo, int) and isinstance(hi, int) and not isinstance(step, float):
                    params[name] = trial.suggest_int(name, lo, hi, step=step or 1, log=log)
                else:
                    params[name] = trial.suggest_float(name, lo, hi, step=step, log=log)
        return params

    __call__ = suggest


def read_spec(path: str | Path) -> SpecSpace:
    """A `SpecSpace` from a JSON or TOML file."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise ValueError(f"search-space file {str(path)!r} does not exist")
    try:
        text = p.read_text()
        spec = tomllib.loads(text) if p.suffix == ".toml" else json.loads(text)
    except (OSError, ValueError) as e:
        raise ValueError(f"search-space file {str(path)!r} does not parse: {e}") from e
    return SpecSpace(spec, source=str(path))


def _module(target: str) -> object:
    return import_target(target, what="search-space")


def load_space(spec: str) -> Space:
    """The space `spec` names: a JSON/TOML spec file, or ``module:func`` / ``file.py:func``.

    Raises:
        ValueError: the file is missing or does not parse, the module does not import, or
            the attribute is missing or not callable.
    """
    if spec.endswith(SPEC_SUFFIXES):
        return read_spec(spec)
    target, _, attr = spec.rpartition(":")
    if not target or not attr.isidentifier():
        raise ValueError(
            f"search space {spec!r}: expected a .json/.toml spec file, pkg.module:func or "
            "path/to/file.py:func"
        )
    func = getattr(_module(target), attr, None)
    if func is None:
        raise ValueError(f"search space {spec!r}: {target!r} has no attribute {attr!r}")
    if not callable(func):
        raise ValueError(f"search space {spec!r}: {attr!r} is not callable")
    return func  # type: ignore[no-any-return]
