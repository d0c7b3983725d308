"""The native kernels as torch operators: ``torch.ops.plait.*``.

Each kernel is defined in the ``plait`` operator namespace with a CPU implementation
(the ctypes call) and a fake one that only computes output shapes. Through the
dispatcher the profiler names them (``plait::attention``, ...), and `torch.compile`
keeps them in its graph as opaque calls (their fake implementations give it the shapes)
instead of breaking the graph at a ctypes call it cannot trace.

They are defined with `torch.library.Library` rather than the `torch.library.custom_op`
decorator, whose Python wrappers cost several times more per call (measured), and
autograd stays with the `torch.autograd.Function` wrappers in
`plait.fused.native.functions`, which call the implementations directly (`direct`) when
nobody traces or profiles.

The operators find their library by the sizes of their inputs in `served`, which
`plait.fused.native.functions` fills when it chooses a kernel.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch
from torch import Tensor

#: Which compiled library serves a size: ``(("HEAD", 16), ("SEQ", 8))``, ``()`` for Adam.
Kernels = tuple[tuple[str, int], ...]
#: The libraries chosen so far, by their sizes.
served: dict[Kernels, ctypes.CDLL] = {}

_LIB = torch.library.Library("plait", "DEF")
_SCHEMAS = {
    "attention": "(Tensor qkv, Tensor? mask, int heads, float scale) -> (Tensor, Tensor)",
    "attention_backward": "(Tensor qkv, Tensor probs, Tensor grad, int heads, float scale) "
    "-> Tensor",
    "layer_norm": "(Tensor x, Tensor? weight, Tensor? bias, float eps, bool centred=True) "
    "-> (Tensor, Tensor, Tensor)",
    "layer_norm_backward": "(Tensor grad, Tensor x, Tensor mean, Tensor rstd, Tensor? weight, "
    "bool weight_grad, bool bias_grad, bool centred=True) -> (Tensor, Tensor, Tensor)",
    "adam_step": "(Tensor(a!)[] params, Tensor[] grads, Tensor(b!) exp_avg, "
    "Tensor(c!) exp_avg_sq, float[] step_size, float beta1, float beta2, float eps, "
    "float bc2_sqrt) -> ()",
    "dropout": "(Tensor x, Tensor p, int seed) -> Tensor",
    "gelu_tanh": "(Tensor x) -> Tensor",
    "gelu_tanh_backward": "(Tensor grad, Tensor x) -> Tensor",
    "rotary": "(Tensor x, Tensor cos, Tensor sin) -> Tensor",
    "rotary_kernel": "(Tensor x, Tensor cos, Tensor sin) -> Tensor",
    "rotary_kernel_backward": "(Tensor grad, Tensor cos, Tensor sin) -> Tensor",
    "attention_heads": "(Tensor q, Tensor k, Tensor v, Tensor? mask, bool causal, Tensor? p, "
    "int seed, float scale) -> (Tensor, Tensor)",
    "attention_heads_backward": "(Tensor q, Tensor k, Tensor v, Tensor probs, Tensor grad, "
    "Tensor? p, int seed, float scale) -> (Tensor, Tensor, Tensor)",
}
for _name, _schema in _SCHEMAS.items():
    _LIB.define(_name + _schema)


def _library(**sizes: int) -> ctypes.CDLL:
    return served[tuple(sorted(sizes.items()))]


def _ptr(t: Tensor | None) -> int | None:
    return None if t is None or t.numel() == 0 else t.data_ptr()


def _register(name: str, cpu: Callable[..., Any], fake: Callable[..., Any]) -> None:
    _LIB.impl(name, cpu, "CPU")
    torch.library.register_fake(f"plait::{name}", fake, lib=_LIB)


# ------------------------------------------------------------------------------ attention
def _attention(qkv: Tensor, mask: Tensor | None, heads: int, scale: float) -> tuple[Tensor, Tensor]:
    """softmax(scale * q k^T + mask) v for every (sequence, head) of a contiguous packed
    [batch, T, 3E] projection; the output and the probabilities (for the backward)."""
    nb, t, e3 = qkv.shape
    lib = _library(SEQ=t, HEAD=e3 // (3 * heads))
    out = qkv.new_empty(nb, t, e3 // 3)
    probs = qkv.new_empty(nb, heads, t, t)
    strides = (0, 0, 0, 0) if mask is None else mask.stride()
    lib.attention_forward(
        qkv.data_ptr(),
        _ptr(mask),
        *strides,
        out.data_ptr(),
        probs.data_ptr(),
        nb,
        heads,
        scale,
        torch.get_num_threads(),
    )
    return out, probs


def _attention_fake(
    qkv: Tensor, mask: Tensor | None, heads: int, scale: float
) -> tuple[Tensor, Tensor]:
    nb, t, e3 = qkv.shape
    return qkv.new_empty(nb, t, e3 // 3), qkv.new_empty(nb, heads, t, t)


def _attention_backward(
    qkv: Tensor, probs: Tensor, grad: Tensor, heads: int, scale: float
) -> Tensor:
    t, e3 = qkv.shape[1], qkv.shape[2]
    lib = _library(SEQ=t, HEAD=e3 // (3 * heads))
    dqkv = torch.empty_like(qkv)
    lib.attention_backward(
        qkv.data_ptr(),
        probs.data_ptr(),
        grad.data_ptr(),
        dqkv.data_ptr(),
        qkv.shape[0],
        heads,
        scale,
        torch.get_num_threads(),
    )
    return dqkv


def _attention_backward_fake(
    qkv: Tensor, probs: Tensor, grad: Tensor, heads: int, scale: float
) -> Tensor:
    return torch.empty_like(qkv)


def _strides(heads: tuple[Tensor, ...], tail: tuple[int, ...] = ()) -> Any:
    """attention_heads_*'s stride table: each of `heads` by batch, head and row (q, k, v,
    and in the backward dq, dk, dv), then `tail` (the forward's mask strides)."""
    table = [s for t in heads for s in t.stride()[:3]] + list(tail)
    return (ctypes.c_int64 * len(table))(*table)


def _attention_heads(  # noqa: PLR0917 (an operator's schema is positional)
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool, p: Tensor | None,
    seed: int, scale: float,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """Self-attention of q [nb, heads, T, d] with k, v [nb, kv_heads, T, d] (each with
    contiguous rows of d), an additive `mask` broadcast to [nb, heads, T, T] by strides,
    and dropout of the probabilities at model b's p[b]; the output [nb, T, heads, d] and
    the probabilities before dropout (for the backward)."""
    nb, heads, t, d = q.shape
    lib = _library(SEQ=t, HEAD=d)
    out = q.new_empty(nb, t, heads, d)
    probs = q.new_empty(nb, heads, t, t)
    models = 1 if p is None else p.numel()
    lib.attention_heads_forward(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), _ptr(mask),
        _strides((q, k, v), (0, 0, 0, 0) if mask is None else mask.stride()),
        out.data_ptr(), probs.data_ptr(), nb, heads, k.shape[1], int(causal), _ptr(p),
        nb // models, seed, scale, torch.get_num_threads(),
    )  # fmt: skip
    return out, probs


def _attention_heads_fake(  # noqa: PLR0917
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool, p: Tensor | None,
    seed: int, scale: float,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    nb, heads, t, d = q.shape
    return q.new_empty(nb, t, heads, d), q.new_empty(nb, heads, t, t)


def _dense(x: Tensor) -> bool:
    """Whether x's elements fill its storage span without gaps or overlaps (some order of
    its dims is contiguous)."""
    expected = 1
    for size, stride in sorted(zip(x.shape, x.stride(), strict=True), key=lambda d: d[1]):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def _grad_like(x: Tensor) -> Tensor:
    """An empty gradient for [nb, heads, T, d] `x`, laid out as x where x is dense, else as
    a transposed [nb, T, heads, d] (a slice of a packed projection, viewed per head): the
    views x came through then hand the gradient back without copying it (a copy of dq
    cost 0.5 ms a step in a fused BERT, measured)."""
    if _dense(x):
        return torch.empty_like(x)  # keeps a dense tensor's strides
    nb, heads, t, d = x.shape
    return x.new_empty(nb, t, heads, d).transpose(1, 2)


def _attention_heads_backward(  # noqa: PLR0917 (an operator's schema is positional)
    q: Tensor, k: Tensor, v: Tensor, probs: Tensor, grad: Tensor, p: Tensor | None,
    seed: int, scale: float,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    nb, heads, t, d = q.shape
    lib = _library(SEQ=t, HEAD=d)
    dq, dk, dv = _grad_like(q), _grad_like(k), _grad_like(v)
    models = 1 if p is None else p.numel()
    lib.attention_heads_backward(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), _strides((q, k, v, dq, dk, dv)),
        probs.data_ptr(),
        grad.data_ptr(), dq.data_ptr(), dk.data_ptr(), dv.data_ptr(), nb, heads, k.shape[1],
        _ptr(p), nb // models, seed, scale, torch.get_num_threads(),
    )  # fmt: skip
    return dq, dk, dv


def _attention_heads_backward_fake(  # noqa: PLR0917
    q: Tensor, k: Tensor, v: Tensor, probs: Tensor, grad: Tensor, p: Tensor | None,
    seed: int, scale: float,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    return _grad_like(q), _grad_like(k), _grad_like(v)


# ----------------------------------------------------------------------------- layer norm
def _layer_norm(
    x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float, centred: bool = True
) -> tuple[Tensor, Tensor, Tensor]:
    """Layer norm of contiguous [models, rows, width] with each model's weight and bias
    ([models, width] or None); the output, and each row's mean and 1/deviation. Not
    `centred`, RMSNorm (the mean taken as 0)."""
    models, rows, width = x.shape
    lib = _library(WIDTH=width)
    y = torch.empty_like(x)
    mean = x.new_empty(models * rows)
    rstd = x.new_empty(models * rows)
    lib.layer_norm_forward(
        x.data_ptr(),
        _ptr(weight),
        _ptr(bias),
        y.data_ptr(),
        mean.data_ptr(),
        rstd.data_ptr(),
        models,
        rows,
        eps,
        int(centred),
        torch.get_num_threads(),
    )
    return y, mean, rstd


def _layer_norm_fake(
    x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float, centred: bool = True
) -> tuple[Tensor, Tensor, Tensor]:
    models, rows, _ = x.shape
    return torch.empty_like(x), x.new_empty(models * rows), x.new_empty(models * rows)


def _layer_norm_grads(
    x: Tensor, weight: Tensor | None, weight_grad: bool, bias_grad: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """Empty gradients; the weight's and bias's are empty (0 elements) where not asked for:
    an operator returns tensors, never None."""
    dw = torch.empty_like(weight) if weight is not None and weight_grad else x.new_empty(0)
    db = x.new_empty(x.shape[0], x.shape[2]) if bias_grad else x.new_empty(0)
    return torch.empty_like(x), dw, db


def _layer_norm_backward(  # noqa: PLR0917 (an operator's schema is positional)
    grad: Tensor,
    x: Tensor,
    mean: Tensor,
    rstd: Tensor,
    weight: Tensor | None,
    weight_grad: bool,
    bias_grad: bool,
    centred: bool = True,
) -> tuple[Tensor, Tensor, Tensor]:
    models, rows, width = x.shape
    lib = _library(WIDTH=width)
    dx, dw, db = _layer_norm_grads(x, weight, weight_grad, bias_grad)
    lib.layer_norm_backward(
        grad.data_ptr(),
        x.data_ptr(),
        mean.data_ptr(),
        rstd.data_ptr(),
        _ptr(weight),
        dx.data_ptr(),
        _ptr(dw),
        _ptr(db),
        models,
        rows,
        int(centred),
        torch.get_num_threads(),
    )
    return dx, dw, db


def _layer_norm_backward_fake(  # noqa: PLR0917
    grad: Tensor,
    x: Tensor,
    mean: Tensor,
    rstd: Tensor,
    weight: Tensor | None,
    weight_grad: bool,
    bias_grad: bool,
    centred: bool = True,
) -> tuple[Tensor, Tensor, Tensor]:
    return _layer_norm_grads(x, weight, weight_grad, bias_grad)


# ----------------------------------------------------------------------------------- Adam
def _adam_step(  # noqa: PLR0917 (an operator's schema is positional)
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
    """Adam over B models in place (see `plait.fused.native.functions.adam_step`)."""
    lib = _library()
    models, total = exp_avg.shape
    sizes, offsets = _sizes_and_offsets(tuple(p.numel() // models for p in params))
    n = len(params)
    ptrs = ctypes.c_void_p * n
    lib.adam_step(
        n,
        sizes,
        offsets,
        ptrs(*[p.data_ptr() for p in params]),
        ptrs(*[g.data_ptr() for g in grads]),
        exp_avg.data_ptr(),
        exp_avg_sq.data_ptr(),
        models,
        total,
        (ctypes.c_float * models)(*step_size),
        beta1,
        beta2,
        eps,
        bc2_sqrt,
        torch.get_num_threads(),
    )


def _adam_step_fake(  # noqa: PLR0917
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
    return None


# -------------------------------------------------------------------------------- dropout
def _dropout(x: Tensor, p: Tensor, seed: int) -> Tensor:
    """Dropout of contiguous [models, ...] `x` with model b's probability p[b] (float32
    [models]); the same seed gives the same mask, which the backward pass relies on."""
    out = torch.empty_like(x)
    models = p.numel()
    _library().dropout_apply(
        x.data_ptr(), out.data_ptr(), models, x.numel() // models, p.data_ptr(), seed,
        torch.get_num_threads(),
    )  # fmt: skip
    return out


def _dropout_fake(x: Tensor, p: Tensor, seed: int) -> Tensor:
    return torch.empty_like(x)


# ----------------------------------------------------------------------------------- gelu
def _gelu_tanh(x: Tensor) -> Tensor:
    """GELU (tanh approximation) of contiguous `x`."""
    y = torch.empty_like(x)
    _library().gelu_tanh_forward(x.data_ptr(), y.data_ptr(), x.numel(), torch.get_num_threads())
    return y


def _gelu_tanh_backward(grad: Tensor, x: Tensor) -> Tensor:
    dx = torch.empty_like(x)
    _library().gelu_tanh_backward(grad.data_ptr(), x.data_ptr(), dx.data_ptr(), x.numel(),
                                  torch.get_num_threads())  # fmt: skip
    return dx


def _gelu_tanh_fake(x: Tensor) -> Tensor:
    return torch.empty_like(x)


def _gelu_tanh_backward_fake(grad: Tensor, x: Tensor) -> Tensor:
    return torch.empty_like(x)


# --------------------------------------------------------------------------------- rotary
def rotary_reference(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """`plait::rotary`: x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1] for the
    halves of x's last dim (the rotary position embedding as Llama applies it). The
    operator's own definition, in torch operators, so it runs and differentiates anywhere;
    `plait.fused.capture.patterns` puts it where a model writes this out, and a fused
    array runs it on the native kernel where that applies."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def _rotary_kernel(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """The rotary embedding of contiguous x [..., T, d] with contiguous cos and sin [T, d]."""
    out = torch.empty_like(x)
    t, d = cos.shape
    _library().rotary_forward(x.data_ptr(), cos.data_ptr(), sin.data_ptr(), out.data_ptr(),
                              x.numel() // (t * d), t, d, torch.get_num_threads())  # fmt: skip
    return out


def _rotary_kernel_backward(grad: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    dx = torch.empty_like(grad)
    t, d = cos.shape
    _library().rotary_backward(grad.data_ptr(), cos.data_ptr(), sin.data_ptr(), dx.data_ptr(),
                               grad.numel() // (t * d), t, d, torch.get_num_threads())  # fmt: skip
    return dx


def _rotary_fake(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    return torch.empty_like(x)


def _rotary_backward_fake(grad: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    return torch.empty_like(grad)


@functools.lru_cache(maxsize=256)
def _sizes_and_offsets(sizes: tuple[int, ...]) -> tuple[ctypes.Array[ctypes.c_int64], ...]:
    """Per-model parameter sizes and their column offsets in the flat state, as C arrays
    (made once per layout: the step is called with the same layout every time)."""
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    return (ctypes.c_int64 * len(sizes))(*sizes), (ctypes.c_int64 * len(sizes))(*offsets)


_register("attention", _attention, _attention_fake)
_register("attention_backward", _attention_backward, _attention_backward_fake)
_register("layer_norm", _layer_norm, _layer_norm_fake)
_register("layer_norm_backward", _layer_norm_backward, _layer_norm_backward_fake)
_register("adam_step", _adam_step, _adam_step_fake)
_register("dropout", _dropout, _dropout_fake)
_register("gelu_tanh", _gelu_tanh, _gelu_tanh_fake)
_register("rotary_kernel", _rotary_kernel, _rotary_fake)
_register("rotary_kernel_backward", _rotary_kernel_backward, _rotary_backward_fake)
_LIB.impl("rotary", rotary_reference, "CompositeImplicitAutograd")
_register("gelu_tanh_backward", _gelu_tanh_backward, _gelu_tanh_backward_fake)
_register("attention_heads", _attention_heads, _attention_heads_fake)
_register("attention_heads_backward", _attention_heads_backward, _attention_heads_backward_fake)

attention = torch.ops.plait.attention.default
attention_backward = torch.ops.plait.attention_backward.default
layer_norm = torch.ops.plait.layer_norm.default
layer_norm_backward = torch.ops.plait.layer_norm_backward.default
adam_step = torch.ops.plait.adam_step.default
dropout = torch.ops.plait.dropout.default
gelu_tanh = torch.ops.plait.gelu_tanh.default
rotary = torch.ops.plait.rotary.default
rotary_kernel = torch.ops.plait.rotary_kernel.default
rotary_kernel_backward = torch.ops.plait.rotary_kernel_backward.default
gelu_tanh_backward = torch.ops.plait.gelu_tanh_backward.default
attention_heads = torch.ops.plait.attention_heads.default
attention_heads_backward = torch.ops.plait.attention_heads_backward.default

#: The implementations themselves, without the dispatcher (see `plait.fused.native.functions`).
direct = SimpleNamespace(
    attention=_attention,
    attention_backward=_attention_backward,
    layer_norm=_layer_norm,
    layer_norm_backward=_layer_norm_backward,
    adam_step=_adam_step,
    dropout=_dropout,
    gelu_tanh=_gelu_tanh,
    rotary_kernel=_rotary_kernel,
    rotary_kernel_backward=_rotary_kernel_backward,
    gelu_tanh_backward=_gelu_tanh_backward,
    attention_heads=_attention_heads,
    attention_heads_backward=_attention_heads_backward,
)
