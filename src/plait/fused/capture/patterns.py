"""Graph rewrites applied to a captured forward before it is fused.

A model written in Python records some functions as chains of ATen operators that torch
has one kernel for. Fused, each operator of the chain touches all B models' activations
once more, so a chain of eight element-wise kernels costs eight passes over B times the
data, forward and backward. Replacing the chain by the single kernel computes the same
function (to float rounding: the kernel evaluates the same formula in one pass).

- GELU with the tanh approximation written out (transformers' `NewGELUActivation`,
  GPT-2's `gelu_new`): eight operators -> `aten.gelu(approximate="tanh")`.
"""

from __future__ import annotations

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


def simplify(module: fx.GraphModule) -> int:
    """Replace every known operator chain of `module`'s graph in place; how many."""
    count = 0
    for pattern, replacement in PATTERNS:
        count += len(subgraph_rewriter.replace_pattern(module, pattern, replacement))
    return count
