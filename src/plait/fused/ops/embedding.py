"""Fused Embedding: B tables as one [B*V, D] table indexed with per-model offsets."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Self

import torch
import torch.nn.functional as F
from torch import nn

from plait.fused.errors import UnsupportedLayerError
from plait.fused.ops.base import FusedModule, check_same, stack_parameter


class _Lookup(torch.autograd.Function):
    """Rows `idx` of `table`; backward scatters the gradient rows with `index_add_`.

    Autograd's embedding backward sorts the indices to group equal rows, which for a
    fused array's B*N*T lookups into B*V small rows costs about five times as much as
    adding each gradient row into its table row directly (measured on CPU).
    """

    @staticmethod
    def forward(ctx: Any, idx: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(idx)
        ctx.rows = table.shape[0]
        return F.embedding(idx, table)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor]:
        (idx,) = ctx.saved_tensors
        d = grad.shape[-1]
        table = torch.zeros(ctx.rows, d, dtype=grad.dtype, device=grad.device)
        return None, table.index_add_(0, idx.reshape(-1), grad.reshape(-1, d))


def lookup(
    weight: torch.Tensor, idx: torch.Tensor, padding_idx: Sequence[int | None] = ()
) -> torch.Tensor:
    """B models' embedding lookups: table [B, V, D], indices [B, ...] -> [B, ..., D].

    Model b's index i reads row b*V + i of the flattened table, so one lookup serves all
    models. A padding index (one per model, None for none) keeps its row out of that
    model's gradient, as in the stock layer: the outputs at padded positions are detached.
    """
    b, v, d = weight.shape
    offsets = torch.arange(b, device=idx.device).mul_(v).view(b, *([1] * (idx.dim() - 1)))
    out: torch.Tensor = _Lookup.apply(idx + offsets, weight.view(b * v, d))
    if any(p is not None for p in padding_idx):
        pads = torch.tensor([-1 if p is None else p for p in padding_idx], device=idx.device)
        padded = (idx == pads.view(b, *([1] * (idx.dim() - 1)))).unsqueeze(-1)
        out = torch.where(padded, out.detach(), out)
    return out


class FusedEmbedding(FusedModule):
    """B `nn.Embedding` tables, weight [B, V, D], each model with its own `padding_idx`.

    Model b's index i reads row b*V + i of the flattened table, so one lookup serves all
    models. A padding index keeps its row out of the gradient, as in the stock layer: the
    outputs at padded positions are detached, per model, so each model may pad differently.
    """

    stock_types = (nn.Embedding,)

    def __init__(self, *, weight: nn.Parameter, padding_idx: Sequence[int | None]) -> None:
        super().__init__(num_models=int(weight.shape[0]))
        self.num_embeddings = int(weight.shape[1])
        self.embedding_dim = int(weight.shape[2])
        self.weight = weight
        self.padding_idx = list(padding_idx)

    @classmethod
    def from_modules(cls, modules: Sequence[nn.Module]) -> Self:
        check_same(modules, ["num_embeddings", "embedding_dim"])
        for m in modules:
            assert isinstance(m, nn.Embedding)
            if m.max_norm is not None or m.scale_grad_by_freq or m.sparse:
                raise UnsupportedLayerError(
                    "Embedding with max_norm, scale_grad_by_freq or sparse=True cannot be fused"
                )
        weight = stack_parameter(modules, "weight")
        assert weight is not None
        pads: list[int | None] = [getattr(m, "padding_idx", None) for m in modules]
        return cls(weight=weight, padding_idx=pads)

    def keep_models(self, index: torch.Tensor) -> None:
        super().keep_models(index)
        self.padding_idx = [self.padding_idx[i] for i in index.tolist()]

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return lookup(self.weight, idx, self.padding_idx)

    def extra_repr(self) -> str:
        return (
            f"models={self.weight.shape[0]}, num_embeddings={self.num_embeddings}, "
            f"embedding_dim={self.embedding_dim}, padding_idx={self.padding_idx}"
        )
