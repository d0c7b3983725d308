"""examples/transformers_workloads.py: the Hugging Face models as workload factories
that plait's commands (`--workload file.py:name`) build, feed and train."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from plait.workloads import DataInfo, Workload, get_workload

pytest.importorskip("transformers")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "transformers_workloads.py"
NAMES = ["gpt2", "gpt2_untied", "llama", "bert", "resnet18"]

#: Data shapes of each workload, small: what its model is built for and fed.
INFOS = {
    "gpt2": DataInfo(input_shape=(8,), num_classes=12, block_size=8),
    "gpt2_untied": DataInfo(input_shape=(8,), num_classes=12, block_size=8),
    "llama": DataInfo(input_shape=(8,), num_classes=12, block_size=8),
    "bert": DataInfo(input_shape=(8,), num_classes=10, input_vocab=17),
    "resnet18": DataInfo(input_shape=(1, 16, 16), num_classes=10),
}


def _trains(workload: Workload, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    loss = workload.loss(model(x), y)
    assert loss.ndim == 0 and torch.isfinite(loss)
    loss.backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert not missing, f"{workload.name}: parameters the loss does not reach: {missing}"


@pytest.mark.parametrize("name", NAMES)
def test_each_factory_builds_a_model_its_loss_trains(name: str) -> None:
    workload = get_workload(f"{EXAMPLE}:{name}")
    info = INFOS[name]
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    model = workload.model(info, bench=True)
    x = info.random_inputs(2, generator=g)
    shape = (2, info.block_size) if info.block_size else (2,)
    _trains(workload, model, x, torch.randint(0, info.num_classes, shape, generator=g))


@pytest.mark.slow  # loads and tokenises each workload's real data (about a minute)
@pytest.mark.parametrize("name", NAMES)
def test_each_factory_trains_on_its_own_data(name: str) -> None:
    workload = get_workload(f"{EXAMPLE}:{name}")
    data = workload.bench_data(4)
    x, y = next(iter(DataLoader(data.train, batch_size=2)))  # type: ignore[arg-type]
    torch.manual_seed(0)
    _trains(workload, workload.model(data.info, bench=True), x, y)


def test_the_untied_gpt2_has_its_own_output_matrix() -> None:
    """The variant K-FAC preconditions whole: the tied model shares one weight between its
    token embedding and its output layer, the untied one has two."""
    info = INFOS["gpt2"]
    tied = get_workload(f"{EXAMPLE}:gpt2").model(info, bench=True)
    untied = get_workload(f"{EXAMPLE}:gpt2_untied").model(info, bench=True)
    assert tied.lm_head.weight is tied.transformer.wte.weight
    assert untied.lm_head.weight is not untied.transformer.wte.weight
