"""Batching rules of captured graphs, each against B stock models run one by one.

Small modules exercise one family of operators each; `train_both` trains them 10 SGD
steps fused and stock and compares every parameter and the final outputs.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import plait
from plait.fused import CapturedArray
from tests.fused.helpers import RTOL, build, rel_err, train_both


def export(factory: object) -> object:
    """`factory` itself, after checking that it is fused from its exported graph."""
    assert isinstance(plait.fuse(factory, n=2, capture="export"), CapturedArray)  # type: ignore[arg-type]
    return factory


class Indexing(nn.Module):
    """Shared and per-model index tensors, gathers, cat with shared members."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 6)
        self.register_buffer("order", torch.tensor([2, 0, 1]), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)  # [n, t, 6]
        top = h.argmax(-1)  # per-model indices
        picked = h.gather(-1, top.unsqueeze(-1)).squeeze(-1)  # [n, t]
        rows = h[:, self.order]  # shared index on dim 1
        per_model = h[torch.arange(h.shape[0]).unsqueeze(1), top % h.shape[1]]  # per model
        ones = torch.ones(h.shape[0], 3, 6)
        mixed = torch.cat([rows, ones], dim=1)  # a shared member
        return mixed.sum(1) + picked.sum(-1, keepdim=True) + per_model.mean(1)


class Products(nn.Module):
    """einsum, matmul with per-model vectors, baddbmm, full reductions."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 5))
        self.v = nn.Parameter(torch.randn(5))
        self.bias = nn.Parameter(torch.randn(5, 5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.einsum("ntd,de->nte", x, self.w)  # [n, t, 5]
        s = h @ self.v  # a per-model vector on the right: [n, t]
        u = self.v @ h.transpose(1, 2)  # and on the left: [n, t]
        b = torch.baddbmm(self.bias.expand(h.shape[0], 5, 5), h, h.transpose(1, 2))
        return (s * u).unsqueeze(-1) + h.mean() + b.sum((1, 2)).view(-1, 1, 1) * h.max()


class Attention(nn.Module):
    """scaled_dot_product_attention with a causal flag, a shared mask and a per-model
    padding mask, GQA-style repeated heads and rotary-style halves."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(8, 24)
        self.norm = nn.RMSNorm(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, t, _ = x.shape
        q, k, v = self.qkv(self.norm(x)).view(n, t, 3, 2, 4).unbind(2)
        q, k, v = (y.transpose(1, 2) for y in (q, k, v))
        half = torch.cat([-q[..., 2:], q[..., :2]], dim=-1)
        q = q * 0.5 + half * 0.25
        causal = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        band = torch.ones(t, t, dtype=torch.bool).tril()
        shared = F.scaled_dot_product_attention(q, k, v, attn_mask=band)
        keep = (x.sum(-1) > -1.0)[:, None, None, :]  # per-model padding mask
        padded = F.scaled_dot_product_attention(q, k, v, attn_mask=keep | band)
        return (causal + shared + padded).transpose(1, 2).reshape(n, t, 8)


@pytest.mark.parametrize("factory", [Indexing, Products, Attention])
def test_operator_families_train_like_stock(factory: type[nn.Module]) -> None:
    width = {Indexing: 4, Products: 4, Attention: 8}[factory]
    export(factory)
    assert train_both(factory, lambda b: torch.randn(b, 3, 5, width)) <= RTOL


class Losses(nn.Module):
    """The losses a model computes itself, reduced per model."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 5)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = self.lin(x)  # [n, t, 5]
        weight = torch.tensor([1.0, 2.0, 0.5, 1.0, 1.0])
        flat, target = logits.flatten(0, 1), y.flatten()
        return torch.stack([
            F.cross_entropy(flat, target, ignore_index=3),
            F.cross_entropy(flat, target, weight=weight, label_smoothing=0.1),
            F.cross_entropy(logits.transpose(1, 2), y, reduction="sum"),
            F.nll_loss(F.log_softmax(flat, -1), target, weight=weight, ignore_index=0),
            F.mse_loss(logits, logits.detach().roll(1, -1)),
            F.binary_cross_entropy_with_logits(logits, torch.sigmoid(logits.detach())),
            F.cross_entropy(logits[0, 0], y[0, 0]),  # one sample
        ])  # fmt: skip


def test_losses_are_per_model() -> None:
    models = build(export(Losses), 2)  # type: ignore[arg-type]
    array = plait.fuse(build(Losses, 2))
    x, y = torch.randn(2, 3, 4, 4), torch.randint(0, 5, (2, 3, 4))
    out = array(x, y)
    assert out.shape == (2, 7)
    for b, m in enumerate(models):
        assert rel_err(out[b], m(x[b], y[b])) <= RTOL
    out.sum().backward()  # every loss is differentiable per model


def test_shared_inputs_and_outputs() -> None:
    """Non-tensor inputs pass through; an output no model parameter reaches is still [B]."""

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(3, 3)

        def forward(self, x: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
            return self.lin(x) * scale, torch.arange(4.0)

    array = plait.fuse(Net, n=3, capture="export")
    out, steps = array(torch.randn(3, 2, 3), 2.0)
    assert out.shape == (3, 2, 3) and steps.shape == (3, 4)
