from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from plait.data import load_digits_split, load_text_split
from plait.workloads import get_workload


def test_digits_split_is_fixed_and_disjoint() -> None:
    tr1, te1 = load_digits_split()
    _, te2 = load_digits_split()
    assert torch.equal(te1.tensors[0], te2.tensors[0])
    assert len(tr1) + len(te1) == 1797 and len(te1) == pytest.approx(360, abs=5)
    assert set(te1.tensors[1].tolist()) == set(range(10))
    rows = {tuple(r.tolist()) for r in tr1.tensors[0]}
    overlap = sum(tuple(r.tolist()) in rows for r in te1.tensors[0])
    assert overlap < 10  # only identical-looking digits can coincide


def test_text_split() -> None:
    train, val, vocab = load_text_split(block_size=64)
    x, y = train[3]
    assert x.shape == y.shape == (64,)
    assert torch.equal(x[1:], y[:-1])
    assert vocab.decode(vocab.encode("def f(x):")) == "def f(x):"
    assert len(val) > 0 and vocab.size > 60


def test_unknown_workload() -> None:
    with pytest.raises(ValueError, match="choose from"):
        get_workload("alexnet")


_FACTORY = """
import torch
from torch.utils.data import TensorDataset
from plait.workloads import DataInfo, DataSplit, Workload


def data():
    x = torch.randn(32, 6)
    y = (x.sum(1) > 0).long()
    ds = TensorDataset(x, y)
    return DataSplit(train=ds, test=ds, info=DataInfo(input_shape=(6,), num_classes=2), name="toy")


def make():
    return Workload(name="toy", build=lambda info: torch.nn.Linear(6, 2), real=data)


def not_a_workload():
    return 42
"""


def test_file_factory_resolves_and_runs(tmp_path: Path) -> None:
    path = tmp_path / "toy_workload.py"
    path.write_text(_FACTORY)
    wl = get_workload(f"{path}:make")
    assert wl.name == "toy"
    data = wl.bench_data(8)  # no synthetic data: the first real samples
    assert len(data.train) == 8  # type: ignore[arg-type]
    x, y = data.train[0:4]
    assert torch.isfinite(wl.loss(wl.model(data.info)(x), y))


def test_module_factory_resolves(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "toy_pkg_mod.py").write_text(_FACTORY)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert get_workload("toy_pkg_mod:make").name == "toy"


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        ("no_such_module_xyz:make", "does not import"),
        ("{dir}/missing.py:make", "does not exist"),
        ("{dir}/toy_workload.py:absent", "has no attribute 'absent'"),
        ("{dir}/toy_workload.py:not_a_workload", "returned int"),
        ("{dir}/toy_workload.py:", "pkg.module:factory"),
        ("resnet19", "unknown workload 'resnet19'"),
    ],
)
def test_bad_factory_names_the_problem(tmp_path: Path, spec: str, needle: str) -> None:
    (tmp_path / "toy_workload.py").write_text(_FACTORY)
    with pytest.raises(ValueError, match=needle.replace("(", r"\(")):
        get_workload(spec.format(dir=tmp_path))


def test_a_module_factory_in_the_current_folder_resolves(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`plait` runs from its script's folder: ./mywork.py used to be "does not import"."""
    (tmp_path / "toy_cwd_mod.py").write_text(_FACTORY)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    assert get_workload("toy_cwd_mod:make").name == "toy"


def test_a_factory_that_raises_is_named(tmp_path: Path) -> None:
    path = tmp_path / "broken_workload.py"
    path.write_text("def make():\n    raise KeyError('vocab')\n")
    with pytest.raises(ValueError, match=r"broken_workload\.py:make' raised KeyError: 'vocab'"):
        get_workload(f"{path}:make")
