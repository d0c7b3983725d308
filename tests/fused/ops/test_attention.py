"""Fidelity of fused multi-head attention and its kernels.

B fused models must train exactly like B stock models trained one by one.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import plait
from plait.fused.ops.attention import attention, packed_attention
from tests.fused.helpers import RTOL, build, feats, rel_err, train_both


class Attention(nn.Module):
    def __init__(self, batch_first: bool, need_weights: bool) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2, batch_first=batch_first)
        self.need_weights = need_weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.need_weights:  # settled when tracing: a constant attribute
            out, w = self.attn(x, x, x)
            return out * w.mean()
        return self.attn(x, x, x, need_weights=False)[0]


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("need_weights", [True, False])
def test_multihead_attention(batch_first: bool, need_weights: bool) -> None:
    err = train_both(lambda: Attention(batch_first, need_weights), feats(5, 8))
    assert err <= RTOL


class MaskedAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)

    def forward(self, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        t, s = q.shape[1], kv.shape[1]
        causal = torch.ones((t, s), dtype=torch.bool).triu(1)
        pad = (torch.arange(s) == s - 1).expand(q.shape[0], s)  # the last key is padding
        out, w = self.attn(q, kv, kv, key_padding_mask=pad, attn_mask=causal,
                           average_attn_weights=False)  # fmt: skip
        return out * w.mean()


def test_attention_with_masks_and_cross_inputs() -> None:
    stock = build(MaskedAttention, 2)
    array = plait.fuse(build(MaskedAttention, 2))
    q, kv = torch.randn(2, 3, 4, 8), torch.randn(2, 3, 6, 8)
    out = array(q, kv)
    for i, m in enumerate(stock):
        assert rel_err(out[i], m(q[i], kv[i])) <= RTOL


class PaddedSelfAttention(nn.Module):
    """Self-attention with a padding mask and a float mask: the packed kernel's masked path."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        last = torch.arange(t) == t - 1  # the last token is padding
        pad = torch.zeros(t).masked_fill(last, float("-inf")).expand(x.shape[0], t)
        bias = torch.linspace(-1.0, 1.0, t * t).view(t, t)
        return self.attn(x, x, x, key_padding_mask=pad, attn_mask=bias, need_weights=False)[0]


def test_masked_self_attention() -> None:
    assert train_both(PaddedSelfAttention, feats(5, 8)) <= RTOL


@pytest.mark.parametrize("length", [6, 40])  # the batched-matmul kernel, then torch's
@pytest.mark.parametrize("masked", [False, True])
def test_attention_kernels_match_torch(length: int, masked: bool) -> None:
    torch.manual_seed(0)
    q, k, v = (torch.randn(3, 2, length, 4, dtype=torch.float64, requires_grad=True) for _ in "qkv")
    mask = torch.randn(3, 1, length, length, dtype=torch.float64) if masked else None
    ours = attention(q, k, v, mask=mask, dropout_p=0.0, is_causal=False)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, mask)
    g = torch.randn_like(ref)
    grads = torch.autograd.grad(ours, (q, k, v), g)
    ref_grads = torch.autograd.grad(ref, (q, k, v), g)
    # float64: both kernels compute the same sums in different orders.
    assert rel_err(ours, ref) <= 1e-10
    for a, b in zip(grads, ref_grads, strict=True):
        assert rel_err(a, b) <= 1e-10


@pytest.mark.parametrize(("t", "d"), [(5, 2), (3, 4)])
@pytest.mark.parametrize("mask_heads", [None, 1, 3])  # no mask, shared by heads, per head
def test_packed_attention_matches_torch(mask_heads: int | None, t: int, d: int) -> None:
    torch.manual_seed(0)
    batch, heads = 4, 3
    qkv = torch.randn(batch, t, 3 * heads * d, dtype=torch.float64, requires_grad=True)
    mask = None if mask_heads is None else torch.randn(batch, mask_heads, t, t, dtype=qkv.dtype)
    ours = packed_attention(qkv, heads=heads, mask=mask)
    q, k, v = (x.unflatten(-1, (heads, d)).transpose(1, 2) for x in qkv.chunk(3, dim=-1))
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, mask)
    ref = ref.transpose(1, 2).flatten(2)
    g = torch.randn_like(ref)
    (grad,) = torch.autograd.grad(ours, qkv, g)
    (ref_grad,) = torch.autograd.grad(ref, qkv, g)
    # float64: both kernels compute the same sums in different orders.
    assert rel_err(ours, ref) <= 1e-10
    assert rel_err(grad, ref_grad) <= 1e-10
