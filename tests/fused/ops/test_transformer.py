"""Fidelity of fused Transformer encoder layers.

B fused models must train exactly like B stock models trained one by one.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.fused.helpers import RTOL, feats, train_both


@pytest.mark.parametrize("norm_first", [True, False])
@pytest.mark.parametrize("batch_first", [True, False])
def test_transformer_encoder_layer(norm_first: bool, batch_first: bool) -> None:
    def factory() -> nn.Module:
        return nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=batch_first,
                                          norm_first=norm_first, activation="gelu")  # fmt: skip

    assert train_both(factory, feats(5, 8)) <= RTOL


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 2, norm=nn.LayerNorm(8), enable_nested_tensor=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(t)
        return self.enc(x, mask=mask, is_causal=True)


def test_transformer_encoder_with_causal_mask() -> None:
    assert train_both(Encoder, feats(5, 8)) <= RTOL
