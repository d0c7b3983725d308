"""The fidelity suite checks its inputs before any cluster, and tabulates typed records."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from plait.bench import fidelity
from plait.bench.records import FidelityRecord
from plait.cluster import Cluster


def _record(workload: str, strategy: str, acc: float | None, loss: float = 0.5) -> FidelityRecord:
    return FidelityRecord(
        workload=workload,
        strategy=strategy,
        epochs=2,
        nodes=4,
        data="digits",
        steps=22,
        batch_size=32,
        test_loss=loss,
        test_accuracy=acc,
        history=[{"epoch": 0, "test_accuracy": acc}],
    )


def test_the_table_compares_every_row_with_its_workloads_first() -> None:
    text = fidelity.markdown(
        [
            _record("mlp", "ssgd", 0.9),
            _record("mlp", "acpsgd:rank=4", 0.885),
            _record("gpt", "ssgd", 0.4),
            _record("gpt", "fp16", None),  # a workload without accuracy
        ]
    )
    assert "| mlp | digits | 2 | ssgd | 0.5000 | 90.00% | +0.00 pt |" in text
    assert "| mlp | digits | 2 | acpsgd:rank=4 | 0.5000 | 88.50% | -1.50 pt |" in text
    assert "| gpt | digits | 2 | ssgd | 0.5000 | 40.00% | +0.00 pt |" in text
    assert "| gpt | digits | 2 | fp16 | 0.5000 | - | - |" in text


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"workloads": ["no-such-workload"], "strategies": ["ssgd"]}, "no-such-workload"),
        ({"workloads": ["mlp"], "strategies": ["acpsgd:rnak=4"]}, "rnak"),
        ({"workloads": ["mlp"], "strategies": ["ssgd"], "epochs": 0}, "epochs"),
    ],
)
def test_bad_inputs_fail_before_a_cluster_is_built(
    kwargs: dict[str, Any], match: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_cluster(**_: Any) -> None:
        raise AssertionError("a cluster was built for inputs that cannot run")

    monkeypatch.setattr(Cluster, "create", no_cluster)
    with pytest.raises(ValueError, match=match):
        fidelity.run_fidelity(**kwargs)


def test_main_writes_the_records_and_the_table(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: dict[str, Any] = {}

    def fake_run(**kwargs: Any) -> list[FidelityRecord]:
        seen.update(kwargs)
        return [
            _record("mlp", s, 0.9).stamped(command=kwargs["command"]) for s in kwargs["strategies"]
        ]

    monkeypatch.setattr(fidelity, "run_fidelity", fake_run)
    argv = [
        "--workload",
        "mlp",
        "--strategies",
        "ssgd;powersgd:rank=4,warmup=2",
        "--out",
        str(tmp_path),
    ]
    assert fidelity.main(argv) == 0
    assert seen["strategies"] == ["ssgd", "powersgd:rank=4,warmup=2"]
    rows = json.loads((tmp_path / "results.json").read_text())
    assert [FidelityRecord.from_dict(r).strategy for r in rows] == seen["strategies"]
    assert rows[0]["command"].startswith("python -m plait.bench.fidelity ")
    text = (tmp_path / "results.md").read_text()
    assert text.startswith("# Fidelity\n\nCommand: `python -m plait.bench.fidelity ")
    assert "| powersgd:rank=4,warmup=2 |" in text
