from __future__ import annotations

import pytest
import torch

from plait.data import load_digits_split, load_text_split
from plait.workloads import WORKLOADS, get_workload


def _params(m: torch.nn.Module) -> int:
    return sum(p.numel() for p in m.parameters())


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_bench_and_real_models_run(name: str) -> None:
    wl = get_workload(name)
    syn = wl.bench_data(4)
    model = wl.model(syn.info, bench=True)
    x, y = syn.train.tensors  # type: ignore[attr-defined]
    out = model(x[:2])  # two samples: batch norm needs more than one value per channel
    assert torch.isfinite(wl.loss(out, y[:2]))
    real = wl.real()
    assert real.test is not None and len(real.test) > 0  # type: ignore[arg-type]
    (xa, ya), (xb, yb) = real.train[0], real.train[1]
    out = wl.model(real.info)(torch.stack([xa, xb]))
    assert torch.isfinite(wl.loss(out, torch.stack([ya, yb])))


def test_reference_sizes() -> None:
    # the layer shapes of the models the workloads are named after
    info = get_workload("resnet18").synthetic(1).info
    assert _params(get_workload("resnet18").model(info, bench=True)) == pytest.approx(
        11.17e6, rel=0.01
    )
    assert _params(get_workload("vgg").model(info, bench=True)) == pytest.approx(14.7e6, rel=0.02)
    assert _params(
        get_workload("mlp").model(get_workload("mlp").synthetic(1).info, bench=True)
    ) == (pytest.approx(8.4e6, rel=0.01))
    assert _params(
        get_workload("gpt").model(get_workload("gpt").synthetic(1).info, bench=True)
    ) == (pytest.approx(10.7e6, rel=0.03))


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


def test_file_factory_resolves_and_runs(tmp_path) -> None:
    path = tmp_path / "toy_workload.py"
    path.write_text(_FACTORY)
    wl = get_workload(f"{path}:make")
    assert wl.name == "toy"
    data = wl.bench_data(8)  # no synthetic data: the first real samples
    assert len(data.train) == 8  # type: ignore[arg-type]
    x, y = data.train[0:4]
    assert torch.isfinite(wl.loss(wl.model(data.info)(x), y))


def test_module_factory_resolves(tmp_path, monkeypatch) -> None:
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
def test_bad_factory_names_the_problem(tmp_path, spec: str, needle: str) -> None:
    (tmp_path / "toy_workload.py").write_text(_FACTORY)
    with pytest.raises(ValueError, match=needle.replace("(", r"\(")):
        get_workload(spec.format(dir=tmp_path))


def test_model_output_objects_feed_the_default_loss() -> None:
    from plait.workloads import Task, default_loss, logits_of

    logits = torch.randn(4, 3)
    target = torch.tensor([0, 1, 2, 0])

    class Out:
        def __init__(self) -> None:
            self.logits = logits

    expected = torch.nn.functional.cross_entropy(logits, target)
    for out in (logits, {"logits": logits}, Out(), (logits, None)):
        assert torch.equal(default_loss(Task.CLASSIFICATION)(out, target), expected)
    with pytest.raises(TypeError, match="cannot find the predictions"):
        logits_of({"loss": torch.tensor(0.0)})
