"""The native kernels as torch operators: compiled without graph breaks, named by the
profiler, and fake implementations that agree with the real ones."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

import plait
from plait.fused import native
from plait.fused.native import ops
from tests.fused.helpers import rel_err

REASON = native.unavailable_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"native kernels: {REASON}")


def _array() -> tuple[nn.Module, torch.Tensor]:
    """A fused array of three small pre-norm Transformer layers (native attention and layer
    norm both apply: T = 8, heads of 8, rows of 16) and its input."""
    torch.manual_seed(0)
    layers = [
        nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True, norm_first=True)
        for _ in range(3)
    ]
    return plait.fuse(layers), torch.randn(3, 4, 8, 16)


def test_compiled_fused_array_has_no_graph_break() -> None:
    """fullgraph=True fails on any graph break; aot_eager traces the backward too, through
    the operators' fake implementations, without inductor's compile time."""
    array, x = _array()
    with profile(activities=[ProfilerActivity.CPU]) as prof:  # the eager path is native
        eager = array(x)
    assert "plait::attention" in {e.name for e in prof.events()}
    (grad,) = torch.autograd.grad(eager.square().sum(), [next(array.parameters())])
    torch._dynamo.reset()
    compiled = torch.compile(array, backend="aot_eager", fullgraph=True)
    out = compiled(x)
    (cgrad,) = torch.autograd.grad(out.square().sum(), [next(array.parameters())])
    # the same kernels in the same order: equal up to the summation order of the
    # autograd graph aot_eager rebuilds (float32, a few ulps)
    assert rel_err(out, eager) <= 1e-6 and rel_err(cgrad, grad) <= 1e-5


def test_profiler_names_the_kernels() -> None:
    array, x = _array()
    opt = plait.fused.FusedAdam(array.parameters(), lr=[1e-3, 2e-3, 3e-3])
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        array(x).sum().backward()
        opt.step()
    names = {e.name for e in prof.events()}
    assert {
        "plait::attention",
        "plait::attention_backward",
        "plait::layer_norm",
        "plait::layer_norm_backward",
        "plait::adam_step",
    } <= names


def test_fake_implementations_agree_with_the_kernels() -> None:
    """torch.library.opcheck: schema, fake shapes and strides against real calls."""
    x, w, b = torch.randn(3, 5, 16), torch.randn(3, 16), torch.randn(3, 16)
    qkv = torch.randn(4, 8, 48)
    native.layer_norm_kernels(x, width=16, weight=w, bias=b)  # chooses (loads) the kernels
    native.attention_kernels(qkv, heads=2, mask=None)
    y, mean, rstd = ops.layer_norm(x, w, b, 1e-5)
    out, probs = ops.attention(qkv, None, 2, 0.25)
    cases = [
        (ops.layer_norm, (x, w, b, 1e-5)),
        (ops.layer_norm, (x, None, None, 1e-5)),
        (ops.layer_norm_backward, (torch.randn_like(y), x, mean, rstd, w, True, True)),
        (ops.attention, (qkv, None, 2, 0.25)),
        (ops.attention_backward, (qkv, probs, torch.randn_like(out), 2, 0.25)),
    ]
    for op, args in cases:
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))
