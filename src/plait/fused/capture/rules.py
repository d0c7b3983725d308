"""Batching rules for the ATen operators of a captured graph: shapes, dimensions, indexing.

`torch.export` records a model's forward as ATen operators on one model's tensors. The
rewrite (`plait.fused.capture.rewrite`) knows, for each value, whether it carries the
model dimension B ("batched": inputs, parameters, buffers and what is computed from them)
or is shared by all models (constants, masks built from shapes, position indices). An
operator whose arguments are all shared runs unchanged, once. Otherwise its rule gives a
replacement with the operator's own schema, called with every argument by name:

- pointwise operators (torch's `pointwise` tag) broadcast per model: a batched operand of
  lower rank gains singleton dimensions behind B;
- dimension arguments move one place right, and "every dimension" means every
  per-model dimension;
- view/reshape/expand sizes gain B in front; shape-only constructors (`new_ones`) give
  shared results;
- the operators that carry a layer's parameters (linear, Conv1D's addmm, embedding,
  convolution, normalisation, attention, dropout, losses) are the fused layers'
  kernels (`plait.fused.capture.layers`).

Anything else raises `UnsupportedLayerError` naming the node and the layer it belongs to.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeAlias

import torch

from plait.fused.errors import UnsupportedLayerError
from plait.fused.ops.base import expand_models
from plait.fused.rules import align, any_batched, shift

aten = torch.ops.aten
Flags: TypeAlias = Any  # bool, or a tuple of Flags mirroring a list argument
Impl: TypeAlias = Callable[..., Any]


@dataclass(frozen=True, kw_only=True)
class Call:
    """One operator node of a captured graph, as its rule sees it.

    Attributes:
        op: the ATen operator overload.
        args: every argument by its schema name (defaults filled in); graph values are fx
            nodes, constants are themselves.
        flags: for each argument, whether it is batched (a tuple for a list argument).
        where: the node and its layer, for error messages.
        layer: the path of the innermost module the node was recorded in ("" at the top).
    """

    op: Any
    args: Mapping[str, Any]
    flags: Mapping[str, Flags]
    where: str
    layer: str = ""

    def batched(self, name: str) -> bool:
        return any_batched(self.flags.get(name, False))

    def unsupported(self, why: str) -> UnsupportedLayerError:
        return UnsupportedLayerError(f"{self.where}: {why}")


@dataclass(frozen=True)
class Rewrite:
    """A node's replacement: `impl(**args)`, whether its result is batched, and the
    per-model settings it reads: keyword -> (layer type, attribute). When the node was
    recorded in a layer of that type, `impl` gets that attribute of every model's layer
    at run time (dropout probabilities, padding indices, which may differ per model);
    otherwise the keyword is left out and the recorded value holds for all."""

    impl: Impl
    batched: Flags = True
    settings: Mapping[str, tuple[type, str]] = field(default_factory=dict)


Rule: TypeAlias = Callable[[Call], Rewrite]


def named(impl: Impl, op: Any, kind: str = "batched") -> Impl:
    name = str(getattr(op, "__name__", "op")).replace(".", "_")
    impl.__name__ = impl.__qualname__ = f"{kind}_{name}"
    return impl


def _first(call: Call) -> str:
    """The name of the operator's first argument (`self`, `input`, ...)."""
    return next(iter(call.args))


def _only_first_batched(call: Call) -> None:
    first = _first(call)
    if not call.batched(first) or any(call.batched(k) for k in call.args if k != first):
        raise call.unsupported("per-model tensors beyond its input cannot be fused here")


# --------------------------------------------------------------------------- pointwise


def pointwise(call: Call) -> Rewrite:
    """Broadcasting operators: batched operands are aligned by rank, then the op runs."""
    names = [k for k, v in call.args.items() if call.flags.get(k) is True]
    flags = [True] * len(names)
    op = call.op
    if torch.Tag.inplace in op.tags and not call.batched(_first(call)):
        raise call.unsupported(
            "an in-place operator writes per-model values into a tensor shared by all models"
        )

    def impl(**kw: Any) -> Any:
        for k, v in zip(names, align([kw[k] for k in names], flags), strict=True):
            kw[k] = v
        return op(**kw)

    return Rewrite(named(impl, op))


def broadcast_tensors(call: Call) -> Rewrite:
    """broadcast_tensors: every member becomes per model ([B, ...]), then broadcasts."""
    flags = call.flags["tensors"]

    def impl(**kw: Any) -> Any:
        tensors = kw["tensors"]
        b = next(int(t.shape[0]) for t, f in zip(tensors, flags, strict=True) if f)
        rank = max(t.dim() - (1 if f else 0) for t, f in zip(tensors, flags, strict=True))
        members = [
            t[(slice(None),) + (None,) * (rank - t.dim() + 1)] if f
            else expand_models(t.view(*([1] * (rank - t.dim())), *t.shape), b)
            for t, f in zip(tensors, flags, strict=True)
        ]  # fmt: skip
        return aten.broadcast_tensors.default(members)

    return Rewrite(named(impl, call.op))


def same_shape(call: Call) -> Rewrite:
    """Operators that keep their input's shape (casts, copies, `*_like`): unchanged."""
    return Rewrite(call.op)


def in_place_copy(call: Call) -> Rewrite:
    """`copy_`: a batched destination takes a batched or shared source as it is."""
    if not call.batched("self"):
        raise call.unsupported("copying per-model values into a tensor shared by all models")
    return pointwise(call)


def shared_result(call: Call) -> Rewrite:
    """Constructors that read only their input's dtype and device (`new_ones`, ...)."""
    return Rewrite(call.op, batched=False)


def assert_metadata(call: Call) -> Rewrite:
    """`_assert_tensor_metadata`: dtype, device and layout hold per model; sizes do not."""
    op = call.op

    def impl(**kw: Any) -> Any:
        kw["size"] = kw["stride"] = None
        return op(**kw)

    return Rewrite(named(impl, op), batched=False)


# -------------------------------------------------------------------------- dimensions


def dims(*names: str, every: bool = False) -> Rule:
    """Operators whose arguments `names` are per-model dimensions of the first argument.

    With `every`, a None or empty dimension list means every dimension (reductions):
    every per-model dimension, never B.
    """

    def rule(call: Call) -> Rewrite:
        _only_first_batched(call)
        op, first = call.op, _first(call)

        def impl(**kw: Any) -> Any:
            for name in names:
                value = kw.get(name)
                if every and (value is None or (isinstance(value, list | tuple) and not value)):
                    kw[name] = list(range(1, kw[first].dim()))
                else:
                    kw[name] = shift(value)
            return op(**kw)

        return Rewrite(named(impl, op))

    return rule


def reduce_all(reduce: Callable[[torch.Tensor, list[int]], torch.Tensor]) -> Rule:
    """Reductions over a whole tensor (`sum.default`, `max.default`): per model."""

    def rule(call: Call) -> Rewrite:
        _only_first_batched(call)
        first = _first(call)

        def impl(**kw: Any) -> Any:
            x = kw[first]
            return reduce(x, list(range(1, x.dim())))

        return Rewrite(named(impl, call.op))

    return rule


def _cast(out: torch.Tensor, dtype: Any) -> torch.Tensor:
    return out if dtype is None else out.to(dtype)


_REDUCE_ALL: dict[Any, Callable[..., torch.Tensor]] = {
    aten.sum.default: lambda x, d: x.sum(d),
    aten.mean.default: lambda x, d: x.mean(d),
    aten.max.default: lambda x, d: x.amax(d),
    aten.min.default: lambda x, d: x.amin(d),
    aten.any.default: lambda x, d: x.flatten(1).any(1),
    aten.all.default: lambda x, d: x.flatten(1).all(1),
    aten.prod.default: lambda x, d: x.flatten(1).prod(1),
}


def argext(call: Call) -> Rewrite:
    """argmax/argmin: a None dimension means the flattened per-model tensor."""
    _only_first_batched(call)
    op = call.op

    def impl(**kw: Any) -> Any:
        if kw["dim"] is None:
            out = op(self=kw["self"].flatten(1), dim=1, keepdim=False)
            return out.view(-1, *([1] * (kw["self"].dim() - 1))) if kw["keepdim"] else out
        kw["dim"] = shift(kw["dim"])
        return op(**kw)

    return Rewrite(named(impl, op))


def permute(call: Call) -> Rewrite:
    _only_first_batched(call)

    def impl(**kw: Any) -> Any:
        return aten.permute.default(kw["self"], [0, *shift(list(kw["dims"]))])

    return Rewrite(named(impl, call.op))


def squeeze_all(call: Call) -> Rewrite:
    """`squeeze()` without dims squeezes every per-model singleton, never B."""
    _only_first_batched(call)

    def impl(**kw: Any) -> Any:
        x = kw["self"]
        d = [i for i in range(1, x.dim()) if x.shape[i] == 1]
        return x.squeeze(d) if d else x

    return Rewrite(named(impl, call.op))


def transpose_2d(call: Call) -> Rewrite:
    """`t()` of a per-model matrix (vectors stay as they are)."""
    _only_first_batched(call)

    def impl(**kw: Any) -> Any:
        x = kw["self"]
        return x if x.dim() < 3 else x.transpose(1, 2)

    return Rewrite(named(impl, call.op))


def concat(call: Call) -> Rewrite:
    """cat/stack: members shared by all models are expanded to B, the dim moves behind B."""
    flags = call.flags["tensors"]
    op = call.op

    def impl(**kw: Any) -> Any:
        tensors = kw["tensors"]
        b = next(int(t.shape[0]) for t, f in zip(tensors, flags, strict=True) if f)
        kw["tensors"] = [
            t if f else expand_models(t, b) for t, f in zip(tensors, flags, strict=True)
        ]
        kw["dim"] = shift(kw["dim"])
        return op(**kw)

    return Rewrite(named(impl, op))


def with_index(*names: str) -> Rule:
    """gather-like ops (`self`, `dim`, `index`): a shared side is expanded to B."""

    def rule(call: Call) -> Rewrite:
        op = call.op
        flags = {k: call.batched(k) for k in ("self", *names)}

        def impl(**kw: Any) -> Any:
            b = next(int(kw[k].shape[0]) for k, f in flags.items() if f)
            for k, f in flags.items():
                if not f and isinstance(kw[k], torch.Tensor):
                    kw[k] = expand_models(kw[k], b)
            kw["dim"] = shift(kw["dim"])
            return op(**kw)

        return Rewrite(named(impl, op))

    return rule


def diff(call: Call) -> Rewrite:
    """diff: prepend/append tensors follow the input into B."""
    return with_index("prepend", "append")(call)


def index(call: Call) -> Rewrite:
    """`x[i, j]` with index tensors: they index behind B, batched ones per model."""
    flags = call.flags["indices"]
    x_batched = call.batched("self")
    positions = [i for i, f in enumerate(call.args["indices"]) if f is not None]
    if positions and positions != list(range(positions[0], positions[-1] + 1)):
        raise call.unsupported("indexing with non-adjacent index tensors cannot be fused")

    def impl(**kw: Any) -> Any:
        x, indices = kw["self"], list(kw["indices"])
        per_model = [t for t, f in zip(indices, flags, strict=True) if f is True]
        if not per_model:
            return aten.index.Tensor(x, [None, *indices])
        b = int(per_model[0].shape[0])
        if not x_batched:
            x = expand_models(x, b)
        rank = max(t.dim() - (1 if f is True else 0)
                   for t, f in zip(indices, flags, strict=True) if t is not None)  # fmt: skip
        aligned = [
            t[(slice(None),) + (None,) * (rank - t.dim() + 1)] if f is True else t
            for t, f in zip(indices, flags, strict=True)
        ]
        models = torch.arange(b, device=x.device).view(b, *([1] * rank))
        p = positions[0]
        if p == 0:  # the model index joins the index tensors in front
            return aten.index.Tensor(x, [models, *aligned])
        # index tensors further right: B moves next to them and back to the front after
        out = aten.index.Tensor(x.movedim(0, p), [*aligned[:p], models, *aligned[p:]])
        return out.movedim(p, 0)

    return Rewrite(named(impl, call.op))


# ------------------------------------------------------------------------------ shapes


def view(size_arg: str) -> Rule:
    """view/reshape to a per-model shape: B goes in front."""

    def rule(call: Call) -> Rewrite:
        _only_first_batched(call)
        op = call.op

        def impl(**kw: Any) -> Any:
            kw[size_arg] = [kw["self"].shape[0], *kw[size_arg]]
            return op(**kw)

        return Rewrite(named(impl, op))

    return rule


def expand(size_arg: str, keep: int) -> Rule:
    """expand (`keep` -1) and repeat (`keep` 1): the per-model rank is aligned first."""

    def rule(call: Call) -> Rewrite:
        _only_first_batched(call)
        op = call.op

        def impl(**kw: Any) -> Any:
            x, sizes = kw["self"], list(kw[size_arg])
            if x.dim() - 1 < len(sizes):
                x = x[(slice(None),) + (None,) * (len(sizes) - x.dim() + 1)]
            kw["self"], kw[size_arg] = x, [keep, *sizes]
            return op(**kw)

        return Rewrite(named(impl, op))

    return rule


def matmul(call: Call) -> Rewrite:
    """mm/bmm/matmul: batched operands broadcast over leading dims once ranks agree;
    a per-model vector becomes a one-row (or one-column) matrix."""
    a_name, b_name = list(call.args)[:2]
    fa, fb = call.batched(a_name), call.batched(b_name)

    def impl(**kw: Any) -> Any:
        a, b = kw[a_name], kw[b_name]
        row = fa and a.dim() == 2
        col = fb and b.dim() == 2
        if row:
            a = a.unsqueeze(1)
        if col:
            b = b.unsqueeze(-1)
        if fa and fb:
            a, b = align([a, b], [True, True])
        out = torch.matmul(a, b)
        if col:
            out = out.squeeze(-1)
        if row:
            out = out.squeeze(-2 if not col else -1)
        return out

    return Rewrite(named(impl, call.op))


def product_sum(names: tuple[str, str, str]) -> Rule:
    """beta * base + alpha * (a @ b) (baddbmm, addmm), per model; `names` are the
    schema's (base, a, b)."""

    def rule(call: Call) -> Rewrite:
        flags = [call.batched(k) for k in names]
        base_name, a_name, b_name = names

        def impl(**kw: Any) -> Any:
            prod = torch.matmul(*align([kw[a_name], kw[b_name]], flags[1:]))
            if kw["alpha"] != 1:
                prod = prod * kw["alpha"]
            base = kw[base_name] if kw["beta"] == 1 else kw[base_name] * kw["beta"]
            return operator.add(*align([base, prod], [flags[0], True]))

        return Rewrite(named(impl, call.op))

    return rule


def einsum(call: Call) -> Rewrite:
    """einsum: the model dimension is one more index, carried by batched operands."""
    flags = call.flags["tensors"]
    equation = str(call.args["equation"]).replace(" ", "")
    lhs, _, rhs = equation.partition("->")
    if "..." in equation or "->" not in equation:
        raise call.unsupported("einsum needs an explicit output ('->') without '...'")
    free = next(c for c in "BZYXWVUTSRQPONMLKJIHGFEDCAzyxwvutsrqponmlkjihgfedcba"
                if c not in equation)  # fmt: skip
    terms = [free + t if f else t for t, f in zip(lhs.split(","), flags, strict=True)]
    batched = f"{','.join(terms)}->{free}{rhs}"

    def impl(**kw: Any) -> Any:
        return torch.einsum(batched, *kw["tensors"])

    return Rewrite(named(impl, call.op))


def unsupported(why: str) -> Rule:
    def rule(call: Call) -> Rewrite:
        raise call.unsupported(why)

    return rule


_DATA_DEPENDENT = unsupported(
    "its result depends on per-model values (a Python number or a data-dependent shape)"
)

_DIM = dims("dim")
_REDUCE = dims("dim", every=True)

RULES: dict[Any, Rule] = {
    **{op: reduce_all(fn) for op, fn in _REDUCE_ALL.items()},
    # dimensions
    aten.sum.dim_IntList: _REDUCE, aten.mean.dim: _REDUCE, aten.amax: _REDUCE,
    aten.amin: _REDUCE, aten.std.correction: _REDUCE, aten.var.correction: _REDUCE,
    aten.var_mean.correction: _REDUCE, aten.std_mean.correction: _REDUCE,
    aten.nansum: _REDUCE, aten.logsumexp: _REDUCE, aten.any.dims: _REDUCE,
    aten.linalg_vector_norm: _REDUCE, aten.norm.ScalarOpt_dim: _REDUCE,
    aten.any.dim: _DIM, aten.all.dim: _DIM, aten.prod.dim_int: _DIM, aten.max.dim: _DIM,
    aten.min.dim: _DIM, aten.argmax: argext, aten.argmin: argext,
    aten.softmax.int: _DIM, aten._softmax: _DIM, aten.log_softmax.int: _DIM,
    aten._log_softmax: _DIM, aten.cumsum: _DIM, aten.cumprod: _DIM,
    aten.logcumsumexp: _DIM, aten.glu: _DIM, aten.unsqueeze: _DIM, aten.squeeze.dim: _DIM,
    aten.squeeze.dims: _DIM, aten.squeeze.default: squeeze_all, aten.select.int: _DIM,
    aten.slice.Tensor: _DIM, aten.narrow: _DIM, aten.split.Tensor: _DIM,
    aten.split_with_sizes: _DIM, aten.chunk: _DIM, aten.unbind.int: _DIM,
    aten.tensor_split.sections: _DIM, aten.tensor_split.indices: _DIM,
    aten.unflatten.int: _DIM, aten.topk: _DIM, aten.sort.default: _DIM,
    aten.sort.stable: _DIM, aten.argsort.default: _DIM, aten.argsort.stable: _DIM,
    aten.kthvalue: _DIM, aten.repeat_interleave.self_int: _DIM,
    aten.index_select: _DIM, aten.transpose.int: dims("dim0", "dim1"),
    aten.swapaxes: dims("axis0", "axis1"), aten.movedim.int: dims("source", "destination"),
    aten.flatten.using_ints: dims("start_dim", "end_dim"), aten.flip: dims("dims"),
    aten.roll: dims("dims"), aten.permute: permute, aten.t: transpose_2d,
    aten.cat: concat, aten.stack: concat, aten.gather: with_index("index"),
    aten.diff: diff, aten.index.Tensor: index,
    # shapes
    aten.view.default: view("size"), aten._unsafe_view: view("size"),
    aten.reshape: view("shape"), aten.expand.default: expand("size", -1),
    aten.repeat: expand("repeats", 1), aten.new_ones: shared_result,
    aten.new_zeros: shared_result, aten.new_full: shared_result,
    aten.new_empty: shared_result, aten.new_empty_strided: shared_result,
    aten.zeros_like: same_shape, aten.ones_like: same_shape, aten.full_like: same_shape,
    aten.empty_like: same_shape, aten.rand_like: same_shape, aten.randn_like: same_shape,
    aten.to.dtype: same_shape, aten.to.dtype_layout: same_shape, aten.to.device: same_shape,
    aten.to.other: same_shape, aten._to_copy: same_shape, aten.contiguous: same_shape,
    aten.alias: same_shape, aten.detach: same_shape, aten.lift_fresh_copy: same_shape,
    aten.view.dtype: same_shape, aten.tril: same_shape, aten.triu: same_shape,
    aten.fill_.Scalar: same_shape, aten.zero_: same_shape, aten.copy_: in_place_copy,
    aten._assert_tensor_metadata: assert_metadata,
    # products
    aten.mm: matmul, aten.bmm: matmul, aten.matmul: matmul,
    aten.baddbmm: product_sum(("self", "batch1", "batch2")),
    aten.einsum: einsum,
    # per-model values turned into Python or shapes
    aten.item: _DATA_DEPENDENT, aten._local_scalar_dense: _DATA_DEPENDENT,
    aten.nonzero: _DATA_DEPENDENT, aten.masked_select: _DATA_DEPENDENT,
    aten.sym_size: _DATA_DEPENDENT, aten.sym_numel: _DATA_DEPENDENT,
    aten.sym_stride: _DATA_DEPENDENT, aten.unique_consecutive: _DATA_DEPENDENT,
    aten._unique2: _DATA_DEPENDENT,
    # logical and bitwise operators torch does not tag pointwise
    **{op: pointwise for op in (aten.__and__.Tensor, aten.__or__.Tensor, aten.__xor__.Tensor,
                                aten.__and__.Scalar, aten.__or__.Scalar, aten.__xor__.Scalar,
                                aten.__iand__.Tensor, aten.__ior__.Tensor)},
    aten.broadcast_tensors: broadcast_tensors,
}  # fmt: skip


def find_rule(op: Any, table: Mapping[Any, Rule]) -> Rule | None:
    """The rule of an operator overload: its own, its packet's, or the pointwise rule."""
    rule = table.get(op) or table.get(getattr(op, "overloadpacket", None))
    if rule is None and isinstance(op, torch._ops.OpOverload) and torch.Tag.pointwise in op.tags:
        return pointwise
    return rule
