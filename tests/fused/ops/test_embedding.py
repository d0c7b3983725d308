"""Fidelity of fused embeddings.

B fused models must train exactly like B stock models trained one by one.
"""

from __future__ import annotations

import itertools

import torch
from torch import nn

import plait
from tests.fused.helpers import RTOL, build, train_both


class TokenModel(nn.Module):
    def __init__(self, pad: int | None) -> None:
        super().__init__()
        self.emb = nn.Embedding(7, 4, padding_idx=pad)
        self.out = nn.Linear(4, 3)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.out(self.emb(idx))


def test_embedding_with_per_model_padding_idx() -> None:
    pads = iter([0, 3, None])
    stock = build(lambda: TokenModel(next(pads)), 3)
    array = plait.fuse(stock)
    assert array.emb.padding_idx == [0, 3, None]
    idx = torch.tensor([[[0, 3, 1], [2, 0, 3]]]).expand(3, 2, 3)
    out = array(idx)
    out.sum().backward()
    grad = array.emb.weight.grad
    assert grad is not None
    assert grad[0, 0].abs().sum() == 0 and grad[0, 3].abs().sum() > 0
    assert grad[1, 3].abs().sum() == 0 and grad[1, 0].abs().sum() > 0
    assert grad[2, 0].abs().sum() > 0 and grad[2, 3].abs().sum() > 0

    pads = itertools.cycle([0, 3, None])
    err = train_both(lambda: TokenModel(next(pads)), lambda b: torch.randint(0, 7, (b, 4, 5)))
    assert err <= RTOL
