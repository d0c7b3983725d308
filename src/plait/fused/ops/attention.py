"""Fused MultiheadAttention: B models' heads as extra batch entries of one attention call.

Fusing multiplies the attention batch by B while each (sequence, head) block stays as small
as one model's. For the short sequences and narrow heads of sweep-sized models, torch's
CPU flash kernel spends its time on per-block overhead, so its cost grows with the batch
exactly as B separate calls would; batched matmuls and a softmax, with the
probabilities kept for backward, cost about 0.6x as much there (`SmallAttention`). Long
sequences keep the flash kernel, which never materialises the T x S probabilities.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Self

import torch
import torch.nn.functional as F
from torch import nn

from plait.fused import native
from plait.fused.errors import UnsupportedLayerError
from plait.fused.ops.base import FusedModule, check_same, stack_parameter
from plait.fused.ops.linear import FusedLinear, batched_linear

#: Largest T*S attention block that `SmallAttention` handles; beyond it the probabilities
#: it keeps cost more memory traffic than the flash kernel's per-block overhead saves.
SMALL_ATTENTION_MAX_BLOCK = 32 * 32


def _narrow_bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b over [batch, n, k] x [batch, k, m], as (b^T a^T)^T when m < n.

    MKL's batched kernels run a block with a narrow output (a 16 x 16 by 16 x 8 product,
    one head of a sweep-sized model) about 1.5x faster transposed, as an 8 x 16 output
    (measured on CPU). The result is then a transposed view: the packed path's
    concatenations read it in place, and the generic path's reshape copies it once, which
    costs less than the product saves.
    """
    if b.shape[-1] < a.shape[-2]:
        return torch.bmm(b.transpose(1, 2), a.transpose(1, 2)).transpose(1, 2)
    return torch.bmm(a, b)


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(scale * q k^T + mask) v over [batch, T, d] blocks: (probabilities, output)."""
    s = torch.bmm(q, k.transpose(1, 2)).mul_(scale)
    if mask is not None:
        s.add_(mask)
    p = torch.softmax(s, dim=-1)
    return p, _narrow_bmm(p, v)


def _attend_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    p: torch.Tensor,
    *,
    grad: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of `_attend` from its kept probabilities: four batched matmuls and the
    softmax gradient, dS = p * (dP - rowsum(dP * p))."""
    dv = _narrow_bmm(p.transpose(1, 2), grad)
    dp = torch.bmm(grad, v.transpose(1, 2))
    ds = torch._softmax_backward_data(dp, p, -1, p.dtype).mul_(scale)
    return _narrow_bmm(ds, k), _narrow_bmm(ds.transpose(1, 2), q), dv


class SmallAttention(torch.autograd.Function):
    """softmax(scale * q k^T + mask) v over [batch, T, d] blocks, with a batched backward.

    Forward keeps the probabilities for `_attend_backward`, so every kernel of both
    passes sees the whole batch.
    """

    @staticmethod
    def forward(  # noqa: PLR0917 (autograd.Function.apply passes arguments by position)
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor | None,
        scale: float,
    ) -> torch.Tensor:
        p, out = _attend(q, k, v, mask, scale)
        ctx.save_for_backward(q, k, v, p)
        ctx.scale = scale
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, p = ctx.saved_tensors
        return *_attend_backward(q, k, v, p, grad=grad.contiguous(), scale=ctx.scale), None, None


class PackedSmallAttention(torch.autograd.Function):
    """`SmallAttention` reading q, k and v straight from the packed [batch, T, 3E] input
    projection and writing the heads side by side as [batch, T, E].

    Each head is a strided slice of the projection, which batched matmuls read in place,
    so splitting heads copies nothing; forward concatenates the H head outputs once, and
    backward assembles dq, dk and dv of all heads with one concatenation. The generic
    path copies q, k, v and the output in forward and seven such slabs in backward,
    which on a narrow Transformer costs more than the attention's matmuls.
    """

    @staticmethod
    def forward(
        ctx: Any,
        qkv: torch.Tensor,
        heads: int,
        mask: torch.Tensor | None,
        scale: float,
    ) -> torch.Tensor:
        e = qkv.shape[-1] // 3
        d = e // heads
        probs, outs = [], []
        for j in range(heads):
            q, k, v = (qkv[..., i * e + j * d : i * e + (j + 1) * d] for i in range(3))
            p, out = _attend(q, k, v, None if mask is None else mask[:, j], scale)
            probs.append(p)
            outs.append(out)
        ctx.save_for_backward(qkv, *probs)
        ctx.scale, ctx.heads = scale, heads
        return torch.cat(outs, dim=-1)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        qkv, *probs = ctx.saved_tensors
        e = qkv.shape[-1] // 3
        d = e // ctx.heads
        dq, dk, dv = [], [], []
        for j, p in enumerate(probs):
            q, k, v = (qkv[..., i * e + j * d : i * e + (j + 1) * d] for i in range(3))
            g = grad[..., j * d : (j + 1) * d]
            gq, gk, gv = _attend_backward(q, k, v, p, grad=g, scale=ctx.scale)
            dq.append(gq)
            dk.append(gk)
            dv.append(gv)
        return torch.cat(dq + dk + dv, dim=-1), None, None, None


def small_attention_applies(
    t: int, s: int, dtype: torch.dtype, *, dropout_p: float, is_causal: bool
) -> bool:
    """Whether `SmallAttention` (or its packed form) serves a [T, S] attention block."""
    small = t * s <= SMALL_ATTENTION_MAX_BLOCK and dtype in (torch.float32, torch.float64)
    return small and dropout_p == 0.0 and not is_causal


def packed_attention(qkv: torch.Tensor, *, heads: int, mask: torch.Tensor | None) -> torch.Tensor:
    """Self-attention over a packed [batch, T, 3E] projection (q, k, v in turn, each H
    heads of E/H) -> [batch, T, E]; `mask` is additive, [batch, H, T, T] or broadcastable
    to it. Only for blocks `small_attention_applies` to. float32 on a CPU runs the native
    kernel (`plait.fused.native`) where it is available."""
    if qkv.dim() != 3 or qkv.shape[-1] % (3 * heads):
        raise AssertionError(f"packed attention needs [batch, T, 3E] with E % heads == 0, got "
                             f"{tuple(qkv.shape)} and {heads} heads")  # fmt: skip
    lib = native.attention_kernels(qkv, heads=heads, mask=mask)
    if lib is not None:
        return native.packed_attention(qkv, heads=heads, mask=mask, lib=lib)
    if mask is not None:
        mask = mask.expand(qkv.shape[0], heads, qkv.shape[1], qkv.shape[1])
    d = qkv.shape[-1] // (3 * heads)
    out: torch.Tensor = PackedSmallAttention.apply(qkv, heads, mask, 1.0 / math.sqrt(d))
    return out


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mask: torch.Tensor | None,
    dropout_p: float,
    is_causal: bool,
) -> torch.Tensor:
    """Scaled dot-product attention over [batch, heads, T, d], by the cheaper kernel.

    `SmallAttention` for short, dropout-free blocks (an additive mask broadcastable to
    [batch, heads, T, S] is allowed), torch's kernel otherwise.
    """
    *lead, t, d = q.shape
    s = k.shape[-2]
    if not small_attention_applies(t, s, q.dtype, dropout_p=dropout_p, is_causal=is_causal):
        return F.scaled_dot_product_attention(q, k, v, mask, dropout_p, is_causal)
    flat = [x.reshape(-1, x.shape[-2], x.shape[-1]) for x in (q, k, v)]
    m = None if mask is None else mask.expand(*lead, t, s).reshape(-1, t, s)
    out: torch.Tensor = SmallAttention.apply(*flat, m, 1.0 / math.sqrt(d))
    return out.reshape(*lead, t, v.shape[-1])


def additive_mask(mask: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor | None:
    """A boolean mask (True = masked out) as the additive float mask attention uses."""
    if mask is None or mask.is_floating_point():
        return mask
    zeros = torch.zeros(mask.shape, dtype=like.dtype, device=like.device)
    return zeros.masked_fill_(mask, float("-inf"))


class FusedMultiheadAttention(FusedModule):
    """B `nn.MultiheadAttention` layers; in_proj_weight [B, 3E, E], out_proj fused Linear.

    Inputs are [B, N, T, E] (`batch_first`) or [B, T, N, E]; masks carry B first as well:
    attn_mask [B, T, S] or [B, N*H, T, S], key_padding_mask [B, N, S]. Projections are one
    batched matmul each and attention runs once over B*N batch entries.
    """

    stock_types = (nn.MultiheadAttention,)

    def __init__(self, *, template: nn.MultiheadAttention, modules: Sequence[nn.Module]) -> None:
        super().__init__(num_models=len(modules))
        self.embed_dim = int(template.embed_dim)
        self.num_heads = int(template.num_heads)
        self.head_dim = int(template.head_dim)
        self.dropout = float(template.dropout)
        self.batch_first = bool(template.batch_first)
        self.in_proj_weight = stack_parameter(modules, "in_proj_weight")
        self.in_proj_bias = stack_parameter(modules, "in_proj_bias")
        self.out_proj = FusedLinear.from_modules([m.out_proj for m in modules])  # type: ignore[misc]

    @classmethod
    def from_modules(cls, modules: Sequence[nn.Module]) -> Self:
        check_same(modules, ["embed_dim", "num_heads", "dropout", "batch_first"])
        t = modules[0]
        assert isinstance(t, nn.MultiheadAttention)
        if not t._qkv_same_embed_dim or t.bias_k is not None or t.add_zero_attn:
            raise UnsupportedLayerError(
                "MultiheadAttention with kdim/vdim != embed_dim, add_bias_kv or add_zero_attn "
                "cannot be fused"
            )
        return cls(template=t, modules=modules)

    def _project(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        """[B, N, T, E] @ w[B, out, E]^T + b[B, out] -> [B, N, T, out]."""
        y = batched_linear(x.reshape(w.shape[0], -1, x.shape[-1]), w, b)
        return y.view(*x.shape[:-1], w.shape[1])

    def forward(  # noqa: PLR0917 (the stock layer's positional signature)
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_padding_mask: torch.Tensor | None = None,
        need_weights: bool = True,
        attn_mask: torch.Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        unbatched = query.dim() == 3  # each model attends over one unbatched sequence
        seq_first = not self.batch_first and not unbatched
        self_attention = query is key and key is value
        if unbatched:
            query, key, value = (t.unsqueeze(1) for t in (query, key, value))
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(1)
        elif seq_first:  # [B, T, N, E] -> [B, N, T, E]
            query, key, value = (t.transpose(1, 2) for t in (query, key, value))
        nb, n, t, e = query.shape
        s, h, d = key.shape[2], self.num_heads, self.head_dim
        w, bias = self.in_proj_weight, self.in_proj_bias
        assert w is not None
        p = self.dropout if self.training else 0.0
        packed = self_attention and not need_weights and not is_causal
        packed = packed and small_attention_applies(t, s, query.dtype, dropout_p=p,
                                                    is_causal=False)  # fmt: skip
        if packed:
            mask = self._mask(attn_mask, key_padding_mask, like=query, s=s)
            if mask is not None:
                mask = mask.expand(nb, n, h, t, s).reshape(nb * n, h, t, s)
            qkv = self._project(query, w, bias).view(nb * n, t, 3 * e)
            out = packed_attention(qkv, heads=h, mask=mask).view(nb, n, t, e)
            return self._finish(self.out_proj(out), None, unbatched=unbatched, seq_first=seq_first)
        if self_attention:
            q, k, v = self._project(query, w, bias).chunk(3, dim=-1)
        else:
            ws = w.chunk(3, dim=1)
            bs = (None, None, None) if bias is None else bias.chunk(3, dim=1)
            q, k, v = (
                self._project(x, wi, bi)
                for x, wi, bi in zip((query, key, value), ws, bs, strict=True)
            )
        q = q.reshape(nb, n, t, h, d).transpose(2, 3)
        k = k.reshape(nb, n, s, h, d).transpose(2, 3)
        v = v.reshape(nb, n, s, h, d).transpose(2, 3)

        if is_causal and attn_mask is None:
            raise RuntimeError("is_causal needs attn_mask (the causal mask), as in the stock layer")
        if is_causal and key_padding_mask is None and not need_weights:
            mask = None  # the hint suffices: attention applies the causal mask itself
        else:
            is_causal = False
            mask = self._mask(attn_mask, key_padding_mask, like=query, s=s)

        weights: torch.Tensor | None = None
        if need_weights:
            scores = (q * math.sqrt(1.0 / d)) @ k.transpose(-2, -1)
            if mask is not None:
                scores = scores + mask
            attn = F.softmax(scores, dim=-1)
            if p > 0.0:
                attn = F.dropout(attn, p=p)
            out = attn @ v
            weights = attn.mean(dim=2) if average_attn_weights else attn
        else:
            if mask is not None:
                mask = mask.expand(nb, n, h, t, s).reshape(nb * n, h, t, s)
            out = attention(
                q.flatten(0, 1),
                k.flatten(0, 1),
                v.flatten(0, 1),
                mask=mask,
                dropout_p=p,
                is_causal=is_causal,
            ).unflatten(0, (nb, n))
        out = self.out_proj(out.transpose(2, 3).reshape(nb, n, t, e))
        return self._finish(out, weights, unbatched=unbatched, seq_first=seq_first)

    def _mask(
        self,
        attn_mask: torch.Tensor | None,
        key_padding_mask: torch.Tensor | None,
        *,
        like: torch.Tensor,
        s: int,
    ) -> torch.Tensor | None:
        """Both masks as one additive [B, N or 1, H or 1, T, S] mask (None if neither)."""
        nb, n, t, _ = like.shape
        mask = additive_mask(attn_mask, like)
        if mask is not None:
            h = self.num_heads
            mask = mask.view(nb, 1, 1, t, s) if mask.dim() == 3 else mask.view(nb, n, h, t, s)
        kpm = additive_mask(key_padding_mask, like)
        if kpm is not None:
            kpm = kpm.view(nb, n, 1, 1, s)
            mask = kpm if mask is None else mask + kpm
        return mask

    @staticmethod
    def _finish(
        out: torch.Tensor, weights: torch.Tensor | None, *, unbatched: bool, seq_first: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Back to the caller's layout: unbatched or sequence-first as it came."""
        if unbatched:
            return out.squeeze(1), None if weights is None else weights.squeeze(1)
        if seq_first:
            return out.transpose(1, 2), weights
        return out, weights

    def extra_repr(self) -> str:
        return (
            f"models={self.num_models}, embed_dim={self.embed_dim}, num_heads={self.num_heads}, "
            f"batch_first={self.batch_first}"
        )
