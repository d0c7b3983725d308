"""The memory benchmark's records, table and files (the scorecard reads the files back)."""

from __future__ import annotations

import json
from pathlib import Path

from plait.bench import membench
from plait.bench.records import MemoryRecord
from plait.parallel.memory import format_bytes

MIB = 2**20


def _record(plan: str, peaks: list[int], states: list[int]) -> MemoryRecord:
    return MemoryRecord(
        workload="gpt",
        plan=plan,
        world=len(peaks),
        global_batch=8,
        model_state_bytes=states,
        peak_bytes=peaks,
        predicted_model_state_bytes=30 * MIB,
        predicted_peak_bytes=90 * MIB,
        unsharded_model_state_bytes=100 * MIB,
        model_state_fraction=max(states) / (100 * MIB),
        torch="2.x",
    )


def test_the_table_reports_the_largest_rank() -> None:
    rec = _record("dp=2,fsdp=true", [80 * MIB, 95 * MIB], [25 * MIB, 30 * MIB])
    line = membench.markdown([rec]).splitlines()[2]
    assert line.startswith(
        f"| `dp=2,fsdp=true` | {format_bytes(95 * MIB)} | {format_bytes(90 * MIB)} |"
    )
    # 0.3 of the unsharded state per rank, 0.6 of it over the two ranks
    assert line.endswith("| 0.300 | 0.60 |")


def test_written_files_load_back_as_records(tmp_path: Path) -> None:
    records = [_record("dp=4", [200 * MIB] * 4, [100 * MIB] * 4), _record("pp=2", [1, 2], [3, 4])]
    paths = membench.write(
        records, tmp_path, command="plait run --nodes 4 -m -- plait.bench.membench"
    )
    assert paths["json"] == tmp_path / "memory.json"
    rows = json.loads(paths["json"].read_text())
    assert [MemoryRecord.from_dict(r) for r in rows] == records
    assert list(rows[0])[-1] == "torch"  # the key order of the committed files
    text = paths["markdown"].read_text()
    assert text.startswith("# Memory per rank\n\nCommand: `plait run --nodes 4")
    assert "| `pp=2` |" in text
