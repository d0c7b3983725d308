"""Shared by the fused tests: train B stock models one by one and as one fused array."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import plait
from plait.fused.optim import FusedSGD

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
) -> float:
    """Train `b` models for `steps` SGD steps both ways; the largest relative difference.

    Every model gets its own inputs and its own learning rate, and the comparison covers
    every parameter and buffer and the final outputs.
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
