"""The timeline breakdown attributes spans to steps and counts overlapping spans once."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import pytest

from plait.bench.timeline import breakdown, markdown
from plait.trace import COMM, COMPUTE, FACTOR, INVERSE, PRECONDITION


def _span(name: str, cat: str, ts: float, dur: float, pid: int = 0, **args: Any) -> dict[str, Any]:
    return {"name": name, "cat": cat, "ph": "X", "ts": ts, "dur": dur, "pid": pid, "args": args}


def _trace() -> dict[str, Any]:
    """Two ranks, one step each (0..10 s), plus a span outside every step."""
    events = []
    for pid in (0, 1):
        events += [
            _span("forward", COMPUTE, 0.0, 2e6, pid, strategy="s", phase="step"),
            _span("factors[0]", FACTOR, 1e6, 1e6, pid),
            _span("factors.allreduce", COMM, 2e6, 3e6, pid),
            _span("factors.allreduce", COMM, 3e6, 3e6, pid),  # overlaps the one above
            _span("inverse.broadcast", COMM, 6e6, 1e6, pid),
            _span("grads.allreduce", COMM, 4e6, 1e6, pid),
            _span("invert", INVERSE, 5e6, 2e6 * (pid + 1), pid),
            _span("precondition", PRECONDITION, 8e6, 1e6, pid),
            _span("optimizer", COMPUTE, 9e6, 1e6, pid, strategy="s", phase="step"),
        ]
    events.append(_span("factors.allreduce", COMM, 20e6, 5e6, 0))  # after the step
    return {"traceEvents": events}


def test_breakdown_unions_overlaps_and_averages_ranks() -> None:
    (row,) = breakdown(_trace())
    assert (row.strategy, row.phase) == ("s", "step")
    assert row.step == pytest.approx(10.0)
    busy = row.busy
    assert busy["factor comm"] == pytest.approx(4.0)  # [2, 6) counted once, not 6 s
    assert busy["inverse comm"] == pytest.approx(1.0)
    assert busy["gradient comm"] == pytest.approx(1.0)
    assert busy["inversion"] == pytest.approx(3.0)  # ranks: 2 s and 4 s
    assert busy["preconditioning"] == pytest.approx(1.0)
    assert busy["forward+backward"] == pytest.approx(3.0)
    assert "| s | step | 10.00 |" in markdown([row])
    # the JSON row is flat, the step's wall time first, then the columns in report order
    assert list(row.to_dict())[:4] == ["strategy", "phase", "step", "forward+backward"]


def test_reads_plain_and_gzipped_trace_files(tmp_path: Path) -> None:
    plain, packed = tmp_path / "t.json", tmp_path / "t.json.gz"
    plain.write_text(json.dumps(_trace()))
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    assert breakdown(plain) == breakdown(packed) == breakdown(_trace())
