"""Fused optimizers against torch.optim: B models with per-model hyper-parameters."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import plait
from plait.fused import FusedAdagrad, FusedAdam, FusedAdamW, FusedRMSprop, FusedSGD, native
from plait.fused.optim import FusedOptimizer
from tests.fused.helpers import RTOL, build, rel_err

B = 4


def model() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def pick(kwargs: dict[str, Any], b: int) -> dict[str, Any]:
    """Model b's own hyper-parameters from per-model lists."""
    out = {}
    for k, v in kwargs.items():
        out[k] = v[b] if isinstance(v, list) else v
    return out


def run(
    fused_cls: type[FusedOptimizer],
    stock_cls: type[torch.optim.Optimizer],
    kwargs: dict[str, Any],
    *,
    steps: int = 10,
    schedule: Callable[[Any, int], list[Any]] | None = None,
    factory: Callable[[], nn.Module] = model,
    x: torch.Tensor | None = None,
) -> float:
    stock = build(factory, B)
    array = plait.fuse(build(factory, B))
    opt = fused_cls(array.parameters(), **kwargs)
    stock_opts = [stock_cls(m.parameters(), **pick(kwargs, b)) for b, m in enumerate(stock)]
    x = torch.randn(B, 5, 6) if x is None else x
    y = torch.randint(0, 3, (B, 5))
    for _ in range(steps):
        opt.zero_grad()
        plait.fused.cross_entropy(array(x), y).sum().backward()
        opt.step()
        for b, m in enumerate(stock):
            stock_opts[b].zero_grad()
            F.cross_entropy(m(x[b]), y[b]).backward()
            stock_opts[b].step()
    err = 0.0
    for b, sd in enumerate(array.to_models()):
        for k, v in stock[b].state_dict().items():
            err = max(err, rel_err(sd[k], v))
    return err


CASES: dict[str, tuple[type[FusedOptimizer], type[torch.optim.Optimizer], dict[str, Any]]] = {
    "sgd": (FusedSGD, torch.optim.SGD, {"lr": [0.1, 0.2, 0.05, 0.3]}),
    "sgd_momentum_dampening_wd": (FusedSGD, torch.optim.SGD, {
        "lr": [0.1, 0.2, 0.05, 0.3], "momentum": [0.9, 0.0, 0.5, 0.8],
        "dampening": [0.1, 0.0, 0.0, 0.2], "weight_decay": [0.0, 1e-2, 1e-3, 0.1]}),
    "sgd_nesterov": (FusedSGD, torch.optim.SGD, {
        "lr": [0.1, 0.2, 0.05, 0.3], "momentum": [0.9, 0.7, 0.5, 0.8], "nesterov": True,
        "weight_decay": 1e-3}),
    "adam": (FusedAdam, torch.optim.Adam, {
        "lr": [0.01, 0.02, 0.005, 0.03], "betas": [(0.9, 0.999), (0.8, 0.99), (0.95, 0.9),
                                                   (0.9, 0.999)],
        "eps": [1e-8, 1e-6, 1e-8, 1e-7], "weight_decay": [0.0, 0.1, 0.01, 0.0]}),
    "adam_shared_values": (FusedAdam, torch.optim.Adam, {"lr": 0.01, "weight_decay": 0.01}),
    "adam_amsgrad": (FusedAdam, torch.optim.Adam, {
        "lr": [0.01, 0.02, 0.005, 0.03], "amsgrad": True}),
    "adamw": (FusedAdamW, torch.optim.AdamW, {
        "lr": [0.01, 0.02, 0.005, 0.03], "weight_decay": [0.0, 0.1, 0.01, 0.5]}),
    "rmsprop": (FusedRMSprop, torch.optim.RMSprop, {
        "lr": [0.01, 0.02, 0.005, 0.03], "alpha": [0.9, 0.99, 0.8, 0.95],
        "momentum": [0.0, 0.9, 0.5, 0.0], "weight_decay": [0.0, 0.1, 0.0, 0.01]}),
    "rmsprop_centered": (FusedRMSprop, torch.optim.RMSprop, {
        "lr": [0.01, 0.02, 0.005, 0.03], "centered": True, "momentum": 0.5}),
    "adagrad": (FusedAdagrad, torch.optim.Adagrad, {
        "lr": [0.1, 0.2, 0.05, 0.3], "lr_decay": [0.0, 0.1, 0.01, 0.0],
        "initial_accumulator_value": [0.0, 0.1, 0.5, 0.0], "weight_decay": [0.0, 0.1, 0.0, 0.0]}),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(CASES))
def test_fused_optimizer_matches_stock(name: str) -> None:
    fused_cls, stock_cls, kwargs = CASES[name]
    assert run(fused_cls, stock_cls, kwargs) <= RTOL


def cnn() -> nn.Module:
    # no convolution bias before batch norm: its true gradient is zero, and Adam scales
    # the rounding noise left in its place up to full steps, in stock torch too
    return nn.Sequential(nn.Conv2d(2, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4),
                         nn.ReLU(), nn.Flatten(), nn.Linear(4 * 5 * 5, 3))  # fmt: skip


@pytest.mark.parametrize("name", ["adam", "adam_shared_values", "sgd_nesterov"])
def test_fused_optimizer_matches_stock_on_a_cnn(name: str) -> None:
    fused_cls, stock_cls, kwargs = CASES[name]
    assert run(fused_cls, stock_cls, kwargs, factory=cnn, x=torch.randn(B, 5, 2, 5, 5)) <= RTOL


@pytest.mark.parametrize("use_native", [False, True])
def test_gradients_with_any_strides_give_the_same_step(use_native: bool) -> None:
    # the flat step gathers gradients into one buffer through cached views, the native
    # one reads them in place; a gradient laid out differently from its parameter (set
    # by hand, or by a custom backward) must give the same step either way, and cached
    # views must stay valid across steps
    grads = [torch.randn(B, 3, 5), torch.randn(B, 4)]
    results = []
    native_before = native.set_enabled(use_native)
    for layout in ("contiguous", "strided"):
        params = [nn.Parameter(torch.ones(B, 3, 5)), nn.Parameter(torch.ones(B, 4))]
        opt = FusedAdam(params, lr=[0.1, 0.2, 0.3, 0.4])
        for step in range(3):
            for p, g0 in zip(params, grads, strict=True):
                g = g0 * (step + 1)
                strided = g.transpose(0, -1).contiguous().transpose(0, -1)  # same values
                p.grad = g if layout == "contiguous" else strided
            opt.step()
        results.append([p.detach().clone() for p in params])
    native.set_enabled(native_before)
    last = params[0].grad
    assert last is not None and not last.is_contiguous()  # the strided case is strided
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


def test_zero_learning_rate_leaves_a_model_unchanged() -> None:
    array = plait.fuse(model, n=2)
    before = {k: v.clone() for k, v in array.state_dict().items()}
    for cls in (FusedAdam, FusedSGD, FusedRMSprop, FusedAdagrad):
        opt = cls(array.parameters(), lr=[0.0, 0.1])
        opt.zero_grad()
        array(torch.randn(2, 3, 6)).pow(2).sum().backward()
        opt.step()
        for k, v in array.state_dict().items():
            assert torch.equal(v[0], before[k][0]), (cls.__name__, k)
            assert not torch.isnan(v).any()


def test_state_dict_round_trip_continues_identically() -> None:
    x, y = torch.randn(B, 5, 6), torch.randint(0, 3, (B, 5))

    def step(array: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        opt.zero_grad()
        plait.fused.cross_entropy(array(x), y).sum().backward()
        opt.step()

    a = plait.fuse(build(model, B))
    opt_a = FusedAdam(a.parameters(), lr=[0.01, 0.02, 0.03, 0.04], betas=(0.8, 0.9))
    for _ in range(3):
        step(a, opt_a)
    saved = opt_a.state_dict()
    assert saved["param_groups"][0]["lr"] == [0.01, 0.02, 0.03, 0.04]
    assert saved["state"][0]["exp_avg"].shape == a.get_parameter("0.weight").shape
    assert saved["state"][0]["step"].tolist() == [3.0] * B

    b = plait.fuse(build(model, B))
    b.load_state_dict(a.state_dict())
    opt_b = FusedAdam(b.parameters(), lr=0.5)
    opt_b.load_state_dict(saved)
    for _ in range(2):
        step(a, opt_a)
        step(b, opt_b)
    for k, v in a.state_dict().items():
        assert torch.equal(v, b.state_dict()[k])


def test_per_model_values_of_the_wrong_length_name_the_parameter() -> None:
    array = plait.fuse(model, n=4)
    with pytest.raises(ValueError, match="lr has 3 values but the array holds 4 models"):
        FusedSGD(array.parameters(), lr=[0.1, 0.2, 0.3])
    with pytest.raises(ValueError, match="betas has 3 pairs"):
        FusedAdam(array.parameters(), betas=[(0.9, 0.99)] * 3)
    with pytest.raises(ValueError, match="does not lead with the array's 4 models"):
        FusedSGD([*array.parameters(), torch.nn.Parameter(torch.zeros(3, 2))], lr=0.1)
    opt = FusedSGD(array.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="weight_decay has 2 values"):
        opt.add_param_group(
            {"params": [torch.nn.Parameter(torch.zeros(4, 2))], "weight_decay": [0, 1]}
        )


def test_keep_drops_models_from_array_and_optimizer() -> None:
    stock = build(model, B)
    array = plait.fuse(build(model, B))
    opt = FusedAdam(array.parameters(), lr=[0.01, 0.02, 0.03, 0.04])
    stock_opts = [
        torch.optim.Adam(m.parameters(), lr=lr)
        for m, lr in zip(stock, [0.01, 0.02, 0.03, 0.04], strict=True)
    ]
    x, y = torch.randn(B, 5, 6), torch.randint(0, 3, (B, 5))
    for step in range(6):
        if step == 3:  # prune models 0 and 2
            array.keep([1, 3])
            opt.keep([1, 3])
            x, y, stock, stock_opts = (
                x[[1, 3]],
                y[[1, 3]],
                [stock[1], stock[3]],
                [stock_opts[1], stock_opts[3]],
            )
        opt.zero_grad()
        plait.fused.cross_entropy(array(x), y).sum().backward()
        opt.step()
        for b, m in enumerate(stock):
            stock_opts[b].zero_grad()
            F.cross_entropy(m(x[b]), y[b]).backward()
            stock_opts[b].step()
    assert array.num_models == 2 and opt.param_groups[0]["lr"] == [0.02, 0.04]
    for b, sd in enumerate(array.to_models()):
        for k, v in stock[b].state_dict().items():
            assert rel_err(sd[k], v) <= RTOL


def test_step_hooks_and_profiler_scopes_work_as_in_torch_optim() -> None:
    """The lean paths of `step` and `zero_grad` must keep torch.optim's contract: step
    hooks (per optimizer and global) run, and a recording profiler sees both scopes."""
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    array = plait.fuse(model, n=2)
    opt = FusedAdamW(array.parameters(), lr=[1e-3, 2e-3])
    calls: list[str] = []

    def train() -> None:
        opt.zero_grad()
        array(torch.randn(2, 3, 6)).pow(2).sum().backward()
        opt.step()

    train()  # no hook, no profiler: the direct path
    assert all(p.grad is not None for p in array.parameters())
    pre = opt.register_step_pre_hook(lambda o, a, k: calls.append("pre"))
    post = opt.register_step_post_hook(lambda o, a, k: calls.append("post"))
    glob = register_optimizer_step_pre_hook(lambda o, a, k: calls.append("global"))
    train()
    assert calls == ["global", "pre", "post"]
    for handle in (pre, post, glob):
        handle.remove()
    train()
    assert calls == ["global", "pre", "post"]  # removed hooks stay silent

    with torch.profiler.profile() as prof:
        train()
    names = {e.name for e in prof.events()}
    assert "Optimizer.step#FusedAdamW.step" in names
    assert "Optimizer.zero_grad#FusedAdamW.zero_grad" in names

    opt.zero_grad(set_to_none=False)  # zeroes in place, as torch.optim does
    assert all(p.grad is not None and not p.grad.any() for p in array.parameters())
    opt.zero_grad()
    assert all(p.grad is None for p in array.parameters())


def test_learning_rates_changed_in_place_take_effect() -> None:
    """The fused Adam step remembers resolved learning rates by value: a list edited in
    place (as a hand-written schedule might) must still change the next step."""
    array = plait.fuse(model, n=2)
    opt = FusedAdam(array.parameters(), lr=[0.1, 0.2])
    x = torch.randn(2, 3, 6)

    def step() -> dict[str, torch.Tensor]:
        before = {k: v.clone() for k, v in array.state_dict().items()}
        opt.zero_grad()
        array(x).pow(2).sum().backward()
        opt.step()
        return {k: v - before[k] for k, v in array.state_dict().items()}

    step()
    opt.param_groups[0]["lr"][1] = 0.0
    moved = step()
    for k, d in moved.items():
        assert d[0].abs().sum() > 0 and torch.equal(d[1], torch.zeros_like(d[1])), k
