"""Shared by the fused tests: train B stock models one by one and as one fused array."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import plait
from plait.fused.optim import FusedOptimizer, FusedSGD

# Fidelity bound of the issue: fused and separately trained fp32 models agree to 1e-5
# relative after 10 steps. Fused kernels sum in a different order (grouped vs single
# convolutions, batched vs single matmuls), which costs a few ulps (~1e-7) per step.
RTOL = 1e-5


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| (0 for equal all-zero tensors)."""
    a, b = a.double(), b.double()
    scale = b.abs().max().item()
    diff = (a - b).abs().max().item()
    return diff if scale == 0 else diff / scale


def build(factory: Callable[[], nn.Module], b: int, seed: int = 0) -> list[nn.Module]:
    models = []
    for i in range(b):
        torch.manual_seed(seed + i)
        models.append(factory())
    return models


def train_both(
    factory: Callable[[], nn.Module],
    make_input: Callable[[int], Any],
    *,
    b: int = 3,
    steps: int = 10,
    lrs: tuple[float, ...] = (0.05, 0.1, 0.02, 0.08),
    train_mode: bool = True,
    ignore: tuple[str, ...] = (),
) -> float:
    """Train `b` models for `steps` SGD steps both ways; the largest relative difference.

    Every model gets its own inputs and its own learning rate, and the comparison covers
    every parameter and buffer (but those whose names end with one of `ignore`) and the
    final outputs.
    """
    stock = build(factory, b)
    array = plait.fuse(build(factory, b))
    array.train(train_mode)
    for m in stock:
        m.train(train_mode)
    lr = list(lrs[:b])
    opt = FusedSGD(array.parameters(), lr=lr, momentum=0.9)
    stock_opts = [
        torch.optim.SGD(m.parameters(), lr=lr[i], momentum=0.9) for i, m in enumerate(stock)
    ]
    g = torch.Generator().manual_seed(123)
    for _ in range(steps):
        x = make_input(b)
        out = array(x)
        target = torch.randn(out.shape, generator=g)
        (((out - target) ** 2).flatten(1).mean(1)).sum().backward()
        opt.step()
        opt.zero_grad()
        for i, m in enumerate(stock):
            o = m(x[i])
            ((o - target[i]) ** 2).mean().backward()
            stock_opts[i].step()
            stock_opts[i].zero_grad()
    err = 0.0
    fused_state = array.to_models()
    for i, m in enumerate(stock):
        for k, v in m.state_dict().items():
            if k.endswith(ignore):
                continue
            err = max(err, rel_err(fused_state[i][k].to(v.dtype), v) if v.is_floating_point()
                      else float((fused_state[i][k] != v).any()))  # fmt: skip
    x = make_input(b)
    with torch.no_grad():
        out = array(x)
        for i, m in enumerate(stock):
            err = max(err, rel_err(out[i], m(x[i])))
    return err


def images(c: int, h: int, w: int, n: int = 4) -> Callable[[int], torch.Tensor]:
    """Input maker: B models' batches of n [c, h, w] images."""
    return lambda b: torch.randn(b, n, c, h, w)


def seq(c: int, length: int, n: int = 4) -> Callable[[int], torch.Tensor]:
    """Input maker: B models' batches of n [c, length] sequences."""
    return lambda b: torch.randn(b, n, c, length)


def feats(*shape: int, n: int = 4) -> Callable[[int], torch.Tensor]:
    """Input maker: B models' batches of n feature tensors of `shape`."""
    return lambda b: torch.randn(b, n, *shape)


#: Models in the optimizer tests' arrays.
B = 4


def model() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def pick(kwargs: dict[str, Any], b: int) -> dict[str, Any]:
    """Model b's own hyper-parameters from per-model lists."""
    out = {}
    for k, v in kwargs.items():
        out[k] = v[b] if isinstance(v, list) else v
    return out


def run_optimizers(
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


def cnn() -> nn.Module:
    # no convolution bias before batch norm: its true gradient is zero, and Adam scales
    # the rounding noise left in its place up to full steps, in stock torch too
    return nn.Sequential(nn.Conv2d(2, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4),
                         nn.ReLU(), nn.Flatten(), nn.Linear(4 * 5 * 5, 3))  # fmt: skip


OptimizerCase = tuple[type[FusedOptimizer], type[torch.optim.Optimizer], dict[str, Any]]
