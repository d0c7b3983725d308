"""Typed records, provenance and the one report writer."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import pytest

from plait.records import ABSENT_IF_NONE, Record, stamp, write_report


@dataclass(kw_only=True)
class _Row(Record):
    name: str
    value: float | None = None  # always written, null or not
    probe: dict[str, Any] | None = field(default=None, metadata=ABSENT_IF_NONE)

    derived: ClassVar[tuple[str, ...]] = ("double",)

    def extra_keys(self) -> dict[str, Any]:
        return {"double": None if self.value is None else 2 * self.value}


def test_to_dict_writes_fields_in_order_then_derived_then_provenance() -> None:
    row = _Row(name="a", value=1.5, commit="abc")
    assert list(row.to_dict()) == ["name", "value", "double", "commit"]
    assert _Row(name="a").to_dict() == {"name": "a", "value": None, "double": None}
    assert _Row(name="a", probe={"world": 2}).to_dict()["probe"] == {"world": 2}


def test_from_dict_round_trips_and_names_unknown_or_missing_keys() -> None:
    row = _Row(name="a", value=2.0, probe={"x": 1}, torch="2.13", machine={"cpus": 2})
    assert _Row.from_dict(row.to_dict()) == row
    with pytest.raises(ValueError, match=r"no field.*colour"):
        _Row.from_dict({"name": "a", "colour": "red"})
    with pytest.raises(ValueError, match="name"):
        _Row.from_dict({"value": 1.0})


def test_stamp_adds_provenance_to_records_and_dicts() -> None:
    (row,) = stamp([_Row(name="a")], command="plait bench")
    (plain,) = stamp([{"name": "b"}], command="plait bench")
    assert row.command == "plait bench" and row.commit
    assert row.machine is not None and row.torch
    assert plain["command"] == "plait bench" and set(plain) >= {"torch", "commit", "machine"}
    assert list(row.to_dict())[-4:] == ["torch", "commit", "command", "machine"]


def test_write_report_writes_json_markdown_and_plot(tmp_path: Path) -> None:
    drawn: list[Path] = []

    def plot(path: Path) -> None:
        path.write_bytes(b"png")
        drawn.append(path)

    rows = [_Row(name="a", value=1.0)]
    out = tmp_path / "out"
    paths = write_report(
        out, rows, title="T", command="plait x", body="| a |\n", footer="\nend\n", plot=plot
    )
    assert json.loads(paths["json"].read_text()) == [rows[0].to_dict()]
    assert paths["markdown"].read_text() == "# T\n\nCommand: `plait x`\n\n| a |\n\nend\n"
    assert drawn == [paths["png"]]
    assert "png" not in write_report(tmp_path / "b", [], title="T", command="", body="")


def test_write_report_names_its_files_after_a_stem(tmp_path: Path) -> None:
    paths = write_report(
        tmp_path, [], title="T", command="c", body="", plot=lambda p: p.write_bytes(b""), stem="m"
    )
    names = {"json": "m.json", "markdown": "m.md", "png": "m.png"}
    assert paths == {kind: tmp_path / name for kind, name in names.items()}
    assert all(p.is_file() for p in paths.values())
