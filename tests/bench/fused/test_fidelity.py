from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from plait import cli
from plait.bench.fused import fidelity


def test_fused_members_follow_stock_models_to_float32_rounding(tmp_path: Path) -> None:
    """Three MLPs (per-model rates), 3 steps of each optimizer, through `plait bench-fused
    --fidelity`. The bound on fused vs stock float32 is the benchmark's goal, 1e-5: a
    member that trained on another member's batch or rate is off by 1e-2 or more after one
    step. In float64 both compute the same function, so they agree to float64 rounding
    (1e-12 leaves room for a few hundred reorderings of sums of terms near 1); float32
    itself is off float64 by far more than that (so the distance is measured, not zero by
    construction)."""
    threads = torch.get_num_threads()
    argv = ["bench-fused", "--fidelity", "3", "--workload", "mlp", "--n", "3"]
    assert cli.main([*argv, "--out", str(tmp_path)]) == 0
    assert torch.get_num_threads() == threads  # measured on one thread, then restored
    record = json.loads((tmp_path / "fidelity.json").read_text())
    rows = record["results"]
    assert [r["optimizer"] for r in rows] == ["sgd", "adam"]
    for r in rows:
        assert r["n"] == 3 and r["steps"] == 3
        assert r["fused_vs_stock"] < 1e-5
        assert r["fused64_vs_stock64"] < 1e-12
        assert r["stock32_vs_stock64"] > 1e-9
    assert "| mlp | adam | 3 | 3 |" in (tmp_path / "fidelity.md").read_text()
    assert {"command", "torch", "commit", "machine"} <= set(record)  # the run's provenance


def test_bad_fidelity_input_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match="optimizer 'lamb': choose from sgd, adam"):
        fidelity.measure("mlp", n=2, steps=1, optimizers=["lamb"])
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench-fused", "--fidelity", "0", "--workload", "mlp"])
    assert (
        exc.value.code == 2 and "--fidelity 0: expected an integer >= 1" in capsys.readouterr().err
    )


def test_a_tensor_training_never_moves_is_judged_at_its_members_scale() -> None:
    """Rounding noise in a tensor whose true gradient is zero (BERT's attention key
    biases, near 1e-9) read O(1) relative to itself; against a thousandth of its member's
    largest value it reads as the noise it is. A real difference in a moved tensor still
    counts in full."""
    weight = torch.ones(4)
    stock = {"w": weight, "key_bias": torch.full((4,), 1e-9)}
    noisy = {"w": weight.clone(), "key_bias": torch.full((4,), 3e-9)}
    assert fidelity._rel(noisy["key_bias"], stock["key_bias"]) == pytest.approx(2.0)
    assert fidelity._distance([noisy], [stock]) == pytest.approx(2e-9 / fidelity.SCALE_FLOOR)
    off = {"w": weight + 1e-3, "key_bias": stock["key_bias"]}
    assert fidelity._distance([off], [stock]) == pytest.approx(1e-3, rel=1e-4)  # fp32 1 + 1e-3
