"""Second-order math on Kronecker factors: packing, damped inverses and eigenbases, clipping.

Factors are symmetric, so their upper triangles carry all their information: on the wire
they travel packed (half the bytes), and the decompositions read only the upper triangle
(LAPACK's ``uplo='U'``), so a received factor is never mirrored before it is inverted.

Damping is Tikhonov. The eigen method applies it exactly, ``(G (x) A + gamma I)^-1``, from
the two eigenbases. The inverse method inverts each factor on its own and so splits it as
factored Tikhonov damping (Martens & Grosse, with pi = 1): ``(A + sqrt(gamma) I)^-1`` and
``(G + sqrt(gamma) I)^-1``, which keeps the gamma term of the exact product.

The inverse method never forms an inverse. It keeps the upper Cholesky factor ``U`` of each
damped factor and applies ``(U^T U)^-1`` by two triangular solves: the solves cost the
same flops as a product with the inverse, while the decomposition is a third of the work
of Cholesky followed by inversion (measured 0.54 s against 1.39 s for a 4608 x 4608
factor on one core), and ``U`` is triangular, so it travels packed as it is.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum

import torch

from plait.kfac import triangle
from plait.kfac.layers import FactorShape


class Method(StrEnum):
    """How factors are turned into a preconditioner."""

    INVERSE = "inverse"  # Cholesky factor of each damped factor: ~n^3 / 3, applied by solves
    EIGEN = "eigen"  # symmetric eigendecomposition: exact Tikhonov damping, ~10x slower


# ------------------------------------------------------------------------- packing
def pack(factor: torch.Tensor, shape: FactorShape) -> torch.Tensor:
    """Upper triangles of a [groups, n, n] factor, flat (a diagonal stays as it is)."""
    if shape.diagonal:
        return factor.reshape(-1)
    return triangle.pack(factor.view(shape.groups, shape.dim, shape.dim))


def unpack(flat: torch.Tensor, shape: FactorShape, *, mirror: bool = True) -> torch.Tensor:
    """Inverse of `pack`: a [groups, n, n] matrix (without `mirror`, zero below the diagonal)."""
    if shape.diagonal:
        return flat
    return triangle.unpack(flat, shape.dim, shape.groups, mirror=mirror)


@dataclass(frozen=True, kw_only=True)
class WireLayout:
    """How factors are laid out in communication buffers: packed triangles or dense."""

    packed: bool

    def numel(self, shape: FactorShape) -> int:
        return shape.packed_numel if self.packed else shape.dense_numel

    def to_wire(self, factor: torch.Tensor, shape: FactorShape) -> torch.Tensor:
        return pack(factor, shape) if self.packed else factor.reshape(-1)

    def upper(self, flat: torch.Tensor, shape: FactorShape) -> torch.Tensor:
        """A matrix whose upper triangle is the factor (all the decompositions read)."""
        if shape.diagonal:
            return flat
        if self.packed:
            return unpack(flat, shape, mirror=False)
        return flat.view(shape.groups, shape.dim, shape.dim)


# ------------------------------------------------------------------- second order
@dataclass(kw_only=True)
class SecondOrder:
    """A decomposed factor. INVERSE: `chol`, the upper Cholesky factor of the damped factor.
    EIGEN: `basis` and `values`.

    A diagonal factor keeps vectors: `inverse` is 1/(a + sqrt(gamma)), `values` is a and
    `basis` is None (the identity).
    """

    method: Method
    shape: FactorShape
    damping: float
    chol: torch.Tensor | None = None
    inverse: torch.Tensor | None = None
    basis: torch.Tensor | None = None
    values: torch.Tensor | None = None

    def wire_numel(self, *, packed: bool) -> int:
        return second_order_numel(self.method, self.shape, packed=packed)

    def to_wire(self, *, packed: bool) -> torch.Tensor:
        """One flat tensor to broadcast (a Cholesky factor packs without loss: it is zero
        below the diagonal)."""
        if self.method is Method.INVERSE:
            if self.shape.diagonal:
                assert self.inverse is not None
                return self.inverse
            assert self.chol is not None
            return WireLayout(packed=packed).to_wire(self.chol, self.shape)
        assert self.values is not None
        if self.shape.diagonal:
            return self.values
        assert self.basis is not None
        return torch.cat([self.basis.reshape(-1), self.values.reshape(-1)])

    @classmethod
    def from_wire(
        cls, flat: torch.Tensor, *, method: Method, shape: FactorShape, damping: float,
        packed: bool,
    ) -> SecondOrder:  # fmt: skip
        if method is Method.INVERSE:
            if shape.diagonal:
                return cls(method=method, shape=shape, damping=damping, inverse=flat)
            chol = WireLayout(packed=packed).upper(flat, shape)
            return cls(method=method, shape=shape, damping=damping, chol=chol)
        if shape.diagonal:
            return cls(method=method, shape=shape, damping=damping, values=flat)
        n, g = shape.dim, shape.groups
        basis = flat[: g * n * n].view(g, n, n)
        values = flat[g * n * n :].view(g, n)
        return cls(method=method, shape=shape, damping=damping, basis=basis, values=values)

    def state(self) -> dict[str, object]:
        return {
            "method": str(self.method),
            "damping": self.damping,
            "chol": self.chol,
            "inverse": self.inverse,
            "basis": self.basis,
            "values": self.values,
        }


def second_order_numel(method: Method, shape: FactorShape, *, packed: bool) -> int:
    if method is Method.INVERSE:
        return WireLayout(packed=packed).numel(shape)
    if shape.diagonal:
        return shape.dim
    return shape.groups * shape.dim * (shape.dim + 1)


def decompose(
    upper: torch.Tensor, shape: FactorShape, *, method: Method, damping: float, packed: bool
) -> SecondOrder:
    """Decompose a factor given by its upper triangle (or its diagonal).

    Args:
        upper: [groups, n, n] whose upper triangle holds the factor, or [n] for a diagonal.
        shape: the factor's shape.
        method: inverse or eigen.
        damping: Tikhonov gamma (> 0).
        packed: the result will travel packed (a Cholesky factor, zero below its diagonal,
            arrives with the same bits as its owner holds, so replicas never drift apart).
    """
    if method is Method.INVERSE:
        root = math.sqrt(damping)
        if shape.diagonal:
            return SecondOrder(method=method, shape=shape, damping=damping,
                               inverse=1.0 / (upper.clamp(min=0) + root))  # fmt: skip
        eye = torch.eye(shape.dim, dtype=upper.dtype, device=upper.device)
        damped = upper + root * eye
        chol, info = torch.linalg.cholesky_ex(damped, upper=True)
        if bool((info > 0).any()):  # rounding left it indefinite: lift its spectrum to >= root
            vals, vecs = torch.linalg.eigh(damped, UPLO="U")
            lifted = (vecs * vals.clamp(min=root).unsqueeze(-2)).matmul(vecs.transpose(-1, -2))
            chol = torch.linalg.cholesky(lifted, upper=True)
        # LAPACK hands back column-major memory; receivers unpack row-major, and the solves
        # must see the same layout as well as the same values to give the same bits
        return SecondOrder(method=method, shape=shape, damping=damping, chol=chol.contiguous())
    if shape.diagonal:
        return SecondOrder(method=method, shape=shape, damping=damping,
                           values=upper.clamp(min=0))  # fmt: skip
    vals, vecs = torch.linalg.eigh(upper, UPLO="U")
    return SecondOrder(method=method, shape=shape, damping=damping, basis=vecs,
                       values=vals.clamp(min=0))  # fmt: skip


def precondition(grad: torch.Tensor, a: SecondOrder, g: SecondOrder) -> torch.Tensor:
    """``(G (x) A)^-1`` applied to a [groups, g_dim, a_dim] gradient matrix."""
    if a.method is Method.INVERSE:
        assert g.chol is not None
        # G^-1 M = U^-1 (U^-T M) and M A^-1 = (M U^-1) U^-T, with U^T U the damped factor
        ug = g.chol
        out: torch.Tensor = torch.linalg.solve_triangular(ug.transpose(-1, -2), grad, upper=False)
        out = torch.linalg.solve_triangular(ug, out, upper=True)
        if a.shape.diagonal:
            assert a.inverse is not None
            return out * a.inverse
        assert a.chol is not None
        ua = a.chol
        out = torch.linalg.solve_triangular(ua, out, upper=True, left=False)
        out = torch.linalg.solve_triangular(ua.transpose(-1, -2), out, upper=False, left=False)
        return out
    assert a.values is not None and g.values is not None and g.basis is not None
    v = torch.matmul(g.basis.transpose(-1, -2), grad)
    if a.basis is not None:
        v = torch.matmul(v, a.basis)
    a_vals = a.values if a.shape.diagonal else a.values.unsqueeze(-2)
    v = v / (g.values.unsqueeze(-1) * a_vals + a.damping)
    v = torch.matmul(g.basis, v)
    if a.basis is not None:
        v = torch.matmul(v, a.basis.transpose(-1, -2))
    return v


def kl_clip_scale(
    pairs: list[tuple[torch.Tensor, torch.Tensor]], *, lr: float, kl_clip: float
) -> torch.Tensor:
    """``min(1, sqrt(kl_clip / |lr^2 sum <P, M>|))`` as a 0-d tensor, with no host sync.

    One reduction over all layers replaces the per-layer ``.item()`` calls that would stall
    the host once per layer; the scale stays on the device and multiplies the gradients.
    """
    if not pairs:
        return torch.ones(())
    vg = torch.stack([(p * m).sum() for p, m in pairs]).sum().abs() * (lr * lr)
    scale = torch.sqrt(kl_clip / vg.clamp(min=torch.finfo(vg.dtype).tiny)).clamp(max=1.0)
    return torch.where(vg > 0, scale, torch.ones_like(scale))
