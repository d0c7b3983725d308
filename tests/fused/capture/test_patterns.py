"""Graph rewrites before fusion: an operator chain becomes the one kernel it computes."""

from __future__ import annotations

import math

import torch
from torch import nn

import plait
from plait.fused.capture.patterns import simplify
from tests.fused.helpers import rel_err


class WrittenOutGelu(nn.Module):
    """GELU with the tanh approximation as transformers' `NewGELUActivation` writes it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        inner = math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))
        return 0.5 * x * (1.0 + torch.tanh(inner))


def test_gelu_tanh_chain_becomes_one_kernel() -> None:
    x = torch.randn(4, 7)
    ep = torch.export.export(WrittenOutGelu(), (x,), strict=False)
    module = ep.graph_module
    assert simplify(module) == 1
    ops = [n.target for n in module.graph.nodes if n.op == "call_function"]
    assert ops == [torch.ops.aten.gelu.default]
    # the kernel computes the same function to float rounding
    assert rel_err(ep.module()(x), WrittenOutGelu()(x)) <= 1e-6
    assert simplify(module) == 0  # nothing left to replace


class WrittenOutRMSNorm(nn.Module):
    """RMSNorm as transformers' `LlamaRMSNorm` writes it (float32 round trip included)."""

    def __init__(self, width: int, *, reuse_variance: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.rand(width) + 0.5)
        self.reuse_variance = reuse_variance

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to(torch.float32)
        variance = h.pow(2).mean(-1, keepdim=True)
        h = h * torch.rsqrt(variance + 1e-6)
        out = self.weight * h.to(dtype)
        return out + variance if self.reuse_variance else out


def test_rms_norm_chain_becomes_one_operator() -> None:
    x = torch.randn(4, 3, 8)
    model = WrittenOutRMSNorm(8)
    ep = torch.export.export(model, (x,), strict=False)
    module = ep.graph_module
    assert simplify(module) == 1
    ops = [n.target for n in module.graph.nodes if n.op == "call_function"]
    assert torch.ops.aten.rms_norm.default in ops
    assert not {torch.ops.aten.pow.Tensor_Scalar, torch.ops.aten.rsqrt.default} & set(ops)
    assert rel_err(ep.module()(x), model(x)) <= 1e-6
    assert simplify(module) == 0


def test_rms_norm_chain_whose_pieces_are_reused_is_left_alone() -> None:
    """The variance feeds something else too: replacing the chain would drop it."""
    x = torch.randn(4, 3, 8)
    model = WrittenOutRMSNorm(8, reuse_variance=True)
    ep = torch.export.export(model, (x,), strict=False)
    assert simplify(ep.graph_module) == 0
    assert rel_err(ep.module()(x), model(x)) <= 1e-6


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RotaryGroupedAttention(nn.Module):
    """Attention as transformers' Llama writes it: the rotary embedding applied to q and k
    from position tables, then k and v repeated per query head (`repeat_kv`)."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.kv = nn.Linear(8, 8), nn.Linear(8, 8)
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, 4, 2) / 4),
                             persistent=False)  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        angles = torch.arange(t)[:, None] * self.inv_freq[None, :]
        emb = torch.cat((angles, angles), dim=-1)
        cos, sin = emb.cos()[None, None], emb.sin()[None, None]
        q = self.q(x).view(b, t, 2, 4).transpose(1, 2)  # 2 query heads of 4
        k, v = self.kv(x).view(b, t, 2, 4).transpose(1, 2).chunk(2, dim=1)  # 1 kv head
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        k = k[:, :, None].expand(b, 1, 2, t, 4).reshape(b, 2, t, 4)
        v = v[:, :, None].expand(b, 1, 2, t, 4).reshape(b, 2, t, 4)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


def test_rotary_and_repeated_keys_become_one_operator_and_grouped_attention() -> None:
    torch.manual_seed(0)
    x = torch.randn(3, 6, 8)
    model = RotaryGroupedAttention()
    ep = torch.export.export(model, (x,), strict=False)
    module = ep.graph_module
    assert simplify(module) == 3  # two rotary embeddings, one grouped-query attention
    nodes = [n for n in module.graph.nodes if n.op == "call_function"]
    assert sum(n.target is torch.ops.plait.rotary.default for n in nodes) == 2
    sdpa = torch.ops.aten.scaled_dot_product_attention.default
    (attend,) = (n for n in nodes if n.target is sdpa)
    assert attend.kwargs["enable_gqa"] is True
    assert attend.args[1].meta["val"].shape[1] == 1  # k read unrepeated
    assert not any(n.target is torch.ops.aten.expand.default for n in nodes)
    assert rel_err(ep.module()(x), model(x)) <= 1e-6


def test_fused_array_of_the_rotary_grouped_attention_trains_like_stock() -> None:
    """Through plait.fuse (native rotary and attention kernels where they apply): each
    member's output and gradients equal its stock twin's."""
    torch.manual_seed(0)
    models = [RotaryGroupedAttention() for _ in range(3)]
    array = plait.fuse(models)
    x = torch.randn(3, 2, 6, 8)
    out = array(x)
    out.square().sum().backward()
    for b, m in enumerate(models):
        ref = m(x[b])
        ref.square().sum().backward()
        assert rel_err(out[b], ref) <= 1e-5
        for name, p in m.named_parameters():
            assert rel_err(array.get_parameter(name).grad[b], p.grad) <= 1e-5
