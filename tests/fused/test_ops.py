"""Fidelity of every fused layer: B fused models train exactly like B stock models."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

import plait
from plait.fused.ops import ELEMENTWISE, FusedDropout
from plait.fused.ops.attention import attention, packed_attention
from tests.fused.helpers import RTOL, build, rel_err, train_both


def images(c: int, h: int, w: int, n: int = 4):
    return lambda b: torch.randn(b, n, c, h, w)


def seq(c: int, length: int, n: int = 4):
    return lambda b: torch.randn(b, n, c, length)


def feats(*shape: int, n: int = 4):
    return lambda b: torch.randn(b, n, *shape)


CASES = {
    "linear": (
        lambda: nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3, bias=False)),
        feats(6),
    ),
    "linear_3d_input": (lambda: nn.Linear(6, 4), feats(3, 6)),
    "conv1d": (
        lambda: nn.Sequential(
            nn.Conv1d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv1d(4, 2, 2, stride=2)
        ),
        seq(3, 8),
    ),
    "conv2d": (
        lambda: nn.Sequential(
            nn.Conv2d(2, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 4, 3, groups=2, bias=False)
        ),
        images(2, 6, 6),
    ),
    "conv2d_reflect_dilated": (
        lambda: nn.Conv2d(2, 3, 3, padding=2, dilation=2, padding_mode="reflect"),
        images(2, 6, 6),
    ),
    "conv_transpose2d": (
        lambda: nn.Sequential(
            nn.ConvTranspose2d(3, 4, 3, stride=2, padding=1, output_padding=1), nn.Tanh()
        ),
        images(3, 4, 4),
    ),
    "conv_transpose1d": (lambda: nn.ConvTranspose1d(2, 3, 4, stride=2, groups=1), seq(2, 5)),
    "batchnorm1d": (
        lambda: nn.Sequential(nn.Linear(5, 4), nn.BatchNorm1d(4), nn.ReLU(), nn.Linear(4, 2)),
        feats(5, n=6),
    ),
    "batchnorm1d_seq": (lambda: nn.BatchNorm1d(3, momentum=None), seq(3, 5)),
    "batchnorm2d": (
        lambda: nn.Sequential(nn.Conv2d(2, 3, 3), nn.BatchNorm2d(3), nn.ReLU()),
        images(2, 5, 5),
    ),
    "layernorm": (lambda: nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.GELU()), feats(3, 6)),
    "layernorm_2d_shape": (lambda: nn.LayerNorm([3, 4], bias=False), feats(2, 3, 4)),
    "layernorm_no_affine": (
        lambda: nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8, elementwise_affine=False)),
        feats(3, 6),
    ),
    "groupnorm": (
        lambda: nn.Sequential(nn.Conv2d(2, 4, 3), nn.GroupNorm(2, 4), nn.SiLU()),
        images(2, 5, 5),
    ),
    "pooling2d": (
        lambda: nn.Sequential(
            nn.Conv2d(2, 3, 3, padding=1),
            nn.MaxPool2d(2),
            nn.AvgPool2d(2, ceil_mode=True),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(3, 2),
        ),
        images(2, 8, 8),
    ),
    "pooling1d": (
        lambda: nn.Sequential(
            nn.Conv1d(2, 3, 3), nn.MaxPool1d(2), nn.AdaptiveMaxPool1d(2), nn.LPPool1d(2, 2)
        ),
        seq(2, 9),
    ),
    "softmax_flatten": (
        lambda: nn.Sequential(
            nn.Linear(4, 6),
            nn.Unflatten(1, (2, 3)),
            nn.LogSoftmax(dim=-1),
            nn.Flatten(),
            nn.Softmax(dim=1),
        ),
        feats(4),
    ),
    "dropout_p0": (
        lambda: nn.Sequential(nn.Linear(4, 5), nn.Dropout(0.0), nn.Linear(5, 2)),
        feats(4),
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_fused_layer_trains_like_stock(name: str) -> None:
    factory, make_input = CASES[name]
    assert train_both(factory, make_input) <= RTOL


def test_every_elementwise_layer() -> None:
    for cls in ELEMENTWISE:
        layer = cls(0.5, 0.1) if cls is nn.Threshold else cls()
        factory = lambda layer=layer: nn.Sequential(nn.Linear(4, 4), layer, nn.Linear(4, 2))  # noqa: E731
        make = feats(4, 4) if cls is nn.Softmax2d else feats(4)
        assert train_both(factory, make) <= RTOL, cls.__name__


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


# heads narrower than the sequence take the transposed products of `_narrow_bmm`
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


def test_dropout_masks_are_independent_per_model_with_per_model_p() -> None:
    drop = FusedDropout.with_p([0.1, 0.5, 0.9], num_models=3)
    x = torch.ones(3, 200, 50, requires_grad=True)
    out = drop(x)
    kept = out != 0
    for b, p in enumerate([0.1, 0.5, 0.9]):
        # each surviving element is scaled by 1 / (1 - p), as in F.dropout
        assert torch.allclose(out[b][kept[b]], torch.full_like(out[b][kept[b]], 1 / (1 - p)))
        assert abs(1 - kept[b].float().mean().item() - p) < 0.02
    assert not torch.equal(kept[0], kept[1])
    out.sum().backward()
    assert torch.equal(x.grad != 0, kept)  # gradients flow through kept elements only
    drop.eval()
    assert torch.equal(drop(x), x)


def test_shared_probability_uses_independent_masks() -> None:
    torch.manual_seed(0)
    array = plait.fuse(lambda: nn.Dropout(0.5), n=2)
    out = array(torch.ones(2, 100, 10))
    assert not torch.equal(out[0] != 0, out[1] != 0)


@pytest.mark.parametrize(
    ("factory", "shape"),
    [
        (lambda: nn.Sequential(nn.Linear(6, 4), nn.ReLU(), nn.Linear(4, 2)), (5, 6)),
        # no bias before batch norm: its true gradient is 0, so any rounding fails 1e-5
        (
            lambda: nn.Sequential(nn.Conv2d(2, 3, 3, padding=1, bias=False), nn.BatchNorm2d(3)),
            (4, 2, 5, 5),
        ),
        (lambda: nn.Conv1d(2, 4, 3, padding=1, padding_mode="replicate"), (3, 2, 7)),
    ],
)
def test_input_shared_by_all_models(factory: object, shape: tuple[int, ...]) -> None:
    # a batch expanded to every model (stride 0) takes the one-copy path of the first layer
    stock = build(factory, 3)  # type: ignore[arg-type]
    array = plait.fuse(build(factory, 3))  # type: ignore[arg-type]
    x = torch.randn(shape)
    out = array(x.expand(3, *shape))
    # a random linear loss: sum(y**2) after batch norm is constant up to eps, so its
    # gradient would be all cancellation and no kernel order could match it to 1e-5
    g = torch.randn(out.shape[1:])
    (out * g).sum().backward()
    for b, m in enumerate(stock):
        ref = m(x)
        (ref * g).sum().backward()
        assert rel_err(out[b], ref) <= RTOL
        for name, p in m.named_parameters():
            assert rel_err(array.get_parameter(name).grad[b], p.grad) <= RTOL


@pytest.mark.parametrize("pool", [nn.AdaptiveAvgPool2d(1), nn.MaxPool2d(2)])
def test_pooling_hands_back_channels_last_gradients(pool: nn.Module) -> None:
    # fused convolutions can run channels-last (set_conv_layout); a pooling backward that
    # answers in the contiguous layout would put the element-wise backward before it on torch's slow
    # mixed-layout loops, so the gradient must come back in the input's layout
    base = torch.randn(4, 3 * 2, 4, 4).contiguous(memory_format=torch.channels_last)
    base.requires_grad_()
    x = base.unflatten(1, (3, -1)).transpose(0, 1)  # [B=3, N=4, C=2, 4, 4] view
    array = plait.fuse(build(lambda: nn.Sequential(pool), 3))
    out = array(x)
    (grad,) = torch.autograd.grad(out, base, torch.randn_like(out))
    assert grad.is_contiguous(memory_format=torch.channels_last)
    for b in range(3):  # the stock layer's values (a 16-term mean may sum in another order)
        assert rel_err(out[b], pool(x[b].detach())) <= RTOL
