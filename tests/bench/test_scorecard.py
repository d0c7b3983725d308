"""The planner's scorecard: the choice against the measured-fastest plan that fits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from plait.bench.records import ScoreRow
from plait.bench.scorecard import main, markdown, score


def test_scorecard_compares_the_choice_with_the_fastest_fitting_plan() -> None:
    def rec(spec: str, desc: str, times: list[float], bw: str = "slow") -> dict[str, object]:
        return {
            "workload": "gpt",
            "bandwidth": bw,
            "strategy_spec": spec,
            "strategy_desc": desc,
            "iter_time_s": sorted(times)[len(times) // 2],
            "iter_times_s": times,
        }

    pp4 = "plan:dp=1,pp=4,microbatches=8"
    records = [
        rec("plan:dp=4", "plan:dp=4", [1.0]),
        rec("plan:pp=4", pp4, [2.0]),
        rec("plan:dp=2,pp=2", "plan:dp=2,pp=2,microbatches=4", [2.1]),
        rec("plan:auto=true", pp4, [2.1]),
        rec("plan:auto=true,memory=100MiB", pp4, [2.1]),
        # a noisy run of the fastest plan is still the fastest plan
        rec("plan:pp=4", pp4, [1.0], bw="fast"),
        rec("plan:dp=4", "plan:dp=4", [1.05], bw="fast"),
        rec("plan:auto=true", pp4, [1.3, 1.4, 1.5], bw="fast"),
        # not the fastest: its pooled median decides
        rec("plan:auto=true,memory=100MiB", "plan:dp=2,pp=2,microbatches=4", [2.2], bw="slow"),
    ]
    peaks = {
        "dp=4": 200 * 2**20,
        "dp=1,pp=4,microbatches=8": 80 * 2**20,
        "dp=2,pp=2,microbatches=4": 90 * 2**20,
    }
    free, tight, other, noisy = score(records, peaks)
    assert (free.fastest_fitting, free.within_tolerance) == ("dp=4", False)
    assert (tight.fastest_fitting, tight.within_tolerance) == (pp4[5:], True)
    assert tight.fits_measured is True
    # the explicit run (2.1) and the automatic one (2.2) pool to 2.15: 1.075x of 2.0
    assert (other.is_fastest, other.within_tolerance) == (False, True)
    assert other.ratio == pytest.approx(2.15 / 2.0)
    assert (noisy.is_fastest, noisy.within_tolerance) == (True, True)
    assert "3 of 4 settings" in markdown([free, tight, other, noisy])


def test_main_reads_bench_and_memory_files_and_writes_both_reports(tmp_path: Path) -> None:
    def rec(spec: str, desc: str, t: float) -> dict[str, object]:
        return {
            "workload": "gpt",
            "bandwidth": "fast",
            "strategy_spec": spec,
            "strategy_desc": desc,
            "iter_time_s": t,
        }

    results, memory, out = tmp_path / "r.json", tmp_path / "memory.json", tmp_path / "s.md"
    rows = [rec("plan:dp=2", "plan:dp=2", 1.0), rec("plan:auto=true", "plan:dp=2", 1.02)]
    results.write_text(json.dumps(rows))
    mem = {
        "workload": "gpt",
        "plan": "dp=2",
        "world": 2,
        "global_batch": 8,
        "model_state_bytes": [10, 10],
        "peak_bytes": [30, 40],
        "predicted_model_state_bytes": 10,
        "predicted_peak_bytes": 35,
        "unsharded_model_state_bytes": 10,
        "model_state_fraction": 1.0,
    }
    memory.write_text(json.dumps([mem]))
    assert main([str(results), "--memory", str(memory), "--out", str(out)]) == 0
    (row,) = [ScoreRow.from_dict(r) for r in json.loads(out.with_suffix(".json").read_text())]
    assert (row.chosen, row.is_fastest, row.chosen_peak_bytes) == ("dp=2", True, 40)
    assert "1 of 1 settings" in out.read_text()
