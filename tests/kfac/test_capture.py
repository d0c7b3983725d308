"""`FactorCapture`: the factor hooks as a public API, with any sink."""

from __future__ import annotations

import torch
from torch import nn

from plait.kfac.capture import FactorCapture
from plait.kfac.layers import FactorKind, KFACLayer, make_layer


def _linear() -> tuple[nn.Linear, dict[str, KFACLayer]]:
    torch.manual_seed(0)
    lin = nn.Linear(3, 2).double()
    layer = make_layer("lin", lin)
    assert layer is not None
    return lin, {"lin": layer}


def test_sums_reach_the_sink_as_dense_outer_products() -> None:
    lin, layers = _linear()
    got: dict[FactorKind, tuple[torch.Tensor, int]] = {}

    def sink(layer: KFACLayer, kind: FactorKind, total: torch.Tensor, rows: int) -> None:
        got[kind] = (total, rows)

    cap = FactorCapture(layers, sink, packed=False)
    cap.attach()
    x = torch.randn(4, 3, dtype=torch.float64)
    out = lin(x)
    out.sum().backward()
    a = torch.cat([x, torch.ones(4, 1, dtype=torch.float64)], 1)
    torch.testing.assert_close(got[FactorKind.A][0].view(4, 4), a.T @ a)
    g = torch.ones(4, 2, dtype=torch.float64) * 4  # output gradients times the batch size
    torch.testing.assert_close(got[FactorKind.G][0].view(2, 2), g.T @ g)
    assert got[FactorKind.A][1] == got[FactorKind.G][1] == 4
    assert cap.seconds > 0
    cap.remove()
    got.clear()
    lin(x).sum().backward()
    assert not got  # removed: nothing


def test_inactive_steps_evaluation_and_redirection() -> None:
    lin, layers = _linear()
    seen: list[FactorKind] = []
    accepted: list[str] = []
    active = {"on": False}
    cap = FactorCapture(
        layers, lambda layer, kind, total, rows: seen.append(kind), active=lambda: active["on"],
        accept=lambda layer, x: accepted.append(layer.name) is None,
    )  # fmt: skip
    cap.attach()
    x = torch.randn(4, 3, dtype=torch.float64)
    lin(x).sum().backward()
    assert not seen  # not a factor step
    active["on"] = True
    with torch.no_grad():
        lin(x)
    lin.eval()
    lin(x).sum().backward()
    assert not seen  # no gradients, or evaluation
    lin.train()
    other: list[FactorKind] = []
    before = cap.seconds
    with cap.redirected(lambda layer, kind, total, rows: other.append(kind)):
        lin(x).sum().backward()
    assert other == [FactorKind.A, FactorKind.G] and not seen and not accepted
    assert cap.seconds == before  # the owner's clock is left alone
    lin(x).sum().backward()
    assert seen == [FactorKind.A, FactorKind.G] and accepted == ["lin"]


def test_ekfac_statistic_in_the_identity_basis_is_the_squared_gradient_rows() -> None:
    """With identity bases the statistic is the sum of each row's squared gradient, and
    before any basis it is zero (its running average starts from K-FAC's eigenvalues)."""
    lin, layers = _linear()
    got: dict[FactorKind, torch.Tensor] = {}
    bases = {"b": (None, None)}
    cap = FactorCapture(layers, lambda layer, kind, total, rows: got.__setitem__(kind, total),
                        bases=lambda layer: bases["b"])  # type: ignore[arg-type,return-value]  # fmt: skip
    cap.attach()
    x = torch.randn(5, 3, dtype=torch.float64)
    w = torch.randn(5, 2, dtype=torch.float64)
    (lin(x) * w).sum().backward()
    assert torch.count_nonzero(got[FactorKind.S]) == 0 and got[FactorKind.S].numel() == 2 * 4
    bases["b"] = (torch.eye(4, dtype=torch.float64)[None], torch.eye(2, dtype=torch.float64)[None])
    (lin(x) * w).sum().backward()
    a = torch.cat([x, torch.ones(5, 1, dtype=torch.float64)], 1)
    g = w * 5
    want = sum(torch.outer(g[r], a[r]) ** 2 for r in range(5))
    torch.testing.assert_close(got[FactorKind.S].view(2, 4), want)
