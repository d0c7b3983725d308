"""What every fused optimizer shares (state, hooks, keep, errors).

Checked against torch.optim: B models with per-model hyper-parameters.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import plait
from plait.fused import FusedAdagrad, FusedAdam, FusedAdamW, FusedRMSprop, FusedSGD
from tests.fused.helpers import RTOL, B, build, model, rel_err


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
