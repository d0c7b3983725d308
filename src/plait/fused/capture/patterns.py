"""Graph rewrites applied to a captured forward before it is fused.

A model written in Python records some functions as chains of ATen operators that torch
has one kernel for. Fused, each operator of the chain touches all B models' activations
once more, so a chain of eight element-wise kernels costs eight passes over B times the
data, forward and backward. Replacing the chain by the single kernel computes the same
function (to float rounding: the kernel evaluates the same formula in one pass).

- GELU with the tanh approximation written out (transformers' `NewGELUActivation`,
  GPT-2's `gelu_new`): eight operators -> `aten.gelu(approximate="tanh")`.
- RMSNorm written out (transformers' `LlamaRMSNorm` and its copies: x * rsqrt(mean(x^2)
  + eps) * weight, with casts to and from float32): six to nine operators ->
  `aten.rms_norm`, whose fused rule runs one kernel each way.
- Keys and values repeated per query head before attention (transformers' `repeat_kv`
  for grouped-query attention: unsqueeze, expand, reshape, a copy each way) -> the
  unrepeated ones with `enable_gqa`, which the attention kernels read in place.
- The rotary position embedding written out (transformers' `apply_rotary_pos_emb`:
  x * cos + cat(-x2, x1) * sin, seven operators) -> `plait::rotary`, one kernel each way.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import fx
from torch.fx import subgraph_rewriter

from plait.fused.native import ops as native_ops

aten = torch.ops.aten


def _gelu_tanh_written_out(x: torch.Tensor) -> torch.Tensor:
    """0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))), as transformers writes it."""
    half = aten.mul.Tensor(x, 0.5)
    cube = aten.pow.Tensor_Scalar(x, 3.0)
    inner = aten.add.Tensor(x, aten.mul.Tensor(cube, 0.044715))
    t = aten.tanh.default(aten.mul.Tensor(inner, 0.7978845608028654))
    out: torch.Tensor = aten.mul.Tensor(half, aten.add.Tensor(t, 1.0))
    return out


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = aten.gelu.default(x, approximate="tanh")
    return out


PATTERNS = ((_gelu_tanh_written_out, _gelu_tanh),)


def _only_user(node: fx.Node, target: Any) -> fx.Node | None:
    """`node`'s one user other than metadata assertions, if it calls `target`."""
    users = [u for u in node.users if u.target is not aten._assert_tensor_metadata.default]
    if len(users) != 1 or users[0].target is not target:
        return None
    return users[0]


def _other(node: fx.Node, one: fx.Node) -> Any:
    """The argument of binary `node` that is not `one` (None if both or neither are)."""
    a, b = node.args[:2]
    if (a is one) == (b is one):
        return None
    return b if a is one else a


def _same_dtype_cast(node: fx.Node | None) -> bool:
    """A cast to the dtype its input already has (transformers' float32 round trip)."""
    if node is None or node.target is not aten.to.dtype or len(node.args) < 2:
        return False
    value = node.args[0].meta.get("val") if isinstance(node.args[0], fx.Node) else None
    return isinstance(value, torch.Tensor) and value.dtype == node.args[1] and not node.kwargs


def _rms_norm_chain(mean: fx.Node) -> tuple[fx.Node, fx.Node, float, fx.Node] | None:
    """(x, weight, eps, last node) of a written-out RMSNorm whose mean is `mean`."""
    if mean.target is not aten.mean.dim or len(mean.args) < 3 or mean.args[2] is not True:
        return None
    square = mean.args[0]
    if not isinstance(square, fx.Node) or square.target is not aten.pow.Tensor_Scalar:
        return None
    x, power = square.args[:2]
    value = x.meta.get("val") if isinstance(x, fx.Node) else None
    dims = mean.args[1]
    if power != 2 or not isinstance(value, torch.Tensor) or not isinstance(dims, list | tuple):
        return None
    if list(dims) not in ([-1], [value.dim() - 1]):
        return None
    shift = _only_user(mean, aten.add.Tensor)
    eps = None if shift is None else _other(shift, mean)
    root = None if shift is None else _only_user(shift, aten.rsqrt.default)
    scaled = None if root is None else _only_user(root, aten.mul.Tensor)
    if not isinstance(eps, float) or root is None or scaled is None:
        return None
    if _other(scaled, root) is not x:
        return None
    last = scaled
    cast = _only_user(scaled, aten.to.dtype)
    if _same_dtype_cast(cast):
        assert cast is not None
        last = cast
    scale = _only_user(last, aten.mul.Tensor)
    weight = None if scale is None else _other(scale, last)
    shape = getattr(weight.meta.get("val") if isinstance(weight, fx.Node) else None, "shape", ())
    if scale is None or not isinstance(weight, fx.Node) or list(shape) != [value.shape[-1]]:
        return None
    return x, weight, eps, scale


def _erase_unused(graph: fx.Graph, ends: Iterable[Any], keep: Iterable[Any] = ()) -> None:
    """Erase the operators that only fed `ends` once nothing else reads them (metadata
    assertions on them included), back to the graph's inputs or the nodes in `keep`."""
    kept = {a for a in keep if isinstance(a, fx.Node)}
    dead = [n for n in ends if isinstance(n, fx.Node)]
    erased: set[fx.Node] = set()
    while dead:
        node = dead.pop()
        users = list(node.users)
        if node in kept or node in erased or node.op != "call_function":
            continue
        if any(u.target is not aten._assert_tensor_metadata.default for u in users):
            continue  # something else reads it
        for u in users:
            graph.erase_node(u)
        dead.extend(node.all_input_nodes)
        graph.erase_node(node)
        erased.add(node)


def _replace(graph: fx.Graph, last: fx.Node, target: Any, args: tuple[Any, ...]) -> None:
    """Put ``target(*args)`` where chain end `last` was, and erase what only fed `last`,
    back to `args`."""
    with graph.inserting_before(last):
        fused = graph.call_function(target, args)
    fused.meta = dict(last.meta)
    last.replace_all_uses_with(fused)
    _erase_unused(graph, [last], keep=args)


def _fuse_rms_norms(module: fx.GraphModule) -> int:
    """Replace each written-out RMSNorm of `module` by `aten.rms_norm`; how many."""
    count = 0
    for mean in list(module.graph.nodes):
        found = _rms_norm_chain(mean)
        if found is not None:
            x, weight, eps, last = found
            args = (x, [x.meta["val"].shape[-1]], weight, eps)
            _replace(module.graph, last, aten.rms_norm.default, args)
            count += 1
    if count:
        module.recompile()
    return count


def _unrepeated(node: Any) -> tuple[fx.Node, int] | None:
    """(kv, repeats) when `node` is kv [b, h, T, d] repeated per head: reshape(expand(
    unsqueeze(kv, 2), [b, h, n, T, d]), [b, h * n, T, d])."""
    if not isinstance(node, fx.Node) or node.target not in (aten.reshape.default,
                                                            aten.view.default):  # fmt: skip
        return None
    expand = node.args[0]
    if not isinstance(expand, fx.Node) or expand.target is not aten.expand.default:
        return None
    unsqueeze = expand.args[0]
    if not isinstance(unsqueeze, fx.Node) or unsqueeze.target is not aten.unsqueeze.default:
        return None
    kv = unsqueeze.args[0]
    value = kv.meta.get("val") if isinstance(kv, fx.Node) else None
    if not isinstance(value, torch.Tensor) or value.dim() != 4 or unsqueeze.args[1] != 2:
        return None
    b, h, t, d = value.shape
    if not isinstance(expand.args[1], list | tuple) or not isinstance(node.args[1], list | tuple):
        return None
    sizes, shape = list(expand.args[1]), list(node.args[1])
    if len(sizes) != 5 or sizes[:2] != [b, h] or sizes[3:] != [t, d]:
        return None
    n = sizes[2]
    if not isinstance(n, int) or shape not in ([b, h * n, t, d], [b, -1, t, d]):
        return None
    assert isinstance(kv, fx.Node)
    return kv, n


def _grouped_query_attention(module: fx.GraphModule) -> int:
    """Give attention its keys and values unrepeated, with `enable_gqa`; how many."""
    count = 0
    for node in module.graph.nodes:
        if node.target is not aten.scaled_dot_product_attention.default:
            continue
        key, value = (_unrepeated(a) for a in node.args[1:3])
        if key is None or value is None or key[1] != value[1] or node.kwargs.get("enable_gqa"):
            continue
        repeated = node.args[1:3]
        node.args = (node.args[0], key[0], value[0], *node.args[3:])
        node.kwargs = {**node.kwargs, "enable_gqa": True}
        _erase_unused(module.graph, repeated)  # reshape <- expand <- unsqueeze
        count += 1
    if count:
        module.recompile()
    return count


def _halves(cat: Any) -> fx.Node | None:
    """x when `cat` is cat([-x[..., half:], x[..., :half]], -1): rotate_half(x)."""
    if not isinstance(cat, fx.Node) or cat.target is not aten.cat.default:
        return None
    parts = cat.args[0]
    if not isinstance(parts, list | tuple) or len(parts) != 2:
        return None
    neg, low = parts
    if not isinstance(neg, fx.Node) or neg.target is not aten.neg.default:
        return None
    high = neg.args[0]
    if not all(isinstance(n, fx.Node) and n.target is aten.slice.Tensor for n in (high, low)):
        return None
    assert isinstance(high, fx.Node) and isinstance(low, fx.Node)
    x = high.args[0]
    value = x.meta.get("val") if isinstance(x, fx.Node) else None
    if low.args[0] is not x or not isinstance(value, torch.Tensor) or value.shape[-1] % 2:
        return None
    half, last = value.shape[-1] // 2, value.dim() - 1
    dim = cat.args[1] if len(cat.args) > 1 else 0
    if dim not in (-1, last) or any(n.args[1] not in (-1, last) for n in (high, low)):
        return None
    if list(low.args[2:4]) != [0, half] or high.args[2] != half:
        return None
    if any(len(n.args) > 4 and n.args[4] != 1 for n in (high, low)):  # a step
        return None
    assert isinstance(x, fx.Node)
    return x


def _rotary_chain(add: fx.Node) -> tuple[fx.Node, Any, Any] | None:
    """(x, cos, sin) when `add` is x * cos + rotate_half(x) * sin."""
    if add.target is not aten.add.Tensor or len(add.args) != 2 or add.kwargs:
        return None
    for straight, turned in (add.args, add.args[::-1]):
        if not (isinstance(straight, fx.Node) and straight.target is aten.mul.Tensor):
            continue
        if not (isinstance(turned, fx.Node) and turned.target is aten.mul.Tensor):
            continue
        for cat, sin in (turned.args, turned.args[::-1]):
            x = _halves(cat)
            if x is None or not isinstance(sin, fx.Node):
                continue
            cos = _other(straight, x)
            if isinstance(cos, fx.Node) and cos is not x:
                return x, cos, sin
    return None


def _fuse_rotary(module: fx.GraphModule) -> int:
    """Replace each written-out rotary embedding of `module` by `plait::rotary`."""
    count = 0
    for add in list(module.graph.nodes):
        found = _rotary_chain(add)
        if found is not None:
            _replace(module.graph, add, native_ops.rotary, found)
            count += 1
    if count:
        module.recompile()
    return count


def simplify(module: fx.GraphModule) -> int:
    """Replace every known operator chain of `module`'s graph in place; how many."""
    count = 0
    for pattern, replacement in PATTERNS:
        count += len(subgraph_rewriter.replace_pattern(module, pattern, replacement))
    count += _fuse_rms_norms(module) + _fuse_rotary(module)
    return count + _grouped_query_attention(module)
