"""The workload object: random inputs of its shapes, validation of its fields, benchmark
data from real data, the default loss and metric."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from plait.workloads import DataInfo, DataSplit, Task, Workload, accuracy, default_loss, logits_of


def _real() -> DataSplit:
    x = torch.arange(40.0).reshape(20, 2)
    y = torch.arange(20) % 3
    info = DataInfo(input_shape=(2,), num_classes=3)
    return DataSplit(train=TensorDataset(x, y), test=None, info=info, name="toy-real")


def _workload(**kw: Any) -> Workload:
    base: dict[str, Any] = {
        "name": "toy",
        "build": lambda info, **_: nn.Linear(2, 3),
        "real": _real,
    }
    return Workload(**{**base, **kw})


def test_random_inputs_follow_the_data_kind() -> None:
    images = DataInfo(input_shape=(3, 4, 4), num_classes=10)
    x = images.random_inputs(5, generator=torch.Generator().manual_seed(0))
    assert x.shape == (5, 3, 4, 4) and x.is_floating_point()
    # a language model's inputs are tokens of its vocabulary (its classes)
    lm = DataInfo(input_shape=(16,), num_classes=7, block_size=16)
    tokens = lm.random_inputs(2, 3)
    assert tokens.shape == (2, 3, 16) and tokens.dtype == torch.long
    assert int(tokens.min()) >= 0 and int(tokens.max()) < 7
    # token inputs of a classifier: below input_vocab, not below the class count
    seq = DataInfo(input_shape=(64,), num_classes=10, input_vocab=3)
    ids = seq.random_inputs(1000)
    assert ids.dtype == torch.long and set(ids.unique().tolist()) == {0, 1, 2}
    g = torch.Generator().manual_seed(0)
    assert torch.equal(images.random_inputs(5, generator=g), x)  # seeded: reproducible


@pytest.mark.parametrize(
    ("field", "value", "needle"),
    [
        ("name", "", "non-empty name"),
        ("build", None, "build must be callable"),
        ("real", "digits", "real must be callable"),
        ("bench_batch", 0, "bench_batch must be >= 1"),
        ("train_batch", -1, "train_batch must be >= 1"),
        ("epochs", 0, "epochs must be >= 1"),
        ("lr", 0.0, "lr must be > 0"),
        ("lr", float("nan"), "lr must be > 0"),
        ("optimizer", "lbfgs", "choose from sgd, adam, adamw"),
    ],
)
def test_invalid_fields_name_the_problem(field: str, value: Any, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        _workload(**{field: value})


def test_model_merges_arch_options_and_checks_the_result() -> None:
    seen: list[dict[str, Any]] = []

    def build(info: DataInfo, **arch: Any) -> nn.Module:
        seen.append(arch)
        return nn.Linear(2, arch["width"])

    wl = _workload(build=build, bench_build=lambda info, **_: nn.Linear(2, 99), arch={"width": 4})
    info = _real().info
    assert wl.model(info).out_features == 4
    assert wl.model(info, width=6).out_features == 6  # a sweep's option wins
    assert wl.model(info, bench=True).out_features == 99
    assert seen == [{"width": 4}, {"width": 6}]
    assert _workload().model(info, bench=True).out_features == 3  # no bench variant: build
    with pytest.raises(TypeError, match=r"returned str, not a torch\.nn\.Module"):
        _workload(build=lambda info: "model").model(info)


def test_bench_data_without_synthetic_takes_the_first_real_samples() -> None:
    wl = _workload()
    data = wl.bench_data(6)
    assert len(data.train) == 6  # type: ignore[arg-type]
    assert data.test is None and data.info == _real().info and data.name == "toy-real"
    x, _ = data.train[0:6]
    torch.testing.assert_close(x, torch.arange(12.0).reshape(6, 2))
    assert len(wl.bench_data(1000).train) == 20  # type: ignore[arg-type]  # all there is


def test_bench_data_prefers_synthetic() -> None:
    made: list[int] = []

    def synthetic(n: int) -> DataSplit:
        made.append(n)
        return _real()

    assert _workload(synthetic=synthetic).bench_data(12).name == "toy-real" and made == [12]


def test_default_loss_and_metric_by_task() -> None:
    logits = torch.tensor([[[2.0, 0.0], [0.0, 1.0], [3.0, 0.0]]])  # 1 sequence, 3 tokens
    target = torch.tensor([[0, 1, 1]])
    lm = _workload(task=Task.LANGUAGE_MODEL)
    expected = nn.functional.cross_entropy(logits[0], target[0])  # every token counts
    torch.testing.assert_close(lm.loss({"logits": logits}, target), expected)
    assert lm.correct(logits, target) == (2, 3)  # per token
    clf = _workload(loss_fn=lambda out, t: out.sum(), metric_fn=lambda out, t: (1, 1))
    assert clf.loss(torch.ones(2, 3), torch.zeros(2)).item() == 6.0  # the given functions
    assert clf.correct(torch.ones(2, 3), torch.zeros(2)) == (1, 1)
    assert accuracy(torch.tensor([[0.1, 0.9], [0.8, 0.2]]), torch.tensor([1, 1])) == (1, 2)


def test_model_output_objects_feed_the_default_loss() -> None:
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
