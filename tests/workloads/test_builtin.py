"""plait's own workloads: every model builds and runs on its benchmark data and its real
data, at the sizes of the models they are named after."""

from __future__ import annotations

import pytest
import torch

from plait.workloads import WORKLOADS, get_workload
from plait.workloads.builtin import BUILTIN


def _params(m: torch.nn.Module) -> int:
    return sum(p.numel() for p in m.parameters())


def test_every_builtin_is_registered_under_its_name() -> None:
    assert len({w.name for w in BUILTIN}) == len(BUILTIN)
    assert all(WORKLOADS[w.name] is w for w in BUILTIN)


@pytest.mark.parametrize("name", [w.name for w in BUILTIN])
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
    info = get_workload("resnet18").bench_data(1).info
    assert _params(get_workload("resnet18").model(info, bench=True)) == pytest.approx(
        11.17e6, rel=0.01
    )
    assert _params(get_workload("vgg").model(info, bench=True)) == pytest.approx(14.7e6, rel=0.02)
    assert _params(
        get_workload("mlp").model(get_workload("mlp").bench_data(1).info, bench=True)
    ) == (pytest.approx(8.4e6, rel=0.01))
    assert _params(
        get_workload("gpt").model(get_workload("gpt").bench_data(1).info, bench=True)
    ) == (pytest.approx(10.7e6, rel=0.03))


@pytest.mark.parametrize("name", [w.name for w in BUILTIN])
def test_random_inputs_of_the_bench_shapes_feed_the_bench_model(name: str) -> None:
    wl = get_workload(name)
    info = wl.bench_data(2).info
    logits = wl.model(info, bench=True).eval()(info.random_inputs(2))
    target_shape = (2, info.block_size) if info.block_size else (2,)
    assert logits.shape == (*target_shape, info.num_classes)


@pytest.mark.parametrize("name", ["digits-mlp", "digits-cnn", "digits-transformer"])
def test_sweep_width_sizes_the_model(name: str) -> None:
    wl = get_workload(name)
    info = wl.real().info
    width = int(wl.arch["width"])
    assert _params(wl.model(info)) == _params(wl.model(info, width=width))  # the default
    assert _params(wl.model(info, width=2 * width)) > _params(wl.model(info))
