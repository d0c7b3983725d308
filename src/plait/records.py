"""Typed result records, their provenance, and the one report writer.

Each result saved by plait carries where it came from: the git commit (``-dirty`` when
the tree had uncommitted changes), the command, torch's version and the machine
(`stamp`). Suites describe their results as `Record` dataclasses, whose `to_dict` is the
JSON they have always written, so files written before a field existed still load
(`Record.from_dict`) and readers of the JSON (scripts, the scorecard) need not change.

`write_report` is the one writer of a suite's ``results.json``, ``results.md`` and
``results.png`` (or another stem's three files); `write_json` and `write_markdown` write
one file each; plots go through `pyplot` (matplotlib on the file-only Agg backend,
imported on first use) and `save_figure`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from types import MappingProxyType
from typing import Any, ClassVar, Self, TypeVar

import torch

#: Field metadata key: leave the field out of the JSON while it is None.
OMIT_IF_NONE = "plait.records.omit_if_none"

#: Metadata of a record field written to the JSON only once it has a value, for keys
#: that plait's JSON has only sometimes: provenance before a record is stamped, a network
#: probe that did not run. ``field(default=None, metadata=ABSENT_IF_NONE)``; a field that
#: is None in a result but always written (``"nic_bytes_per_step": null``) is an ordinary
#: field with a None default.
ABSENT_IF_NONE: Mapping[str, Any] = MappingProxyType({OMIT_IF_NONE: True})

#: The provenance keys `stamp` adds; a record's JSON lists them last.
PROVENANCE = ("torch", "commit", "command", "machine")


def _plain(value: Any) -> Any:
    """`value` as JSON-ready data: records and dataclasses become dicts, recursively."""
    if hasattr(value, "to_dict"):
        return value.to_dict()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {k: _plain(v) for k, v in vars(value).items()}
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


@dataclass(kw_only=True)
class Record:
    """Base of plait's result records: provenance fields, and conversion to and from JSON.

    Subclasses are keyword-only dataclasses whose fields, in order, are the keys of the
    JSON record; `to_dict` writes the provenance keys last (as `stamp` always added them)
    and leaves out `ABSENT_IF_NONE` fields that are None. Keys the JSON carries but the
    record computes (derived figures) are named in `derived` and skipped by `from_dict`.
    """

    torch: str | None = field(default=None, metadata=ABSENT_IF_NONE)
    commit: str | None = field(default=None, metadata=ABSENT_IF_NONE)
    command: str | None = field(default=None, metadata=ABSENT_IF_NONE)
    machine: dict[str, Any] | None = field(default=None, metadata=ABSENT_IF_NONE)

    #: JSON keys `extra_keys` adds (computed figures); `from_dict` accepts and drops them.
    derived: ClassVar[tuple[str, ...]] = ()

    def to_dict(self) -> dict[str, Any]:
        """The record as its JSON object."""
        own: dict[str, Any] = {}
        prov: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None and f.metadata.get(OMIT_IF_NONE):
                continue
            (prov if f.name in PROVENANCE else own)[f.name] = _plain(value)
        return {**own, **self.extra_keys(), **prov}

    def extra_keys(self) -> dict[str, Any]:
        """Derived figures written after the fields (none by default)."""
        return {}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Self:
        """A record from its JSON object; keys the record does not know are an error
        (they would be lost on the way back), missing keys take the field's default."""
        names = {f.name for f in fields(cls) if f.init}
        unknown = set(data) - names - set(cls.derived)
        if unknown:
            raise ValueError(
                f"{cls.__name__} has no field(s) {', '.join(sorted(unknown))} "
                f"(known: {', '.join(sorted(names))})"
            )
        try:
            return cls(**{k: v for k, v in data.items() if k in names})
        except TypeError as exc:  # a required key is missing
            raise ValueError(f"{cls.__name__}: {exc}") from None

    def stamped(self, *, command: str | None = None) -> Self:
        """A copy carrying the provenance of this run (see `stamp`)."""
        return dataclasses.replace(self, **provenance(command=command))


def git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True, check=False
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            check=False,
        )
    except OSError:
        return "unknown"
    commit = out.stdout.strip() or "unknown"
    return commit + ("-dirty" if dirty.stdout.strip() else "")


def machine() -> dict[str, Any]:
    return {
        "host": platform.node(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def command_line() -> str:
    return " ".join(["plait", *sys.argv[1:]]) if sys.argv else "plait"


def pyplot() -> Any:
    """matplotlib's pyplot on the file-only Agg backend, imported when a plot is drawn (the
    import costs about a second, and most runs never plot)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: Path, *, dpi: int = 110, outside: Sequence[Any] = ()) -> Path:
    """Lay `fig` out, write it to `path` (creating the folder) and close it.

    `outside`: artists placed outside the axes (a legend below them) that the saved image
    must include.
    """
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    if outside:
        fig.savefig(path, dpi=dpi, bbox_extra_artists=list(outside), bbox_inches="tight")
    else:
        fig.savefig(path, dpi=dpi)
    pyplot().close(fig)
    return path


def provenance(*, command: str | None = None) -> dict[str, Any]:
    """torch's version, the git commit, the command and the machine of this run."""
    return {
        "torch": torch.__version__,
        "commit": git_commit(),
        "command": command or command_line(),
        "machine": machine(),
    }


R = TypeVar("R", bound=Record | dict[str, Any])


def stamp(records: Sequence[R], *, command: str | None = None) -> list[R]:
    """Add torch version, git commit, command and machine to every record (typed records
    get stamped copies, dicts merged copies)."""
    meta = provenance(command=command)
    out: list[Any] = []
    for r in records:
        out.append(dataclasses.replace(r, **meta) if isinstance(r, Record) else {**r, **meta})
    return out


def write_json(records: Sequence[Any] | Mapping[str, Any], path: Path, *, indent: int = 1) -> Path:
    """Write `records` (dicts or dataclasses with ``to_dict``), or one JSON object holding
    them, as indented JSON."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_plain(records), indent=indent, default=str) + "\n")
    return path


def write_markdown(text: str, path: Path) -> Path:
    """Write a Markdown report (creating the folder)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text if text.endswith("\n") else text + "\n")
    return path


def write_report(
    out: Path,
    records: Sequence[Any] | Mapping[str, Any],
    *,
    title: str,
    command: str,
    body: str,
    footer: str = "",
    plot: Callable[[Path], object] | None = None,
    indent: int = 2,
    stem: str = "results",
) -> dict[str, Path]:
    """Write a suite's report into `out`: ``results.json`` (the records), ``results.md``
    (a title, the command, `body` and `footer`) and, given `plot`, ``results.png``.

    Every benchmark writes the same three files the same way, so a reader (or a script
    comparing runs) finds the records, the command that made them and the picture in the
    same place whichever suite ran. `stem` names the files otherwise, for a report that
    sits beside another in one folder (the memory benchmark's ``memory.*`` beside a
    ``plait bench`` job's ``results.*``). Returns the paths by kind (json, markdown, png).
    """
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / f"{stem}.json", "markdown": out / f"{stem}.md"}
    write_json(records, paths["json"], indent=indent)
    write_markdown(f"# {title}\n\nCommand: `{command}`\n\n{body}{footer}", paths["markdown"])
    if plot is not None:
        paths["png"] = out / f"{stem}.png"
        plot(paths["png"])
    return paths
