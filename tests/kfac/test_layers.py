"""The factor rows of every layer reproduce autograd's weight gradient exactly.

``g_rows^T a_rows / batch`` is the weight gradient by construction of K-FAC's blocks, so
this checks the patch extraction (stride, dilation, padding and its mode, groups), bias
columns, the batch scaling of G and the matrix layout against torch's own backward.
K-FAC-reduce's rows are checked against their definition on the expand rows (each sample's
mean input row, summed output-gradient row), and against the gradient where reduce is
exact: inputs that agree over positions.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from plait.kfac.factors import unpack
from plait.kfac.layers import (
    Conv2dLayer,
    EmbeddingLayer,
    FactorShape,
    KFACLayer,
    LinearLayer,
    make_layer,
)

CONVS: list[dict[str, Any]] = [
    {"kernel_size": 3},
    {"kernel_size": 3, "padding": 1, "bias": False},
    {"kernel_size": 3, "stride": 2, "padding": 1},
    {"kernel_size": (3, 2), "dilation": (2, 1), "padding": (2, 1)},
    {"kernel_size": 3, "padding": "same", "dilation": 2},
    {"kernel_size": 3, "padding": 1, "padding_mode": "reflect"},
    {"kernel_size": 3, "padding": 2, "padding_mode": "circular", "stride": 2},
    {"kernel_size": 3, "padding": 1, "padding_mode": "replicate", "groups": 2},
    {"kernel_size": 1, "groups": 4},
    # asymmetric 'same' padding (even kernel) and strides that skip rows and columns
    {"kernel_size": 4, "padding": "same"},
    {"kernel_size": (2, 3), "stride": (2, 3), "padding": (1, 0), "dilation": (1, 2)},
]


def _check(layer: KFACLayer, x: torch.Tensor, *, batch: int) -> None:
    captured: dict[str, torch.Tensor] = {}
    out = layer.module(x)
    out.register_hook(lambda g: captured.setdefault("g", g))
    (out.double() ** 2).mean().backward()
    rows_a = layer.a_rows(x)
    rows_g = layer.g_rows(captured["g"], batch)
    expected = torch.matmul(rows_g.transpose(1, 2), rows_a) / batch
    got = layer.grad_matrix()
    assert got is not None
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)
    dense = torch.matmul(rows_a.transpose(1, 2), rows_a)
    for packed in (True, False):
        total, n = layer.a_sum(x, packed=packed)
        assert n == rows_a.shape[1]
        if layer.a_shape.diagonal:
            torch.testing.assert_close(total, torch.diagonal(dense[0]))
        elif packed:
            assert total.numel() == layer.a_shape.packed_numel
            torch.testing.assert_close(unpack(total, layer.a_shape), dense)
        else:
            torch.testing.assert_close(total.view_as(dense), dense)


@pytest.mark.parametrize("kw", CONVS, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
def test_conv2d_rows_give_the_gradient(kw: dict[str, Any]) -> None:
    torch.manual_seed(0)
    conv = nn.Conv2d(4, 8, **kw).double()
    layer = make_layer("conv", conv)
    assert isinstance(layer, Conv2dLayer)
    _check(layer, torch.randn(3, 4, 7, 6, dtype=torch.float64), batch=3)


@pytest.mark.parametrize("shape", [(5, 6), (2, 3, 6)])
@pytest.mark.parametrize("bias", [True, False])
def test_linear_rows_give_the_gradient(shape: tuple[int, ...], bias: bool) -> None:
    torch.manual_seed(0)
    layer = make_layer("fc", nn.Linear(6, 4, bias=bias).double())
    assert isinstance(layer, LinearLayer)
    assert layer.a_shape == FactorShape(dim=6 + bias)
    _check(layer, torch.randn(*shape, dtype=torch.float64), batch=shape[0])


def test_embedding_rows_give_the_gradient_and_a_diagonal_factor() -> None:
    torch.manual_seed(0)
    layer = make_layer("emb", nn.Embedding(9, 5).double())
    assert isinstance(layer, EmbeddingLayer)
    assert layer.a_shape.diagonal
    _check(layer, torch.randint(0, 9, (4, 3)), batch=4)


def test_set_grad_matrix_round_trips() -> None:
    torch.manual_seed(0)
    for module in (nn.Linear(3, 2), nn.Conv2d(4, 6, 3, groups=2), nn.Embedding(5, 3)):
        layer = make_layer("m", module)
        assert layer is not None
        for p in module.parameters():
            p.grad = torch.randn_like(p)
        before = [p.grad.clone() for p in module.parameters()]
        m = layer.grad_matrix()
        assert m is not None
        layer.set_grad_matrix(m * 2)
        for p, b in zip(module.parameters(), before, strict=True):
            torch.testing.assert_close(p.grad, 2 * b)


def test_unsupported_modules_get_no_adapter() -> None:
    assert make_layer("bn", nn.BatchNorm2d(3)) is None
    assert make_layer("c1", nn.Conv1d(2, 2, 3)) is None
    assert make_layer("e", nn.Embedding(4, 2, sparse=True)) is None
    frozen = nn.Linear(2, 2)
    frozen.requires_grad_(False)
    assert make_layer("f", frozen) is None


class _MyLinear(nn.Module):
    """A user's Linear-like layer that stock K-FAC does not know."""

    def __init__(self, n_in: int, n_out: int, *, transposed: bool = False) -> None:
        super().__init__()
        self.transposed = transposed
        shape = (n_in, n_out) if transposed else (n_out, n_in)
        self.weight = nn.Parameter(torch.randn(*shape, dtype=torch.float64))
        self.bias = nn.Parameter(torch.randn(n_out, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight if self.transposed else self.weight.t()
        return x @ w + self.bias


@pytest.mark.parametrize("transposed", [False, True])
def test_registered_linear_like_layers_get_the_linear_adapter(transposed: bool) -> None:
    from plait.kfac import register_layer_type, unregister_layer_type
    from plait.kfac.layers import LinearLayer

    module = _MyLinear(3, 4, transposed=transposed)
    assert make_layer("m", module) is None
    register_layer_type(_MyLinear, transposed=transposed)
    try:
        layer = make_layer("m", module)
        assert isinstance(layer, LinearLayer) and layer.a_shape.dim == 4
        x = torch.randn(5, 3, dtype=torch.float64)
        out = module(x)
        gout = torch.randn_like(out)
        out.backward(gout)
        want = layer.grad_matrix()
        assert want is not None
        rows = layer.g_rows(gout, 1).transpose(1, 2) @ layer.a_rows(x)
        torch.testing.assert_close(rows, want)
        layer.set_grad_matrix(2 * want)
        torch.testing.assert_close(layer.grad_matrix(), 2 * want)
    finally:
        unregister_layer_type(_MyLinear)
    with pytest.raises(ValueError, match=r"nn\.Module subclass"):
        register_layer_type(int)  # type: ignore[arg-type]


def _reduce_reference(layer: KFACLayer, x: torch.Tensor, g: torch.Tensor, batch: int) -> Any:
    """K-FAC-reduce's rows by definition, from the expand rows: [groups, batch, dim]."""
    a = layer.a_rows(x)
    rows_g = layer.g_rows(g, batch)
    groups = a.shape[0]
    return (
        a.reshape(groups, batch, -1, a.shape[-1]).mean(2),
        rows_g.reshape(groups, batch, -1, rows_g.shape[-1]).sum(2),
    )


@pytest.mark.parametrize("kw", CONVS, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
def test_conv2d_reduce_rows_are_each_samples_mean_patch_and_summed_gradient(
    kw: dict[str, Any],
) -> None:
    torch.manual_seed(0)
    conv = nn.Conv2d(4, 8, **kw).double()
    layer = make_layer("conv", conv)
    assert isinstance(layer, Conv2dLayer) and layer.reducible
    x = torch.randn(3, 4, 7, 6, dtype=torch.float64)
    g = torch.randn_like(conv(x))
    want_a, want_g = _reduce_reference(layer, x, g, 3)
    # the conv's own paths never unfold the patches: compared with the unfolded definition
    torch.testing.assert_close(layer.a_reduced(x, 3), want_a, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(layer.g_reduced(g, 3), want_g, rtol=1e-12, atol=1e-12)
    total, n = layer.a_sum(x, packed=False, reduce_to=3)
    assert n == 3
    dense = torch.matmul(want_a.transpose(1, 2), want_a)
    torch.testing.assert_close(total.view_as(dense), dense)
    total, n = layer.g_sum(g, 3, packed=True, reduce=True)
    assert n == 3
    dense = torch.matmul(want_g.transpose(1, 2), want_g)
    torch.testing.assert_close(unpack(total, layer.g_shape), dense)


@pytest.mark.parametrize("bias", [True, False])
def test_linear_reduce_rows_average_over_positions(bias: bool) -> None:
    torch.manual_seed(0)
    layer = make_layer("fc", nn.Linear(6, 4, bias=bias).double())
    assert isinstance(layer, LinearLayer)
    x = torch.randn(2, 5, 6, dtype=torch.float64)
    g = torch.randn(2, 5, 4, dtype=torch.float64)
    want_a, want_g = _reduce_reference(layer, x, g, 2)
    torch.testing.assert_close(layer.a_reduced(x, 2), want_a)
    torch.testing.assert_close(layer.g_reduced(g, 2), want_g)
    # the base class's default (used by registered adapters) agrees with the fast path
    torch.testing.assert_close(KFACLayer.a_reduced(layer, x, 2), want_a)
    torch.testing.assert_close(KFACLayer.g_reduced(layer, g, 2), want_g)
    # without positions (a [batch, in] input) reduce is expand
    flat = torch.randn(5, 6, dtype=torch.float64)
    torch.testing.assert_close(layer.a_reduced(flat, 5), layer.a_rows(flat))


def test_reduce_rows_give_the_gradient_when_inputs_agree_over_positions() -> None:
    torch.manual_seed(0)
    layer = make_layer("fc", nn.Linear(6, 4).double())
    assert layer is not None
    x = torch.randn(3, 1, 6, dtype=torch.float64).expand(3, 5, 6)  # same input at 5 positions
    out = layer.module(x)
    captured: dict[str, torch.Tensor] = {}
    out.register_hook(lambda g: captured.setdefault("g", g))
    (out**2).mean().backward()
    rows_a, rows_g = layer.a_reduced(x, 3), layer.g_reduced(captured["g"], 3)
    torch.testing.assert_close(
        torch.matmul(rows_g.transpose(1, 2), rows_a) / 3, layer.grad_matrix()
    )


def test_embeddings_stay_on_expand() -> None:
    layer = make_layer("emb", nn.Embedding(9, 5))
    assert isinstance(layer, EmbeddingLayer) and not layer.reducible
