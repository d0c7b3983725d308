"""Autograd functions over the native kernels, and when each one applies.

Each function mirrors a torch path of a fused layer and is chosen only where its kernel
exists: float32 CPU tensors, sizes within the kernels' fixed buffers, and a library that
built (`plait.fused.native.build`). Callers ask `*_kernels(...)` first and keep their torch
path when it returns None. The kernels themselves are torch operators
(`plait.fused.native.ops`), so the profiler names them and `torch.compile` traces a fused
array through them; under `torch.compile` the `*_kernels` answer is taken once, when the
graph is traced (switching the kernels off later does not change a compiled graph).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, cast

import torch
from torch import Tensor

from plait.fused.native import ops
from plait.fused.native.build import load
from plait.fused.native.ops import Kernels
from plait.trace import profiler_active

#: Widest attention head and layer-norm row served: the kernels keep a head's or a
#: row's values in fixed-size local arrays, and wider ones are where torch's own
#: kernels stop being dominated by per-row overhead.
MAX_WIDTH = 64
#: Longest sequence served: the kernels hold a block's scores (SEQ x SEQ) locally.
MAX_SEQ = 32


def _ops() -> Any:
    """The operators through the dispatcher where someone looks (`torch.compile` tracing,
    a profiler recording), else their implementations called directly: the dispatcher's
    round trip into Python costs microseconds per call, a tenth of a sweep-sized kernel."""
    if torch.compiler.is_compiling() or profiler_active():
        return ops
    return ops.direct


def _is_cpu_f32(*tensors: Tensor | None) -> bool:
    return all(t is None or (t.device.type == "cpu" and t.dtype == torch.float32) for t in tensors)


def _find_kernels(seq: int = 0, head: int = 0, width: int = 0) -> Kernels | None:
    """The sizes of the library compiled for these sizes (0: not a parameter), or None.

    Building or loading a library is no graph operation: `torch.compile` calls this once
    while tracing and keeps its answer as a constant.
    """
    sizes = {k: v for k, v in (("SEQ", seq), ("HEAD", head), ("WIDTH", width)) if v}
    lib = load(**sizes)
    if lib is None:
        return None
    key = tuple(sorted(sizes.items()))
    ops.served[key] = lib
    return key


_kernels = cast(
    "Callable[..., Kernels | None]", torch.compiler.assume_constant_result(_find_kernels)
)


def attention_kernels(qkv: Tensor, *, heads: int, mask: Tensor | None) -> Kernels | None:
    """The kernels serving self-attention over this packed [batch, T, 3E] input, or None."""
    if qkv.dim() != 3 or not _is_cpu_f32(qkv, mask):
        return None
    t, d = qkv.shape[1], qkv.shape[2] // (3 * heads)
    if not (1 <= t <= MAX_SEQ and 1 <= d <= MAX_WIDTH):
        return None
    return _kernels(seq=t, head=d)


class PackedAttention(torch.autograd.Function):
    """softmax(scale * q k^T + mask) v for every (sequence, head) of a packed projection.

    The forward keeps the probabilities; the backward recomputes nothing else.
    """

    @staticmethod
    def forward(ctx: Any, qkv: Tensor, heads: int, mask: Tensor | None, scale: float) -> Tensor:
        qkv = qkv.contiguous()
        out, probs = _ops().attention(qkv, mask, heads, scale)
        ctx.save_for_backward(qkv, probs)
        ctx.heads, ctx.scale = heads, scale
        return out  # type: ignore[no-any-return]

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        qkv, probs = ctx.saved_tensors
        dqkv = _ops().attention_backward(qkv, probs, grad.contiguous(), ctx.heads, ctx.scale)
        return dqkv, None, None, None


def packed_attention(qkv: Tensor, *, heads: int, mask: Tensor | None, lib: Kernels) -> Tensor:
    """`plait.fused.ops.attention.packed_attention` on the native kernel (`lib` from
    `attention_kernels`); `mask` is additive and broadcastable to [batch, H, T, T]."""
    nb, t, e3 = qkv.shape
    if mask is not None:
        mask = mask.expand(nb, heads, t, t)
    out: Tensor = PackedAttention.apply(qkv, heads, mask, 1.0 / math.sqrt(e3 // (3 * heads)))
    return out


#: Longest sequence `attention_heads` serves: its backward holds two SEQ x SEQ and one
#: HEAD x SEQ float arrays per block on a thread's stack (48 KiB at 64 and 64).
MAX_HEADS_SEQ = 64


def attention_heads_kernels(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Kernels | None:
    """The kernels serving self-attention of these [nb, heads, T, d] q, k, v, or None:
    float32 on a CPU, rows of d contiguous, as long keys as queries, heads a multiple of
    k's and v's (grouped-query attention) and a mask broadcastable to [nb, heads, T, T]."""
    if not (q.dim() == k.dim() == v.dim() == 4) or not _is_cpu_f32(q, k, v, mask):
        return None
    nb, heads, t, d = q.shape
    kv = k.shape[1]
    if k.shape != v.shape or k.shape != (nb, kv, t, d) or kv == 0 or heads % kv:
        return None
    if any(x.stride(-1) != 1 for x in (q, k, v)):
        return None
    if mask is not None and (mask.dim() != 4 or mask.dtype != torch.float32):
        return None
    if not (1 <= t <= MAX_HEADS_SEQ and 1 <= d <= MAX_WIDTH):
        return None
    return _kernels(seq=t, head=d)


class HeadsAttention(torch.autograd.Function):
    """Self-attention with dropout of the probabilities inside the kernel (see
    `attention_heads`): the forward keeps the probabilities before dropout and the seed,
    the backward recomputes the dropout factors from them."""

    @staticmethod
    def forward(  # noqa: PLR0917 (autograd passes the arguments positionally)
        ctx: Any, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool,
        p: Tensor | None, scale: float,
    ) -> Tensor:  # fmt: skip
        seed = 0 if p is None else int(torch.randint(0, 2**62, (), dtype=torch.int64))
        out, probs = _ops().attention_heads(q, k, v, mask, causal, p, seed, scale)
        ctx.save_for_backward(q, k, v, probs)
        ctx.p, ctx.seed, ctx.scale = p, seed, scale
        return out  # type: ignore[no-any-return]

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, probs = ctx.saved_tensors
        dq, dk, dv = _ops().attention_heads_backward(
            q, k, v, probs, grad.contiguous(), ctx.p, ctx.seed, ctx.scale
        )
        return dq, dk, dv, None, None, None, None


def attention_heads(
    q: Tensor, k: Tensor, v: Tensor, *, mask: Tensor | None, causal: bool,
    dropout: list[float] | None, scale: float, lib: Kernels,
) -> Tensor:  # fmt: skip
    """scaled_dot_product_attention of [nb, heads, T, d] q and [nb, kv_heads, T, d] k, v on
    the native kernel (`lib` from `attention_heads_kernels`), [nb, heads, T, d] out.

    Scores, the causal or additive `mask`, the softmax, dropout of the probabilities (the
    nb rows split into len(dropout) models, each at its own rate) and the product with v
    run in one pass per (sequence, head), where torch's math path makes each a separate
    [nb, heads, T, T] tensor. The output is a transposed view of [nb, T, heads, d], the
    layout a model reshapes attention to next, so that reshape copies nothing.
    """
    del lib
    p = None if dropout is None or not any(dropout) else torch.tensor(dropout, dtype=torch.float32)
    if mask is not None:
        mask = mask.expand(q.shape[0], q.shape[1], q.shape[2], q.shape[2])
    out: Tensor = HeadsAttention.apply(q, k, v, mask, causal, p, scale)
    return out.transpose(1, 2)


def gelu_kernels(x: Tensor, *, approximate: str) -> Kernels | None:
    """The kernels serving GELU of x (float32 on a CPU, the tanh form), or None."""
    if approximate != "tanh" or not _is_cpu_f32(x):
        return None
    return _kernels()


class _GeluTanh(torch.autograd.Function):
    """GELU (tanh form) whose backward recomputes from the input: only x is kept."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        x = x.contiguous()
        ctx.save_for_backward(x)
        return _ops().gelu_tanh(x)  # type: ignore[no-any-return]

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        (x,) = ctx.saved_tensors
        return _ops().gelu_tanh_backward(grad.contiguous(), x)  # type: ignore[no-any-return]


def gelu(x: Tensor, *, lib: Kernels) -> Tensor:
    """`F.gelu(x, approximate="tanh")` (GPT-2's activation) on the native kernel (`lib`
    from `gelu_kernels`): 1.6-2.8x faster than torch's CPU kernel forward and backward
    (measured, see kernels.c), which took a tenth of a fused GPT-2's step."""
    del lib
    out: Tensor = _GeluTanh.apply(x)
    return out


def rotary_kernels(x: Tensor, cos: Tensor, sin: Tensor) -> Kernels | None:
    """The kernels serving the rotary embedding of x [..., T, d] with cos and sin that
    broadcast as [T, d] (float32 on a CPU, d even), or None."""
    if not _is_cpu_f32(x, cos, sin) or x.dim() < 2 or x.shape[-1] % 2:
        return None
    t, d = x.shape[-2:]
    for table in (cos, sin):
        if table.shape[-2:] != (t, d) or table.numel() != t * d:
            return None
    return _kernels()


class _Rotary(torch.autograd.Function):
    """The rotary embedding with constant cos and sin: the backward needs only them."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        ctx.save_for_backward(cos, sin)
        return _ops().rotary_kernel(x.contiguous(), cos, sin)  # type: ignore[no-any-return]

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        cos, sin = ctx.saved_tensors
        return _ops().rotary_kernel_backward(grad.contiguous(), cos, sin), None, None


def rotary(x: Tensor, cos: Tensor, sin: Tensor, *, lib: Kernels) -> Tensor:
    """`ops.rotary_reference` on the native kernel (`lib` from `rotary_kernels`): one pass
    each way where torch's operators take seven forward and more backward (2.5 ms a step
    of a fused Llama of 16 models, measured). cos and sin get no gradient: a model builds
    them from positions and constant frequencies."""
    del lib
    t, d = x.shape[-2:]
    cos, sin = (table.reshape(t, d).contiguous() for table in (cos, sin))
    out: Tensor = _Rotary.apply(x, cos, sin)
    return out


def layer_norm_kernels(
    x: Tensor, *, width: int, weight: Tensor | None, bias: Tensor | None
) -> Kernels | None:
    """The kernels serving layer norm of `width`-wide rows of x, or None."""
    if not (1 <= width <= MAX_WIDTH) or not _is_cpu_f32(x, weight, bias):
        return None
    return _kernels(width=width)


class AffineLayerNorm(torch.autograd.Function):
    """Layer norm of [models, rows, width] with each model's own weight and bias
    ([models, width], or None): the normalisation and the affine in one pass each way."""

    @staticmethod
    def forward(  # noqa: PLR0917 (autograd passes the arguments positionally)
        ctx: Any, x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float,
        centred: bool,
    ) -> Tensor:  # fmt: skip
        x = x.contiguous()
        w = None if weight is None else weight.contiguous()
        b = None if bias is None else bias.contiguous()
        y, mean, rstd = _ops().layer_norm(x, w, b, eps, centred)
        ctx.save_for_backward(x, mean, rstd, w)
        ctx.has_bias, ctx.centred = bias is not None, centred
        return y  # type: ignore[no-any-return]

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        x, mean, rstd, w = ctx.saved_tensors
        weight_grad = w is not None and ctx.needs_input_grad[1]
        bias_grad = ctx.has_bias and ctx.needs_input_grad[2]
        dx, dw, db = _ops().layer_norm_backward(
            grad.contiguous(), x, mean, rstd, w, weight_grad, bias_grad, ctx.centred
        )
        return dx, dw if weight_grad else None, db if bias_grad else None, None, None


def layer_norm(
    x: Tensor,
    *,
    width: int,
    weight: Tensor | None,
    bias: Tensor | None,
    eps: float,
    lib: Kernels,
    centred: bool = True,
) -> Tensor:
    """Layer norm over the trailing `width` elements of x [B, ...], with model b's affine
    from weight[b] and bias[b] ([B, ...] holding `width` elements each, or None); not
    `centred`, RMSNorm (`F.rms_norm`: the root mean square for the deviation, no mean
    subtracted)."""
    models = x.shape[0] if weight is not None or bias is not None else 1
    flat = x.reshape(models, -1, width)
    w = None if weight is None else weight.reshape(models, width)
    b = None if bias is None else bias.reshape(models, width)
    y: Tensor = AffineLayerNorm.apply(flat, w, b, eps, centred)
    return y.view(x.shape)


def adam_kernels(*tensors: Tensor) -> Kernels | None:
    """The kernels serving `adam_step` over these tensors (float32, CPU, contiguous), or None."""
    if not all(t.is_contiguous() for t in tensors) or not _is_cpu_f32(*tensors):
        return None
    return _kernels()


def adam_step(
    lib: Kernels,
    *,
    params: list[Tensor],
    grads: list[Tensor],
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    step_size: list[float],
    beta1: float,
    beta2: float,
    eps: float,
    bc2_sqrt: float,
) -> None:
    """Adam over B models in place: params[i] and grads[i] are [B, ...], exp_avg and
    exp_avg_sq flat [B, T] with the parameters side by side in order; model b moves by
    step_size[b] (its lr / (1 - beta1^step)) times m / (sqrt(v) / bc2_sqrt + eps).
    `lib` is `adam_kernels`'s answer."""
    _ops().adam_step(
        params,
        grads,
        exp_avg,
        exp_avg_sq,
        [float(s) for s in step_size],
        beta1,
        beta2,
        eps,
        bc2_sqrt,
    )
    # the kernel wrote the parameters behind autograd's back: bump their version counters
    # as an in-place torch op would, so a graph that saved them reports the change
    torch.autograd.graph.increment_version(params)


def dropout_kernels(x: Tensor) -> Kernels | None:
    """The kernels serving `dropout` of x (float32 on a CPU), or None."""
    if not _is_cpu_f32(x):
        return None
    return _kernels()


class _Dropout(torch.autograd.Function):
    """Dropout whose mask is a function of a seed: the backward applies the same kernel
    to the gradient, so no mask is stored."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, p: Tensor, seed: int) -> Tensor:
        ctx.p, ctx.seed = p, seed
        return _ops().dropout(x.contiguous(), p, seed)  # type: ignore[no-any-return]

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        return _ops().dropout(grad.contiguous(), ctx.p, ctx.seed), None, None


def dropout(x: Tensor, p: list[float], *, lib: Kernels) -> Tensor:
    """Dropout of [B, ...] `x`, model b at probability p[b], on the native kernel (`lib`
    from `dropout_kernels`). Each element draws from a counter-based hash of a seed taken
    from torch's generator (so `torch.manual_seed` makes it repeatable) and its position:
    every element and every model draws independently, in parallel over torch's threads.

    torch's CPU `bernoulli_` draws serially from one generator, several times slower than
    the hash on one core and unable to use the second; in a fused GPT-2 of 16 models it
    took 13% of the training step (measured)."""
    del lib
    seed = int(torch.randint(0, 2**62, (), dtype=torch.int64))
    probs = torch.tensor(p, dtype=torch.float32)
    out: Tensor = _Dropout.apply(x, probs, seed)
    return out
