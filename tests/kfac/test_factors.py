from __future__ import annotations

import math

import pytest
import torch

from plait.kfac.factors import (
    Method,
    SecondOrder,
    WireLayout,
    decompose,
    kl_clip_scale,
    pack,
    precondition,
    unpack,
)
from plait.kfac.layers import FactorShape


def _spd(n: int, groups: int = 1, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(groups, n, 2 * n, generator=g, dtype=torch.float64)
    return x @ x.transpose(1, 2) / (2 * n)


def test_pack_round_trip_halves_the_numbers() -> None:
    shape = FactorShape(dim=7, groups=3)
    f = _spd(7, 3)
    flat = pack(f, shape)
    assert flat.numel() == shape.packed_numel == 3 * 7 * 8 // 2
    torch.testing.assert_close(unpack(flat, shape), f)
    upper = unpack(flat, shape, mirror=False)
    torch.testing.assert_close(upper, torch.triu(f))


@pytest.mark.parametrize("method", list(Method))
def test_decompositions_read_only_the_upper_triangle(method: Method) -> None:
    shape = FactorShape(dim=6, groups=2)
    f = _spd(6, 2)
    garbage = torch.triu(f) + torch.tril(torch.full_like(f, 1e3), -1)
    a = decompose(f, shape, method=method, damping=0.1, packed=False)
    b = decompose(garbage, shape, method=method, damping=0.1, packed=False)
    m = torch.randn(2, 3, 6, dtype=torch.float64)
    g = decompose(_spd(3, 2, 1), FactorShape(dim=3, groups=2), method=method, damping=0.1,
                  packed=False)  # fmt: skip
    torch.testing.assert_close(precondition(m, a, g), precondition(m, b, g))


@pytest.mark.parametrize("explicit", [False, True], ids=["cholesky", "explicit"])
def test_inverse_method_is_factored_tikhonov(explicit: bool) -> None:
    """(G + sqrt(d) I)^-1 M (A + sqrt(d) I)^-1, from torch.linalg.inv."""
    a, g = _spd(5)[0], _spd(3, seed=1)[0]
    m = torch.randn(1, 3, 5, dtype=torch.float64)
    d = 0.04
    sa = decompose(a.unsqueeze(0), FactorShape(dim=5), method=Method.INVERSE, damping=d,
                   packed=True, explicit=explicit)  # fmt: skip
    sg = decompose(g.unsqueeze(0), FactorShape(dim=3), method=Method.INVERSE, damping=d,
                   packed=True, explicit=explicit)  # fmt: skip
    assert (sa.inverse is not None) == explicit and (sa.chol is not None) != explicit
    want = torch.linalg.inv(g + math.sqrt(d) * torch.eye(3, dtype=torch.float64)) @ m[0]
    want = want @ torch.linalg.inv(a + math.sqrt(d) * torch.eye(5, dtype=torch.float64))
    torch.testing.assert_close(precondition(m, sa, sg)[0], want)


def test_eigen_method_is_exact_tikhonov() -> None:
    """vec(P) = (G (x) A + d I)^-1 vec(M) with an explicit Kronecker product."""
    a, g = _spd(4)[0], _spd(3, seed=1)[0]
    m = torch.randn(1, 3, 4, dtype=torch.float64)
    d = 0.01
    sa = decompose(a.unsqueeze(0), FactorShape(dim=4), method=Method.EIGEN, damping=d,
                   packed=False)  # fmt: skip
    sg = decompose(g.unsqueeze(0), FactorShape(dim=3), method=Method.EIGEN, damping=d,
                   packed=False)  # fmt: skip
    big = torch.kron(g, a) + d * torch.eye(12, dtype=torch.float64)
    want = torch.linalg.solve(big, m.reshape(-1)).reshape(3, 4)
    torch.testing.assert_close(precondition(m, sa, sg)[0], want)


FORMS = [(Method.INVERSE, False), (Method.INVERSE, True), (Method.EIGEN, False)]


@pytest.mark.parametrize(("method", "explicit"), FORMS, ids=["cholesky", "explicit", "eigen"])
@pytest.mark.parametrize("packed", [True, False])
def test_second_order_survives_the_wire(method: Method, explicit: bool, packed: bool) -> None:
    # 130 > one band of the packed layout
    shape = FactorShape(dim=130, groups=2)
    so = decompose(_spd(130, 2), shape, method=method, damping=0.1, packed=packed,
                   explicit=explicit)  # fmt: skip
    assert so.explicit == explicit
    flat = so.to_wire(packed=packed)
    assert flat.numel() == so.wire_numel(packed=packed)
    back = SecondOrder.from_wire(flat.clone(), method=method, shape=shape, damping=0.1,
                                 packed=packed, explicit=explicit)  # fmt: skip
    m = torch.randn(2, 4, 130, dtype=torch.float64)
    g = decompose(_spd(4, 2, 3), FactorShape(dim=4, groups=2), method=method, damping=0.1,
                  packed=packed, explicit=explicit)  # fmt: skip
    # bit-identical: the owner and every receiver must precondition with the same numbers
    assert torch.equal(precondition(m, so, g), precondition(m, back, g))


def test_diagonal_factor() -> None:
    shape = FactorShape(dim=4, diagonal=True)
    a = torch.tensor([0.5, 0.0, 2.0, 1.0], dtype=torch.float64)
    so = decompose(a, shape, method=Method.INVERSE, damping=0.25, packed=True)
    assert so.inverse is not None
    torch.testing.assert_close(so.inverse, 1 / (a + 0.5))
    assert WireLayout(packed=True).numel(shape) == 4


def test_kl_clip_scale() -> None:
    p = [torch.full((2, 2), 2.0)]
    m = [torch.full((2, 2), 3.0)]
    # vg = lr^2 * sum(p * m) = 0.01 * 24
    s = kl_clip_scale(list(zip(p, m, strict=True)), lr=0.1, kl_clip=0.06)
    assert float(s) == pytest.approx(math.sqrt(0.06 / 0.24))
    assert float(kl_clip_scale(list(zip(p, m, strict=True)), lr=0.1, kl_clip=10.0)) == 1.0
    assert float(kl_clip_scale([(torch.zeros(2), torch.ones(2))], lr=0.1, kl_clip=1.0)) == 1.0
    # the KL change is |lr^2 <P, M>|: a negative product clips as its magnitude does
    s = kl_clip_scale([(-p[0], m[0])], lr=0.1, kl_clip=0.06)
    assert float(s) == pytest.approx(math.sqrt(0.06 / 0.24))


def test_an_indefinite_factor_is_lifted_to_the_damping_floor() -> None:
    """Rounding can leave a running factor slightly indefinite; Cholesky then fails and the
    spectrum is clamped at sqrt(damping) instead, which is what the damped inverse of an
    exact (PSD) factor can never go below either."""
    vals = torch.tensor([4.0, 1.0, -0.5], dtype=torch.float64)  # -0.5 + sqrt(0.01) < 0
    q, _ = torch.linalg.qr(torch.randn(3, 3, dtype=torch.float64))
    f = (q * vals) @ q.T
    so = decompose(f.unsqueeze(0), FactorShape(dim=3), method=Method.INVERSE, damping=0.01,
                   packed=True)  # fmt: skip
    lifted = (q * torch.tensor([4.1, 1.1, 0.1], dtype=torch.float64)) @ q.T
    m = torch.randn(1, 1, 3, dtype=torch.float64)
    one = decompose(torch.zeros(1, 1, 1, dtype=torch.float64), FactorShape(dim=1),
                    method=Method.INVERSE, damping=1.0, packed=True)  # fmt: skip
    # G^-1 = (0 + sqrt(1))^-1 = 1, so only A's lifted inverse acts
    torch.testing.assert_close(precondition(m, so, one), m @ torch.linalg.inv(lifted))
