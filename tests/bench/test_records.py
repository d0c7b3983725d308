"""The typed records read and write exactly the JSON the suites have committed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from plait.bench.records import (
    BenchRecord,
    Comparison,
    ConvergenceReport,
    FidelityRecord,
    FusedRecord,
    KernelReport,
    MemoryRecord,
    ScoreRow,
    TimelineRow,
)
from plait.records import Record

ROOT = Path(__file__).resolve().parents[2] / "benchmarks"


def _kind(row: dict[str, Any]) -> type[Record] | None:
    if "modes" in row:
        return Comparison
    if "throughput" in row:
        return FusedRecord
    if "overlap_efficiency" in row:
        return BenchRecord
    return None  # fidelity, sweeps, kernels: other records


def _same(back: Any, row: Any) -> bool:
    """`back` holds `row`'s keys and values, and more keys only where they are null."""
    if isinstance(row, dict):
        return (
            isinstance(back, dict)
            and all(k in back and _same(back[k], v) for k, v in row.items())
            and all(back[k] is None for k in set(back) - set(row))
        )
    if isinstance(row, list):
        return isinstance(back, list) and len(back) == len(row) and all(map(_same, back, row))
    return bool(back == row)


def _committed() -> list[Path]:
    found = []
    for path in sorted(ROOT.glob("**/results.json")):
        rows = json.loads(path.read_text())
        if isinstance(rows, list) and rows and _kind(rows[0]) is not None:
            found.append(path)
    return found


@pytest.mark.skipif(not ROOT.is_dir(), reason="no committed benchmark results")
def test_committed_results_round_trip() -> None:
    """Every committed record loads, and writes back the same keys and values; files from
    before a field existed gain only that field, as null."""
    paths = _committed()
    assert paths
    for path in paths:
        for row in json.loads(path.read_text()):
            kind = _kind(row)
            assert kind is not None
            assert _same(kind.from_dict(row).to_dict(), row), path


def test_today_records_keep_the_key_order_of_the_json() -> None:
    row = json.loads((ROOT / "dp/cpu-accounting/cnn-r32/results.json").read_text())[0]
    assert list(BenchRecord.from_dict(row).to_dict()) == list(row)


#: Committed files of the suites whose JSON is one object or a list of another record:
#: (glob under benchmarks/, the record of the object or of each list item).
OTHER_KINDS: list[tuple[str, type[Record]]] = [
    ("dp/fidelity*/results*.json", FidelityRecord),
    ("kfac/fidelity/results.json", ConvergenceReport),
    ("kfac/kernels-*/results.json", KernelReport),
    ("parallel/**/memory.json", MemoryRecord),
    ("parallel/scorecard.json", ScoreRow),
]


@pytest.mark.skipif(not ROOT.is_dir(), reason="no committed benchmark results")
@pytest.mark.parametrize(("pattern", "kind"), OTHER_KINDS, ids=[p for p, _ in OTHER_KINDS])
def test_other_committed_results_write_back_identically(pattern: str, kind: type[Record]) -> None:
    """These files load into their records and write back to the same JSON text: every
    key, value and key order (floats and ints kept as they were read)."""
    paths = sorted(ROOT.glob(pattern))
    assert paths, pattern
    for path in paths:
        data = json.loads(path.read_text())
        back = (
            [kind.from_dict(r).to_dict() for r in data]
            if isinstance(data, list)
            else (kind.from_dict(data).to_dict())
        )
        assert json.dumps(back, indent=1) == json.dumps(data, indent=1), path


def test_a_record_refuses_keys_it_would_lose() -> None:
    with pytest.raises(ValueError, match=r"no field.*peak"):
        ScoreRow.from_dict({"workload": "gpt", "peak": 1})
    with pytest.raises(ValueError, match="KernelRecord"):
        KernelReport.from_dict({"meta": {"workload": "mlp"}, "layers": [{"layer": "fc"}]})


def test_timeline_rows_are_flat_with_the_report_columns() -> None:
    row = {"strategy": "s", "phase": "step", "step": 1.5, "gradient comm": 0.5, "inversion": 0.1}
    typed = TimelineRow.from_dict(row)
    assert typed.busy == {"gradient comm": 0.5, "inversion": 0.1}
    assert list(typed.to_dict().items()) == list(row.items())
