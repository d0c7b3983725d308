"""Single-process behaviour of `KFAC`: validation, odd modules, accumulation, resuming."""

from __future__ import annotations

import logging
import re
import warnings
from typing import Any

import pytest
import torch
from torch import nn

from plait.kfac import KFAC, KFACConfig


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()


def _batch(seed: int, n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 6, generator=g, dtype=torch.float64), torch.randint(
        0, 3, (n,), generator=g
    )


def _step(
    model: nn.Module, kfac: KFAC, opt: torch.optim.Optimizer, seed: int
) -> list[torch.Tensor]:
    x, y = _batch(seed)
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    kfac.step()
    grads = [p.grad.clone() for p in model.parameters()]
    opt.step()
    return grads


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"damping": 0.0}, "damping"),
        ({"damping": -1e-3}, "damping"),
        ({"factor_decay": 1.0}, "factor_decay"),
        ({"inv_interval": 0}, "inv_interval"),
        ({"factor_interval": 0}, "factor_interval"),
        ({"inv_interval": 2.5}, "inv_interval"),
        ({"method": "svd"}, "unknown method 'svd'"),
        ({"inverse_form": "lu"}, "inverse_form"),
        ({"comm": "smoke-signals"}, "factor communication"),
        ({"placement": "random"}, "placement"),
        ({"distribution": "everyone"}, "distribution"),
        ({"comm_dtype": "fp8"}, "comm_dtype"),
        ({"kl_clip": 0.0}, "kl_clip"),
        ({"bucket_cap_mb": 0}, "bucket_cap_mb"),
        ({"grad_workers": 0}, "grad_workers"),
    ],
)
def test_bad_hyper_parameters_are_value_errors(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        KFACConfig(**kwargs)


def test_callable_hyper_parameters_are_checked_when_used() -> None:
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    kfac = KFAC(model, KFACConfig(damping=lambda s: 0.01 if s < 1 else -1.0), optimizer=opt)
    _step(model, kfac, opt, 0)
    with pytest.raises(ValueError, match="damping"):
        _step(model, kfac, opt, 1)


def test_kl_clip_needs_a_learning_rate() -> None:
    model = _mlp()
    kfac = KFAC(model, KFACConfig())
    x, y = _batch(0)
    nn.functional.cross_entropy(model(x), y).backward()
    with pytest.raises(ValueError, match="learning rate"):
        kfac.step()
    KFAC(_mlp(), KFACConfig(kl_clip=None))  # no clipping, no learning rate needed


def test_unhandled_modules_are_listed_and_left_alone(caplog: pytest.LogCaptureFixture) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2), nn.Flatten(), nn.Linear(8, 2),
                          nn.LayerNorm(2), nn.Conv1d(1, 1, 1))  # fmt: skip
    with caplog.at_level(logging.INFO, logger="plait.kfac"):
        kfac = KFAC(model, KFACConfig(kl_clip=None))
    assert sorted(kfac.layers) == ["0", "3"]
    lines = [r for r in caplog.records if "leaves these" in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelno == logging.WARNING  # Conv1d has a matrix
    assert re.search(r"BatchNorm2d x1 \(e.g. 1\).*LayerNorm x1.*Conv1d", lines[0].getMessage())


def test_a_model_without_a_supported_layer_is_a_value_error() -> None:
    model = nn.Sequential(nn.Conv1d(1, 2, 3), nn.LayerNorm(2))
    with pytest.raises(ValueError, match=r"no layer to precondition in Sequential.*Conv1d"):
        KFAC(model, KFACConfig(kl_clip=None))


def test_hooks_that_never_fire_do_not_break_the_step() -> None:
    """MultiheadAttention calls its out_proj weight directly: the Linear's hooks never run."""

    class Attn(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp = nn.Linear(4, 8)
            self.mha = nn.MultiheadAttention(8, 2, batch_first=True)
            self.head = nn.Linear(8, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.inp(x)
            return self.head(self.mha(h, h, h, need_weights=False)[0].mean(1))

    torch.manual_seed(0)
    model = Attn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        kfac = KFAC(model, KFACConfig(), optimizer=opt)
    assert "mha.out_proj" in kfac.layers
    for step in range(3):
        x = torch.randn(4, 5, 4)
        opt.zero_grad()
        raw = None
        nn.functional.cross_entropy(model(x), torch.randint(0, 3, (4,))).backward()
        raw = model.mha.out_proj.weight.grad.clone()
        kfac.step()
        opt.step()
        # left alone (no factors), while the layers around it are preconditioned
        torch.testing.assert_close(model.mha.out_proj.weight.grad, raw)
        assert step >= 0
    assert {s.layer for s in kfac.pipeline.slots} == {"inp", "head"}


def test_accumulated_micro_batches_equal_one_batch() -> None:
    """Two half batches (loss / 2 each, under no_sync) give the full batch's factors."""
    x, y = _batch(0, 8)
    whole, parts = _mlp(), _mlp()
    k1 = KFAC(whole, KFACConfig(kl_clip=None))
    k2 = KFAC(parts, KFACConfig(kl_clip=None))
    nn.functional.cross_entropy(whole(x), y).backward()
    k1.step()
    with k2.no_sync():
        (nn.functional.cross_entropy(parts(x[:4]), y[:4]) / 2).backward()
    (nn.functional.cross_entropy(parts(x[4:]), y[4:]) / 2).backward()
    k2.step()
    for a, b in zip(whole.parameters(), parts.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-10, atol=1e-12)


def test_intervals() -> None:
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    kfac = KFAC(model, KFACConfig(inv_interval=3, factor_interval=2), optimizer=opt)
    for s in range(6):
        _step(model, kfac, opt, s)
    assert kfac.stats.inversions == 2 * 4  # steps 0 and 3, four factors each
    assert [kfac.is_inversion_step(s) for s in range(4)] == [True, False, False, True]


def test_remove_and_attach_detach_and_restore_the_hooks() -> None:
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    kfac = KFAC(model, KFACConfig(kl_clip=None))
    kfac.remove()
    x, y = _batch(0)
    nn.functional.cross_entropy(model(x), y).backward()
    kfac.step()  # nothing captured: nothing discovered, gradients left as they are
    assert not kfac.pipeline.discovered
    kfac.attach()
    opt.zero_grad()
    _step(model, kfac, opt, 1)
    assert kfac.pipeline.discovered and kfac.stats.inversions == 4


def test_state_dict_resumes_exactly() -> None:
    def fresh() -> tuple[nn.Module, KFAC, torch.optim.Optimizer]:
        m = _mlp()
        o = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
        return m, KFAC(m, KFACConfig(inv_interval=3, sync="lazy"), optimizer=o), o

    m1, k1, o1 = fresh()
    straight = [_step(m1, k1, o1, s) for s in range(7)]
    m2, k2, o2 = fresh()
    for s in range(4):
        _step(m2, k2, o2, s)
    saved = (k2.state_dict(), m2.state_dict(), o2.state_dict())
    m3, k3, o3 = fresh()
    k3.load_state_dict(saved[0])
    m3.load_state_dict(saved[1])
    o3.load_state_dict(saved[2])
    resumed = [_step(m3, k3, o3, s) for s in range(4, 7)]
    for a, b in zip(straight[4:], resumed, strict=True):
        for x, y in zip(a, b, strict=True):
            torch.testing.assert_close(x, y, rtol=0, atol=0)
    # without factors the run continues (factors start afresh), it just cannot be exact
    m4, k4, o4 = fresh()
    k4.load_state_dict(k2.state_dict(include_factors=False))
    assert k4.steps == 4
    _step(m4, k4, o4, 4)


def test_factors_saved_in_another_format_are_refused() -> None:
    m = _mlp()
    o = torch.optim.SGD(m.parameters(), lr=0.1)
    k = KFAC(m, KFACConfig(), optimizer=o)
    _step(m, k, o, 0)
    state = k.state_dict()
    state["format"] = 1  # explicit inverses and index-packed triangles
    with pytest.raises(ValueError, match="format 1"):
        KFAC(m, KFACConfig(), optimizer=o).load_state_dict(state)
    bare = k.state_dict(include_factors=False)  # without factors there is nothing to misread
    bare.pop("format")
    KFAC(m, KFACConfig(), optimizer=o).load_state_dict(bare)


@pytest.mark.parametrize(("inv_interval", "a_explicit"), [(1, False), (500, True)])
def test_auto_form_weighs_inversion_against_uses(inv_interval: int, a_explicit: bool) -> None:
    """A 301-wide A factor beside a 2-wide G: inverting A explicitly costs ~301^3 and saves
    ~301^2 * 2 per use, so only a factor reused for over a hundred steps is worth inverting;
    G is used with a 301-wide partner and is always worth it."""
    torch.manual_seed(0)
    model = nn.Linear(300, 2).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    kfac = KFAC(model, KFACConfig(inv_interval=inv_interval), optimizer=opt)
    x = torch.randn(16, 300, dtype=torch.float64)
    nn.functional.cross_entropy(model(x), torch.randint(0, 2, (16,))).backward()
    kfac.step()
    forms = {key.rsplit("/", 1)[1]: so.explicit for key, so in kfac._second.items()}
    assert forms == {"A": a_explicit, "G": True}
