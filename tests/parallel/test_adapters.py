"""Adapters: model shapes, tensor-degree checks, and the stock attention conversion."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from plait.parallel import ModelDims, adapter_for
from plait.parallel.adapters import HeadParallelAttention
from tests.parallel.common import GPT_CFG, encoder_lm, gpt


def test_gpt_dims() -> None:
    model = gpt()
    dims = adapter_for(model).dims(model)
    assert (dims.layers, dims.hidden, dims.heads, dims.ffn) == (4, 32, 4, 128)
    assert dims.params == sum(p.numel() for p in model.parameters())
    assert dims.other_params == dims.params - 4 * dims.block_params
    assert dims.seq_len == GPT_CFG.block_size
    assert dims.largest_param == max(p.numel() for p in model.parameters())
    assert dims.no_pipeline == ""


def test_dims_say_why_a_pipeline_cannot_split_a_model() -> None:
    """Tied parameters (a head sharing the embedding's weight) or no split into stages:
    the planner reads `no_pipeline` and proposes no pipeline for either."""
    tied = nn.Sequential(nn.Embedding(8, 4), nn.Linear(4, 4), nn.Linear(4, 8, bias=False))
    tied[2].weight = tied[0].weight
    dims = adapter_for(tied).dims(tied)
    assert dims.no_pipeline == "0.weight is tied to 2.weight"

    class Opaque(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.inner(x)

    opaque = Opaque()
    assert "has no pipeline split" in adapter_for(opaque).dims(opaque).no_pipeline


def test_tensor_degree_check_names_the_dimension() -> None:
    dims = ModelDims(layers=2, hidden=48, heads=3, ffn=96, params=1, block_params=0, seq_len=10)
    dims.check_tensor_degree(3)
    with pytest.raises(ValueError, match="does not divide heads=3"):
        dims.check_tensor_degree(2)
    with pytest.raises(ValueError, match="sequence length"):
        dims.check_tensor_degree(3, sequence=True)
    plain = adapter_for(nn.Linear(2, 2)).dims(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="no tensor-parallel plan"):
        plain.check_tensor_degree(2)


@pytest.mark.parametrize("batch_first", [True, False])
def test_head_parallel_attention_equals_multihead_attention(batch_first: bool) -> None:
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(16, 4, batch_first=batch_first)
    hpa = HeadParallelAttention.from_mha(mha)
    x = torch.randn(3, 5, 16)
    mask = torch.zeros(3, 5, dtype=torch.bool)
    mask[:, -1] = True  # padding on the last key
    want, _ = mha(x, x, x, key_padding_mask=mask if batch_first else None)
    got, _ = hpa(x, x, x, key_padding_mask=mask if batch_first else None)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_encoder_adapter_converts_attention_and_keeps_outputs() -> None:
    model: Any = encoder_lm()
    x = torch.randint(0, 64, (2, 8))
    want = model(x)
    adapter = adapter_for(model)
    adapter.prepare(model)
    assert len(adapter.blocks(model)) == 4
    assert isinstance(model[1].layers[0].self_attn, HeadParallelAttention)
    torch.testing.assert_close(model(x), want, rtol=1e-5, atol=1e-6)
