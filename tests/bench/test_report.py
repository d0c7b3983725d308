"""The `plait bench` report: the table, and the files it writes."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from plait.bench.records import BenchRecord
from plait.bench.report import markdown_table, write_reports
from plait.records import stamp


def _record(**changes: Any) -> BenchRecord:
    rec = BenchRecord(
        workload="mlp",
        strategy="ssgd",
        strategy_spec="ssgd",
        strategy_desc="ssgd",
        nodes=2,
        nproc_per_node=1,
        world_size=2,
        bandwidth="slow",
        rate="100mbit",
        batch_size=8,
        params=10,
        steps=3,
        warmup=1,
        iter_time_s=0.5,
        iter_time_min_s=0.4,
        iter_time_max_s=0.6,
        iter_times_s=[0.4, 0.5, 0.6],
        compute_time_s=0.25,
        compute_times_s=[0.25] * 3,
        comm_lower_bound_s=0.1,
        overlap_efficiency=0.5,
        payload_bytes_per_step=1e6,
        bytes_per_step=2e6,
        nic_bytes_per_step=None,
        samples_per_s=32.0,
        threads=1,
    )
    return dataclasses.replace(rec, **changes)


def test_table_shows_added_cpu_and_ratios_to_the_first_strategy() -> None:
    measured = _record(cpu_time_s=0.273, compute_cpu_time_s=0.206)
    slower = _record(strategy_spec="fp16", iter_time_s=1.0)
    lines = markdown_table([measured, slower]).splitlines()
    assert lines[-2].endswith("| 273 (+67) |") and "| 1.00x |" in lines[-2]
    assert "| 0.50x |" in lines[-1] and "| fp16 |" in lines[-1]
    # records from before CPU accounting still render, from JSON as well
    assert markdown_table([_record().to_dict()]).splitlines()[-1].endswith("| - |")


def test_reports_hold_the_records_the_command_and_the_machine(tmp_path: Path) -> None:
    records = stamp([_record(cpu_time_s=0.3, compute_cpu_time_s=0.2)], command="plait bench x")
    paths = write_reports(records, tmp_path)
    (saved,) = json.loads(paths["json"].read_text())
    assert saved == records[0].to_dict() and saved["command"] == "plait bench x"
    md = paths["markdown"].read_text()
    assert md.startswith("# Benchmark results\n\nCommand: `plait bench x`\n\n| workload |")
    assert f"commit {saved['commit']}, torch {saved['torch']}" in md
    assert paths["png"].stat().st_size > 1000
