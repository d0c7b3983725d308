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
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx
from torch.fx import subgraph_rewriter

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


def _fuse_rms_norms(module: fx.GraphModule) -> int:
    """Replace each written-out RMSNorm of `module` by `aten.rms_norm`; how many."""
    graph = module.graph
    count = 0
    for mean in list(graph.nodes):
        found = _rms_norm_chain(mean)
        if found is None:
            continue
        x, weight, eps, last = found
        with graph.inserting_before(last):
            fused = graph.call_function(
                aten.rms_norm.default, (x, [x.meta["val"].shape[-1]], weight, eps)
            )
        fused.meta = dict(last.meta)
        last.replace_all_uses_with(fused)
        dead = [last]
        while dead:  # the chain back to `mean`, and assertions left reading it
            node = dead.pop()
            users = list(node.users)
            if any(u.target is not aten._assert_tensor_metadata.default for u in users):
                continue
            for u in users:
                graph.erase_node(u)
            inputs = node.all_input_nodes
            graph.erase_node(node)
            kept = (x, weight)
            dead.extend(n for n in inputs if n not in kept and n.op != "placeholder")
        count += 1
    if count:
        module.recompile()
    return count


def simplify(module: fx.GraphModule) -> int:
    """Replace every known operator chain of `module`'s graph in place; how many."""
    count = 0
    for pattern, replacement in PATTERNS:
        count += len(subgraph_rewriter.replace_pattern(module, pattern, replacement))
    return count + _fuse_rms_norms(module)
