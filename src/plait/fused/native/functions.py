"""Autograd functions over the native kernels, and when each one applies.

Each function mirrors a torch path of a fused layer and is chosen only where its kernel
exists: float32 CPU tensors, sizes within the kernels' fixed buffers, and a library that
built (`plait.fused.native.build`). Callers ask `*_kernels(...)` first and keep their torch
path when it returns None.
"""

from __future__ import annotations

import ctypes
import functools
import math
from typing import Any

import torch

from plait.fused.native.build import load

#: Widest attention head and layer-norm row served: the kernels keep a head's or a
#: row's values in fixed-size local arrays, and wider ones are where torch's own
#: kernels stop being dominated by per-row overhead.
MAX_WIDTH = 64
#: Longest sequence served: the kernels hold a block's scores (SEQ x SEQ) locally.
MAX_SEQ = 32


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _is_cpu_f32(*tensors: torch.Tensor | None) -> bool:
    return all(t is None or (t.device.type == "cpu" and t.dtype == torch.float32)
               for t in tensors)  # fmt: skip


def attention_kernels(
    qkv: torch.Tensor, *, heads: int, mask: torch.Tensor | None
) -> ctypes.CDLL | None:
    """The library serving self-attention over this packed [batch, T, 3E] input, or None."""
    if qkv.dim() != 3 or not _is_cpu_f32(qkv, mask):
        return None
    t, d = qkv.shape[1], qkv.shape[2] // (3 * heads)
    if not (1 <= t <= MAX_SEQ and 1 <= d <= MAX_WIDTH):
        return None
    return load(SEQ=t, HEAD=d)


class PackedAttention(torch.autograd.Function):
    """softmax(scale * q k^T + mask) v for every (sequence, head) of a packed projection.

    The forward keeps the probabilities; the backward recomputes nothing else.
    """

    @staticmethod
    def forward(  # noqa: PLR0917 (autograd.Function.apply passes arguments by position)
        ctx: Any,
        qkv: torch.Tensor,
        heads: int,
        mask: torch.Tensor | None,
        scale: float,
        lib: ctypes.CDLL,
    ) -> torch.Tensor:
        qkv = qkv.contiguous()
        nb, t, e3 = qkv.shape
        out = qkv.new_empty(nb, t, e3 // 3)
        probs = qkv.new_empty(nb, heads, t, t)
        strides = (0, 0, 0, 0) if mask is None else mask.stride()
        threads = torch.get_num_threads()
        lib.attention_forward(qkv.data_ptr(), _ptr(mask), *strides, out.data_ptr(),
                              probs.data_ptr(), nb, heads, scale, threads)  # fmt: skip
        ctx.save_for_backward(qkv, probs)
        ctx.heads, ctx.scale, ctx.lib = heads, scale, lib
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        qkv, probs = ctx.saved_tensors
        grad = grad.contiguous()
        dqkv = torch.empty_like(qkv)
        ctx.lib.attention_backward(qkv.data_ptr(), probs.data_ptr(), grad.data_ptr(),
                                   dqkv.data_ptr(), qkv.shape[0], ctx.heads, ctx.scale,
                                   torch.get_num_threads())  # fmt: skip
        return dqkv, None, None, None, None


def packed_attention(
    qkv: torch.Tensor, *, heads: int, mask: torch.Tensor | None, lib: ctypes.CDLL
) -> torch.Tensor:
    """`plait.fused.ops.attention.packed_attention` on the native kernel (from
    `attention_kernels`); `mask` is additive and broadcastable to [batch, H, T, T]."""
    nb, t, e3 = qkv.shape
    if mask is not None:
        mask = mask.expand(nb, heads, t, t)
    out: torch.Tensor = PackedAttention.apply(
        qkv, heads, mask, 1.0 / math.sqrt(e3 // (3 * heads)), lib
    )
    return out


def layer_norm_kernels(
    x: torch.Tensor, *, width: int, weight: torch.Tensor | None, bias: torch.Tensor | None
) -> ctypes.CDLL | None:
    """The library serving layer norm of `width`-wide rows of x, or None."""
    if not (1 <= width <= MAX_WIDTH) or not _is_cpu_f32(x, weight, bias):
        return None
    return load(WIDTH=width)


class AffineLayerNorm(torch.autograd.Function):
    """Layer norm of [models, rows, width] with each model's own weight and bias
    ([models, width], or None): the normalisation and the affine in one pass each way."""

    @staticmethod
    def forward(  # noqa: PLR0917 (autograd.Function.apply passes arguments by position)
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        eps: float,
        lib: ctypes.CDLL,
    ) -> torch.Tensor:
        x = x.contiguous()
        models, rows, _ = x.shape
        w = None if weight is None else weight.contiguous()
        b = None if bias is None else bias.contiguous()
        y = torch.empty_like(x)
        mean = x.new_empty(models * rows)
        rstd = x.new_empty(models * rows)
        threads = torch.get_num_threads()
        lib.layer_norm_forward(x.data_ptr(), _ptr(w), _ptr(b), y.data_ptr(), mean.data_ptr(),
                               rstd.data_ptr(), models, rows, eps, threads)  # fmt: skip
        ctx.save_for_backward(x, mean, rstd, w)
        ctx.lib, ctx.has_bias = lib, bias is not None
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, mean, rstd, w = ctx.saved_tensors
        grad = grad.contiguous()
        models, rows, _ = x.shape
        dx = torch.empty_like(x)
        dw = None if w is None or not ctx.needs_input_grad[1] else torch.empty_like(w)
        db = None
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = x.new_empty(models, x.shape[2])
        ctx.lib.layer_norm_backward(grad.data_ptr(), x.data_ptr(), mean.data_ptr(),
                                    rstd.data_ptr(), _ptr(w), dx.data_ptr(), _ptr(dw),
                                    _ptr(db), models, rows, torch.get_num_threads())  # fmt: skip
        return dx, dw, db, None, None


def layer_norm(
    x: torch.Tensor,
    *,
    width: int,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    lib: ctypes.CDLL,
) -> torch.Tensor:
    """Layer norm over the trailing `width` elements of x [B, ...], with model b's affine
    from weight[b] and bias[b] ([B, ...] holding `width` elements each, or None)."""
    models = x.shape[0] if weight is not None or bias is not None else 1
    flat = x.reshape(models, -1, width)
    w = None if weight is None else weight.reshape(models, width)
    b = None if bias is None else bias.reshape(models, width)
    y: torch.Tensor = AffineLayerNorm.apply(flat, w, b, eps, lib)
    return y.view(x.shape)


def adam_kernels(*tensors: torch.Tensor) -> ctypes.CDLL | None:
    """The library serving `adam_step` over these tensors (float32, CPU, contiguous), or None."""
    if not all(t.is_contiguous() for t in tensors) or not _is_cpu_f32(*tensors):
        return None
    return load()


def adam_step(
    lib: ctypes.CDLL,
    *,
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    step_size: list[float],
    beta1: float,
    beta2: float,
    eps: float,
    bc2_sqrt: float,
) -> None:
    """Adam over B models in place: params[i] and grads[i] are [B, ...], exp_avg and
    exp_avg_sq flat [B, T] with the parameters side by side in order; model b moves by
    step_size[b] (its lr / (1 - beta1^step)) times m / (sqrt(v) / bc2_sqrt + eps)."""
    models, total = exp_avg.shape
    sizes, offsets = _sizes_and_offsets(tuple(p.numel() // models for p in params))
    n = len(params)
    ptrs = ctypes.c_void_p * n
    lib.adam_step(n, sizes, offsets,
                  ptrs(*[p.data_ptr() for p in params]), ptrs(*[g.data_ptr() for g in grads]),
                  exp_avg.data_ptr(), exp_avg_sq.data_ptr(), models, total,
                  (ctypes.c_float * models)(*step_size), beta1, beta2, eps, bc2_sqrt,
                  torch.get_num_threads())  # fmt: skip
    # the kernel wrote the parameters behind autograd's back: bump their version counters
    # as an in-place torch op would, so a graph that saved them reports the change
    torch.autograd.graph.increment_version(params)


@functools.lru_cache(maxsize=256)
def _sizes_and_offsets(sizes: tuple[int, ...]) -> tuple[ctypes.Array[ctypes.c_int64], ...]:
    """Per-model parameter sizes and their column offsets in the flat state, as C arrays
    (made once per layout: the step is called with the same layout every time)."""
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    return (ctypes.c_int64 * len(sizes))(*sizes), (ctypes.c_int64 * len(sizes))(*offsets)
