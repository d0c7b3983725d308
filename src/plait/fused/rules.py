"""Batching rules: how a function or method of a model's forward runs on [B, ...] values.

The converter traces one model's forward with torch.fx and knows, for every value,
whether it carries the model dimension ("batched": inputs, parameters and everything
computed from them) or is shared by all models (constants, `torch.arange`, shapes). A call
whose arguments are all shared runs unchanged. Otherwise its rule rewrites it:

- element-wise ops broadcast per model: a batched operand of lower rank gains singleton
  dimensions behind B, so [B, C] meets [B, N, T, C] as [B, 1, 1, C];
- dimension arguments move one place right (negative ones already count from the end),
  and reductions over "everything" reduce over everything but B;
- view/reshape/expand sizes gain B in front; `.shape` and `.size()` answer per model;
- per-sample spatial ops (pooling, interpolation) run on [N, B*C, ...] channels.

Anything else raises `UnsupportedLayerError` naming the call.
"""

from __future__ import annotations

import builtins
import operator
from collections.abc import Callable, Sequence
from typing import Any, TypeAlias

import torch
import torch.nn.functional as F

from plait.fused.errors import UnsupportedLayerError
from plait.fused.ops.base import expand_models, model_view
from plait.fused.ops.pooling import per_channel

Flags: TypeAlias = Any  # bool, or a tuple of Flags mirroring a list/tuple argument
Impl: TypeAlias = Callable[..., Any]
#: A rule turns (op, flags of positional args, flags of keyword args) into a callable
#: with the op's own signature, plus whether its result is batched.
Rule: TypeAlias = Callable[[Callable[..., Any], tuple[Flags, ...], dict[str, Flags]], Impl]


def any_batched(flags: Flags) -> bool:
    if isinstance(flags, tuple):
        return any(any_batched(f) for f in flags)
    return bool(flags)


def _named(impl: Impl, op: Callable[..., Any], kind: str) -> Impl:
    name = getattr(op, "__name__", None) or getattr(op, "method", "op")
    impl.__name__ = impl.__qualname__ = f"{kind}_{name}".replace(".", "_")
    return impl


def method(name: str) -> Callable[..., Any]:
    """A Tensor method as a function of (self, *args): rules treat both alike."""

    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        return getattr(self, name)(*args, **kwargs)

    call.__name__ = name
    call.method = name  # type: ignore[attr-defined]
    return call


def align(values: list[Any], flags: Sequence[bool]) -> list[Any]:
    """Give batched tensors equal rank by adding singleton dims behind B (broadcasting)."""
    rank = 0
    for v, f in zip(values, flags, strict=True):
        if isinstance(v, torch.Tensor):
            rank = max(rank, v.dim() - (1 if f else 0))
    return [
        v[(slice(None),) + (None,) * (rank - v.dim() + 1)]
        if f and isinstance(v, torch.Tensor) and v.dim() - 1 < rank
        else v
        for v, f in zip(values, flags, strict=True)
    ]


def _batch_size(values: Sequence[Any], flags: Sequence[Flags]) -> int:
    for v, f in zip(values, flags, strict=False):
        if f is True and isinstance(v, torch.Tensor):
            return int(v.shape[0])
        if isinstance(f, tuple) and isinstance(v, list | tuple):
            for vi, fi in zip(v, f, strict=False):
                if fi is True and isinstance(vi, torch.Tensor):
                    return int(vi.shape[0])
    raise AssertionError("no batched tensor among the arguments")


# --------------------------------------------------------------------------- element-wise


def elementwise(op: Callable[..., Any], fa: tuple[Flags, ...], fk: dict[str, Flags]) -> Impl:
    """Broadcasting ops: align batched operands' ranks, then call the op unchanged."""
    keys = tuple(fk)
    flags = tuple(bool(f) for f in fa) + tuple(bool(fk[k]) for k in keys)

    def impl(*args: Any, **kwargs: Any) -> Any:
        values = align([*args, *(kwargs[k] for k in keys)], flags)
        n = len(args)
        return op(*values[:n], **dict(zip(keys, values[n:], strict=True)))

    return _named(impl, op, "batched")


def matmul(op: Callable[..., Any], fa: tuple[Flags, ...], fk: dict[str, Flags]) -> Impl:
    """Matrix products broadcast over leading dims once batched operands share a rank."""
    del op
    flags = tuple(bool(f) for f in fa[:2])

    def impl(a: Any, b: Any, **kwargs: Any) -> Any:
        for v, f in zip((a, b), flags, strict=True):
            if f and v.dim() < 3:
                raise UnsupportedLayerError(
                    "matmul with a per-model vector cannot be fused; reshape it to a matrix"
                )
        x, y = align([a, b], flags)
        return torch.matmul(x, y, **kwargs)

    impl.__name__ = impl.__qualname__ = "batched_matmul"
    return impl


def linear(op: Callable[..., Any], fa: tuple[Flags, ...], fk: dict[str, Flags]) -> Impl:
    """F.linear: with per-model weights it becomes a batched matmul plus aligned bias."""
    del op
    w_batched = bool(fa[1]) if len(fa) > 1 else bool(fk.get("weight"))

    def impl(x: Any, weight: Any, bias: Any = None) -> Any:
        if not w_batched:
            return F.linear(x, weight, bias)
        if weight.dim() != 3:
            raise UnsupportedLayerError("F.linear with a per-model weight needs a 2-d weight")
        if not (isinstance(x, torch.Tensor) and x.shape[0] == weight.shape[0]):
            x = expand_models(x, int(weight.shape[0]))
        y = torch.matmul(x.reshape(x.shape[0], -1, x.shape[-1]), weight.transpose(1, 2))
        y = y.view(*x.shape[:-1], weight.shape[1])
        if bias is not None:
            y = y + (model_view(bias, y.dim(), 1) if bias.dim() == 2 else bias)
        return y

    impl.__name__ = impl.__qualname__ = "batched_linear"
    return impl


def layer_norm(op: Callable[..., Any], fa: tuple[Flags, ...], fk: dict[str, Flags]) -> Impl:
    """F.layer_norm: normalise trailing dims as is, then apply per-model affine weights."""
    del op

    def impl(x: Any, shape: Any, weight: Any = None, bias: Any = None, eps: float = 1e-5) -> Any:
        k = len(shape) if isinstance(shape, Sequence) else 1
        y = F.layer_norm(x, shape, None, None, eps)
        if weight is not None:
            y = y * (model_view(weight, y.dim(), k) if weight.dim() > k else weight)
        if bias is not None:
            y = y + (model_view(bias, y.dim(), k) if bias.dim() > k else bias)
        return y

    impl.__name__ = impl.__qualname__ = "batched_layer_norm"
    return impl


# ----------------------------------------------------------------------------- dimensions


def shift(d: Any) -> Any:
    """A per-model dimension (or a list of them) as a dimension of the [B, ...] tensor."""
    if isinstance(d, int) and not isinstance(d, bool):
        return d + 1 if d >= 0 else d
    if isinstance(d, list | tuple):
        return type(d)(shift(x) for x in d)
    return d


_MISSING = object()


def dims(*specs: tuple[int, str, Any], reduce_all: bool = False, flatten_all: bool = False) -> Rule:
    """Ops with dimension arguments: (position incl. self, keyword, default) per dim.

    A missing dim takes its default; a None dim of a reduction means every per-model dim
    (`reduce_all`, for ops that take a tuple) or the flattened per-model tensor
    (`flatten_all`, for argmax-like ops).
    """

    def rule(op: Callable[..., Any], fa: tuple[Flags, ...], fk: dict[str, Flags]) -> Impl:
        if (
            not fa
            or fa[0] is not True
            or any(any_batched(f) for f in fa[1:])
            or any(any_batched(f) for f in fk.values())
        ):
            raise UnsupportedLayerError(
                f"{_describe(op)} with per-model tensors beyond its input cannot be fused"
            )

        def impl(*args: Any, **kwargs: Any) -> Any:
            a = list(args)
            x = a[0]
            for pos, kw, default in specs:
                if kw in kwargs:
                    value = kwargs[kw]
                elif pos < len(a):
                    value = a[pos]
                else:
                    value = default
                if value is None and (reduce_all or flatten_all):
                    if flatten_all:
                        a[0] = x.flatten(1)
                        value = 1
                    else:
                        value = tuple(range(1, x.dim()))
                elif value is _MISSING:
                    continue
                else:
                    value = shift(value)
                if kw in kwargs or pos >= len(a):
                    kwargs[kw] = value
                else:
                    a[pos] = value
            return op(*a, **kwargs)

        return _named(impl, op, "batched")

    return rule


def permute(op: Callable[..., Any], fa: tuple[Flags, ...], fk: dict[str, Flags]) -> Impl:
    def impl(x: Any, *order: Any, **kwargs: Any) -> Any:
        d = kwargs.pop("dims", order[0] if len(order) == 1 and not isinstance(order[0], int)
                       else order)  # fmt: skip
        return x.permute(0, *shift(tuple(d)))

    impl.__name__ = impl.__qualname__ = "batched_permute"
    return impl


def transpose_2d(op: Callable[..., Any], fa: tuple[Flags, ...], fk: dict[str, Flags]) -> Impl:
    """`.t()` / `.T` of a per-model matrix (vectors are returned as they are)."""

    def impl(x: Any) -> Any:
        return x if x.dim() < 3 else x.transpose(1, 2)

    impl.__name__ = impl.__qualname__ = "batched_t"
    return impl


def squeeze(op: Callable[..., Any], fa: tuple[Flags, ...], fk: dict[str, Flags]) -> Impl:
    def impl(x: Any, dim: Any = None) -> Any:
        if dim is None:  # every per-model singleton dim, never B itself
            dim = tuple(i for i in range(1, x.dim()) if x.shape[i] == 1)
            return x.squeeze(dim) if dim else x
        return x.squeeze(shift(dim))

    impl.__name__ = impl.__qualname__ = "batched_squeeze"
    return impl


def minmax(op: Callable[..., Any], fa: tuple[Flags, ...], fk: dict[str, Flags]) -> Impl:
    """max/min: element-wise with a tensor, a dim reduction, or over all per-model values."""
    flags = (bool(fa[0]), bool(fa[1]) if len(fa) > 1 else bool(fk.get("other")))

    def impl(x: Any, *args: Any, **kwargs: Any) -> Any:
        other = args[0] if args else kwargs.pop("other", None)
        if isinstance(other, torch.Tensor):
            return op(*align([x, other], flags))
        if args or "dim" in kwargs:
            dim = kwargs.pop("dim", args[0] if args else None)
            return op(x, shift(dim), *args[1:], **kwargs)
        return op(x.flatten(1), 1, **kwargs).values

    return _named(impl, op, "batched")


def cat(op: Callable[..., Any], fa: tuple[Flags, ...], fk: dict[str, Flags]) -> Impl:
    """cat/stack: shared members are expanded to all models, the dim moves behind B."""
    member_flags = fa[0] if fa and isinstance(fa[0], tuple) else ()

    def impl(tensors: Any, dim: int = 0, **kwargs: Any) -> Any:
        dim = kwargs.pop("dim", dim)
        flags = member_flags or (True,) * len(tensors)
        b = _batch_size(list(tensors), list(flags))
        members = [t if f else expand_models(t, b) for t, f in zip(tensors, flags, strict=True)]
        return op(members, shift(dim), **kwargs)

    return _named(impl, op, "batched")


def gather(op: Callable[..., Any], fa: tuple[Flags, ...], fk: dict[str, Flags]) -> Impl:
    """gather/take_along_dim: the index tensor follows the input into the model dim."""

    def impl(x: Any, dim: int, index: Any, **kwargs: Any) -> Any:
        if index.dim() < x.dim():
            index = expand_models(index, int(x.shape[0]))
        return op(x, shift(dim), index, **kwargs)

    return _named(impl, op, "batched")


# ------------------------------------------------------------------------------- shapes


def _sizes(args: tuple[Any, ...]) -> tuple[Any, ...]:
    if len(args) == 1 and isinstance(args[0], list | tuple | torch.Size):
        return tuple(args[0])
    return tuple(args)


def view(op: Callable[..., Any], fa: tuple[Flags, ...], fk: dict[str, Flags]) -> Impl:
    """view/reshape to a per-model shape: B goes in front."""

    def impl(x: Any, *args: Any, **kwargs: Any) -> Any:
        if "shape" in kwargs or "size" in kwargs:
            args = (kwargs.pop("shape", None) or kwargs.pop("size"),)
        if len(args) == 1 and isinstance(args[0], torch.dtype):
            return op(x, args[0])
        return op(x, (x.shape[0], *_sizes(args)))

    return _named(impl, op, "batched")


def expand(op: Callable[..., Any], fa: tuple[Flags, ...], fk: dict[str, Flags]) -> Impl:
    """expand/broadcast_to/repeat: align the per-model rank first, B is never repeated."""
    repeat = getattr(op, "method", getattr(op, "__name__", "")) == "repeat"

    def impl(x: Any, *args: Any, **kwargs: Any) -> Any:
        sizes = _sizes(args or (kwargs.pop("size", None) or kwargs.pop("sizes", None),))
        if x.dim() - 1 < len(sizes):
            x = x[(slice(None),) + (None,) * (len(sizes) - x.dim() + 1)]
        return op(x, (1 if repeat else -1, *sizes), **kwargs)

    return _named(impl, op, "batched")


def like(op: Callable[..., Any], fa: tuple[Flags, ...], fk: dict[str, Flags]) -> Impl:
    """expand_as/view_as/reshape_as/type_as against another tensor."""
    flags = tuple(bool(f) for f in fa[:2])

    def impl(x: Any, other: Any) -> Any:
        if flags == (True, False):
            return op(x, expand_models(other, int(x.shape[0])))
        if flags == (False, True):
            return op(expand_models(x, int(other.shape[0])), other)
        return op(x, other)

    return _named(impl, op, "batched")


def size(op: Callable[..., Any], fa: tuple[Flags, ...], fk: dict[str, Flags]) -> Impl:
    """Shape queries answer for one model: its shape lacks B."""
    name = getattr(op, "method", "")

    def impl(x: Any, *args: Any) -> Any:
        if name in ("dim", "ndimension"):
            return x.dim() - 1
        if name in ("numel", "nelement"):
            return x.numel() // x.shape[0]
        if args and args[0] is not None:
            return x.size(shift(args[0]))
        return x.shape[1:]

    impl.__name__ = impl.__qualname__ = f"per_model_{name}"
    return impl


def getattr_rule(op: Callable[..., Any], fa: tuple[Flags, ...], fk: dict[str, Flags]) -> Impl:
    def impl(x: Any, name: str) -> Any:
        if not isinstance(x, torch.Tensor) or name in ("dtype", "device", "requires_grad",
                                                       "is_cuda", "mT", "mH"):  # fmt: skip
            return builtins.getattr(x, name)
        if name == "shape":
            return x.shape[1:]
        if name == "ndim":
            return x.dim() - 1
        if name == "T":
            return x if x.dim() < 3 else x.transpose(1, 2)
        raise UnsupportedLayerError(f"attribute Tensor.{name} cannot be fused")

    impl.__name__ = impl.__qualname__ = "per_model_getattr"
    return impl


def getitem(op: Callable[..., Any], fa: tuple[Flags, ...], fk: dict[str, Flags]) -> Impl:
    """Indexing a per-model tensor indexes behind B; indexing a tuple of them is plain."""
    if len(fa) > 1 and any_batched(fa[1]):
        raise UnsupportedLayerError("indexing with per-model index tensors cannot be fused")

    def impl(x: Any, idx: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x[idx]
        parts = idx if isinstance(idx, tuple) else (idx,)
        if any(isinstance(p, torch.Tensor | list) for p in parts):
            raise UnsupportedLayerError(
                "advanced indexing (with tensors or lists) of a per-model tensor cannot be fused"
            )
        return x[(slice(None), *parts)]

    impl.__name__ = impl.__qualname__ = "batched_getitem"
    return impl


def spatial(k: int | None) -> Rule:
    """Per-sample ops over k spatial dims (None: inferred as per-model rank - 2)."""

    def rule(op: Callable[..., Any], fa: tuple[Flags, ...], fk: dict[str, Flags]) -> Impl:
        if any(any_batched(f) for f in fa[1:]) or any(any_batched(f) for f in fk.values()):
            raise UnsupportedLayerError(f"{_describe(op)} with per-model arguments cannot be fused")

        def impl(x: Any, *args: Any, **kwargs: Any) -> Any:
            n = k if k is not None else x.dim() - 3
            return per_channel(lambda t: op(t, *args, **kwargs), x, n)

        return _named(impl, op, "per_channel")

    return rule


def pad(op: Callable[..., Any], fa: tuple[Flags, ...], fk: dict[str, Flags]) -> Impl:
    """F.pad: constant padding touches trailing dims only; other modes pad per channel."""

    def impl(x: Any, pads: Any, mode: str = "constant", value: Any = None) -> Any:
        if mode == "constant":
            return F.pad(x, pads, mode, value)
        return per_channel(lambda t: F.pad(t, pads, mode, value), x, len(pads) // 2)

    impl.__name__ = impl.__qualname__ = "batched_pad"
    return impl


def sdpa(op: Callable[..., Any], fa: tuple[Flags, ...], fk: dict[str, Flags]) -> Impl:
    """scaled_dot_product_attention takes any leading dims: align q, k, v and the mask."""
    flags = (*(bool(f) for f in fa[:3]), bool(fa[3]) if len(fa) > 3 else bool(fk.get("attn_mask")))

    def impl(q: Any, k: Any, v: Any, *args: Any, **kwargs: Any) -> Any:
        mask = args[0] if args else kwargs.pop("attn_mask", None)
        vals = align([q, k, v, mask], flags)
        return F.scaled_dot_product_attention(*vals, *args[1:], **kwargs)

    impl.__name__ = impl.__qualname__ = "batched_sdpa"
    return impl


# --------------------------------------------------------------------------------- tables

_ELEMENTWISE_FUNCS: list[Callable[..., Any]] = [
    operator.add, operator.sub, operator.mul, operator.truediv, operator.floordiv,
    operator.mod, operator.pow, operator.neg, operator.pos, operator.abs, operator.eq,
    operator.ne, operator.lt, operator.le, operator.gt, operator.ge, operator.and_,
    operator.or_, operator.xor, operator.invert, operator.iadd, operator.imul,
    operator.isub, operator.itruediv,
    torch.add, torch.sub, torch.subtract, torch.mul, torch.multiply, torch.div,
    torch.divide, torch.true_divide, torch.pow, torch.neg, torch.abs, torch.exp, torch.log,
    torch.log1p, torch.expm1, torch.sqrt, torch.rsqrt, torch.square, torch.sign,
    torch.reciprocal, torch.sin, torch.cos, torch.erf, torch.clamp, torch.clip,
    torch.where, torch.maximum, torch.minimum, torch.lerp, torch.addcmul, torch.addcdiv,
    torch.relu, torch.sigmoid, torch.tanh, torch.floor, torch.ceil, torch.round,
    torch.zeros_like, torch.ones_like, torch.full_like, torch.empty_like, torch.rand_like,
    torch.randn_like, torch.eq, torch.ne, torch.lt, torch.gt, torch.le, torch.ge,
    torch.logical_and, torch.logical_or, torch.logical_not, torch.isnan, torch.isfinite,
    torch.nan_to_num, torch.masked_fill,
    F.relu, F.relu6, F.gelu, F.silu, F.mish, F.elu, F.selu, F.celu, F.leaky_relu,
    F.hardtanh, F.hardswish, F.hardsigmoid, F.sigmoid, F.tanh, F.softplus, F.softsign,
    F.logsigmoid, F.tanhshrink, F.threshold, F.hardshrink, F.softshrink, F.dropout,
    F.alpha_dropout,
]  # fmt: skip

_ELEMENTWISE_METHODS = [
    "add", "sub", "mul", "div", "true_divide", "pow", "neg", "abs", "exp", "log", "log1p",
    "sqrt", "rsqrt", "square", "sign", "reciprocal", "sin", "cos", "erf", "relu", "sigmoid",
    "tanh", "clamp", "clip", "masked_fill", "where", "maximum", "minimum", "lerp", "addcmul",
    "addcdiv", "floor", "ceil", "round", "float", "double", "half", "bfloat16", "long",
    "int", "bool", "to", "contiguous", "clone", "detach", "requires_grad_", "eq", "ne", "lt",
    "gt", "le", "ge", "logical_not", "isnan", "nan_to_num", "type", "cpu", "cuda",
    "add_", "sub_", "mul_", "div_", "relu_", "sigmoid_", "tanh_", "clamp_", "masked_fill_",
    "zero_", "fill_", "copy_", "__and__", "__or__", "__invert__", "bernoulli", "exp_",
]  # fmt: skip

_REDUCE = dims((1, "dim", None), reduce_all=True)
_DIM1 = dims((1, "dim", _MISSING))
_DIM1_DEFAULT0 = dims((1, "dim", 0))
_DIM2_DEFAULT0 = dims((2, "dim", 0))
_FLAT = dims((1, "dim", None), flatten_all=True)
_TRANSPOSE = dims((1, "dim0", 0), (2, "dim1", 1))
_SWAP = dims((1, "axis0", 0), (2, "axis1", 1))
_MOVE = dims((1, "source", 0), (2, "destination", 0))
_FLATTEN = dims((1, "start_dim", 0), (2, "end_dim", -1))

_FUNCTION_RULES: dict[Any, Rule] = {
    **{f: elementwise for f in _ELEMENTWISE_FUNCS},
    operator.matmul: matmul, torch.matmul: matmul, torch.bmm: matmul, torch.mm: matmul,
    F.linear: linear, F.layer_norm: layer_norm, F.scaled_dot_product_attention: sdpa,
    operator.getitem: getitem, builtins.getattr: getattr_rule, F.pad: pad,
    torch.sum: _REDUCE, torch.mean: _REDUCE, torch.amax: _REDUCE, torch.amin: _REDUCE,
    torch.std: _REDUCE, torch.var: _REDUCE, torch.nansum: _REDUCE, torch.logsumexp: _DIM1,
    torch.argmax: _FLAT, torch.argmin: _FLAT, torch.max: minmax, torch.min: minmax,
    torch.softmax: _DIM1, torch.log_softmax: _DIM1, F.softmax: _DIM1, F.log_softmax: _DIM1,
    F.softmin: _DIM1, torch.cumsum: _DIM1, torch.cumprod: _DIM1,
    F.normalize: dims((2, "dim", 1)), F.glu: dims((1, "dim", -1)),
    torch.unsqueeze: _DIM1, torch.squeeze: squeeze, torch.transpose: _TRANSPOSE,
    torch.swapaxes: _SWAP, torch.movedim: _MOVE, torch.flatten: _FLATTEN,
    torch.unflatten: _DIM1, torch.permute: permute, torch.narrow: _DIM1, torch.select: _DIM1,
    torch.index_select: _DIM1, torch.roll: dims((2, "dims", _MISSING)), torch.flip: _DIM1,
    torch.split: _DIM2_DEFAULT0, torch.chunk: _DIM2_DEFAULT0, torch.unbind: _DIM1_DEFAULT0,
    torch.topk: dims((2, "dim", -1)), torch.sort: dims((1, "dim", -1)),
    torch.argsort: dims((1, "dim", -1)), torch.cat: cat, torch.concat: cat,
    torch.concatenate: cat, torch.stack: cat, torch.gather: gather,
    torch.take_along_dim: gather, torch.reshape: view, torch.broadcast_to: expand,
    torch.t: transpose_2d, torch.diff: dims((2, "dim", -1)),
    F.adaptive_avg_pool1d: spatial(1), F.adaptive_avg_pool2d: spatial(2),
    F.adaptive_avg_pool3d: spatial(3), F.adaptive_max_pool1d: spatial(1),
    F.adaptive_max_pool2d: spatial(2), F.avg_pool1d: spatial(1), F.avg_pool2d: spatial(2),
    F.avg_pool3d: spatial(3), F.max_pool1d: spatial(1), F.max_pool2d: spatial(2),
    F.max_pool3d: spatial(3), F.lp_pool1d: spatial(1), F.lp_pool2d: spatial(2),
    F.interpolate: spatial(None), F.dropout1d: spatial(1), F.dropout2d: spatial(2),
    F.dropout3d: spatial(3), F.pixel_shuffle: spatial(2), F.pixel_unshuffle: spatial(2),
}  # fmt: skip

_METHOD_RULES: dict[str, Rule] = {
    **{m: elementwise for m in _ELEMENTWISE_METHODS},
    "matmul": matmul, "__matmul__": matmul, "bmm": matmul, "mm": matmul,
    "sum": _REDUCE, "mean": _REDUCE, "amax": _REDUCE, "amin": _REDUCE, "std": _REDUCE,
    "var": _REDUCE, "nansum": _REDUCE, "logsumexp": _DIM1, "argmax": _FLAT, "argmin": _FLAT,
    "max": minmax, "min": minmax, "softmax": _DIM1, "log_softmax": _DIM1, "cumsum": _DIM1,
    "cumprod": _DIM1, "unsqueeze": _DIM1, "squeeze": squeeze,
    "transpose": _TRANSPOSE, "swapaxes": _SWAP, "swapdims": _TRANSPOSE, "movedim": _MOVE,
    "flatten": _FLATTEN, "unflatten": _DIM1,
    "permute": permute, "narrow": _DIM1, "select": _DIM1, "index_select": _DIM1,
    "roll": dims((2, "dims", _MISSING)), "flip": _DIM1, "split": _DIM2_DEFAULT0,
    "chunk": _DIM2_DEFAULT0, "unbind": _DIM1_DEFAULT0, "topk": dims((2, "dim", -1)),
    "sort": dims((1, "dim", -1)), "argsort": dims((1, "dim", -1)), "gather": gather,
    "view": view, "reshape": view, "expand": expand, "broadcast_to": expand, "repeat": expand,
    "expand_as": like, "view_as": like, "reshape_as": like, "type_as": like,
    "size": size, "dim": size, "ndimension": size, "numel": size, "nelement": size,
    "t": transpose_2d, "any": _REDUCE, "all": _REDUCE,
    "norm": dims((2, "dim", None), reduce_all=True),
    "diff": dims((2, "dim", -1)),
}  # fmt: skip


def _describe(op: Any) -> str:
    if hasattr(op, "method"):
        return f"Tensor.{op.method}"
    module = str(getattr(op, "__module__", None) or "")
    name = str(getattr(op, "__qualname__", None) or getattr(op, "__name__", repr(op)))
    module = "torch.nn.functional" if module.startswith("torch.nn.functional") else module
    return f"{module}.{name}" if module else name


def batched_call(
    target: Any,
    *,
    is_method: bool,
    args: tuple[Any, ...],
    fa: tuple[Flags, ...],
    fk: dict[str, Flags],
    where: str,
) -> tuple[Impl, bool]:
    """The fused implementation of one call and whether its result is batched.

    Args:
        target: the traced function, or the method name for a method call.
        is_method: `target` is a Tensor method name.
        args: the traced positional arguments (constants are read, e.g. attribute names).
        fa, fk: batched flags of the positional and keyword arguments.
        where: the call's location for error messages.
    """
    if is_method:
        rule = _METHOD_RULES.get(target)
        op = method(target)
    else:
        rule = _FUNCTION_RULES.get(target)
        op = target
    if rule is None:
        raise UnsupportedLayerError(f"{_describe(op)} (called in {where}) cannot be fused")
    if rule is getattr_rule:  # shapes, dtypes: one value for all models
        out_batched = len(args) > 1 and args[1] in ("mT", "mH", "T")
    else:
        out_batched = rule is not size
    return rule(op, fa, fk), out_batched
