"""The K-FAC kernel benchmark times every layer and writes its tables."""

from __future__ import annotations

import json
from pathlib import Path

from plait.bench import kfac_kernels
from plait.bench.records import KernelReport
from plait.kfac.layers import make_layer
from plait.workloads import get_workload


def test_every_layer_of_the_model_is_timed(tmp_path: Path) -> None:
    wl = get_workload("mlp")
    data = wl.bench_data(4)
    model = wl.model(data.info, bench=True)
    expected = [n for n, m in model.named_modules() if make_layer(n, m) is not None]
    assert kfac_kernels.main(["--workload", "mlp", "--repeats", "1", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "results.json").read_text())
    assert KernelReport.from_dict(report).meta.workload == "mlp"
    layers = report["layers"]
    assert [r["layer"] for r in layers] == expected
    for r in layers:
        assert all(r[k] > 0 for k in r if k.endswith("_s"))
    text = (tmp_path / "results.md").read_text()
    assert text.startswith("# K-FAC kernels on mlp's layers, one core\n\nCommand: `")
    for title in ("A factor", "decomposition", "preconditioning"):
        assert f"| {title}" in text
