"""Fused Dropout: independent masks per model, each model with its own probability."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Self

import torch
import torch.nn.functional as F
from torch import nn

from plait.fused import native
from plait.fused.hparams import coefficient, per_model
from plait.fused.ops.base import FusedModule


def dropout(x: torch.Tensor, p: Sequence[float], *, training: bool) -> torch.Tensor:
    """Dropout over [B, ...] with model b's probability `p[b]`, every element drawn anew."""
    if not training or all(q == 0.0 for q in p):
        return x
    lib = native.dropout_kernels(x)
    if lib is not None:
        return native.dropout(x, list(p), lib=lib)
    if all(q == p[0] for q in p):
        return F.dropout(x, p[0], True)
    keep = [1.0 - q for q in p]
    mask = torch.rand_like(x) < coefficient(keep, x, x.dim())
    scale = coefficient([0.0 if k == 0.0 else 1.0 / k for k in keep], x, x.dim())
    return x * mask * scale


class FusedDropout(FusedModule):
    """B `nn.Dropout` layers over a [B, N, ...] tensor.

    Every element draws its own Bernoulli, so models never share a mask. Probabilities
    may differ between models (a common sweep dimension): then one uniform draw is compared
    with each model's keep probability, broadcast as [B, 1, ...].
    """

    stock_types = (nn.Dropout,)

    def __init__(self, *, p: Sequence[float]) -> None:
        super().__init__(num_models=len(p))
        if any(not 0.0 <= q <= 1.0 for q in p):
            raise ValueError(f"dropout probabilities must be in [0, 1], got {list(p)}")
        self.p = list(p)

    @classmethod
    def from_modules(cls, modules: Sequence[nn.Module]) -> Self:
        return cls(p=[float(m.p) for m in modules])  # type: ignore[arg-type]

    @classmethod
    def with_p(cls, p: object, *, num_models: int) -> Self:
        """A fused dropout with per-model probabilities `p` (a number or B numbers)."""
        return cls(p=per_model(p, num_models=num_models, name="p"))

    def keep_models(self, index: torch.Tensor) -> None:
        super().keep_models(index)
        self.p = [self.p[i] for i in index.tolist()]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dropout(x, self.p, training=self.training)

    def extra_repr(self) -> str:
        return f"p={self.p}"
