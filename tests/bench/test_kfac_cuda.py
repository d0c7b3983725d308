"""`plait.bench.kfac_cuda`: its entries on the CPU, and its refusal without CUDA."""

from __future__ import annotations

import pytest
import torch

from plait.bench import kfac_cuda


def test_refuses_without_cuda(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        kfac_cuda.measure(workload="mlp")
    assert kfac_cuda.main(["--workload", "mlp"]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err


def test_markdown_names_every_entry() -> None:
    rows = [
        {"label": label, "median_s": 0.01 * (i + 1), "min_s": 0.01, "max_s": 0.05,
         "vs_sgd": float(i + 1)}
        for i, (label, *_) in enumerate(kfac_cuda.ENTRIES)
    ]  # fmt: skip
    meta = {"workload": "mlp", "batch": 16, "device_name": "GPU", "torch": "2", "steps": 3,
            "warmup": 1}  # fmt: skip
    text = kfac_cuda.markdown(rows, meta)
    assert all(f"| {label} |" in text for label, *_ in kfac_cuda.ENTRIES)
    assert "| 20.00 |" in text and "2.00x" in text


def test_every_entry_steps_on_the_cpu() -> None:
    rows = kfac_cuda.measure(workload="digits-cnn", batch=8, steps=2, warmup=1, device="cpu")
    assert [r["label"] for r in rows] == [label for label, *_ in kfac_cuda.ENTRIES]
    assert rows[0]["vs_sgd"] == 1.0
    assert all(0 < r["min_s"] <= r["median_s"] <= r["max_s"] for r in rows)
