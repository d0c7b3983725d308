"""Second-order math on Kronecker factors: packing, damped inverses and eigenbases, clipping.

Factors are symmetric, so their upper triangles carry all their information: on the wire
they travel packed (half the bytes), and the decompositions read only the upper triangle
(LAPACK's ``uplo='U'``), so a received factor is never mirrored before it is inverted.

Damping is Tikhonov. The eigen method applies it exactly, ``(G (x) A + gamma I)^-1``, from
the two eigenbases. The inverse method inverts each factor on its own and so splits it as
factored Tikhonov damping (Martens & Grosse, with pi = 1): ``(A + sqrt(gamma) I)^-1`` and
``(G + sqrt(gamma) I)^-1``, which keeps the gamma term of the exact product.

The inverse method holds each damped factor in one of two forms (`InverseForm`). The
Cholesky form keeps the upper factor ``U`` and applies ``(U^T U)^-1`` by two triangular
solves: the decomposition takes less than half the time of Cholesky followed by inversion
(0.66 s against 1.52 s for ResNet-18's 4608 and 512 factors on one core,
benchmarks/kfac/kernels-resnet18), but triangular solves run slower than a product with the
inverse (1.2x at that size, 2.2x for the GPT's 384 and 385 factors). The explicit form pays the
inversion once and the cheaper products on every use. Which is cheaper depends on how
often a decomposition is used, so `KFAC` picks per factor (see `InverseForm.AUTO`).
"""

from __future__ import annotations

import functools
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


class InverseForm(StrEnum):
    """How the inverse method holds a damped factor."""

    CHOLESKY = "cholesky"  # the triangular factor, applied by solves: cheapest to make
    EXPLICIT = "explicit"  # the inverse, applied by products: cheapest to use
    AUTO = "auto"  # per factor: Cholesky unless its uses outweigh the inversion it saves


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
        """A matrix whose upper triangle is the factor (all the decompositions read); a
        rectangular statistic as [groups, dim, cols], a view of `flat`."""
        if shape.diagonal:
            return flat
        if shape.cols is not None:
            return flat.view(shape.groups, shape.dim, shape.cols)
        if self.packed:
            return unpack(flat, shape, mirror=False)
        return flat.view(shape.groups, shape.dim, shape.dim)

    def full(self, flat: torch.Tensor, shape: FactorShape) -> torch.Tensor:
        """A symmetric matrix (mirrored from its upper triangle when packed)."""
        if shape.diagonal or not self.packed or shape.cols is not None:
            return self.upper(flat, shape)
        return unpack(flat, shape)


# ------------------------------------------------------------------- second order
@dataclass(kw_only=True)
class SecondOrder:
    """A decomposed factor. INVERSE: `chol`, the upper Cholesky factor of the damped factor,
    or `inverse`, its inverse. EIGEN: `basis` and `values`.

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

    @property
    def explicit(self) -> bool:
        return self.method is Method.INVERSE and self.chol is None

    def to_wire(self, *, packed: bool) -> torch.Tensor:
        """One flat tensor to broadcast (both forms pack without loss: a Cholesky factor is
        zero below the diagonal, an inverse exactly symmetric)."""
        if self.method is Method.INVERSE:
            held = self.chol if self.chol is not None else self.inverse
            assert held is not None
            return (
                held if self.shape.diagonal else WireLayout(packed=packed).to_wire(held, self.shape)
            )
        assert self.values is not None
        if self.shape.diagonal:
            return self.values
        assert self.basis is not None
        return torch.cat([self.basis.reshape(-1), self.values.reshape(-1)])

    @classmethod
    def from_wire(
        cls, flat: torch.Tensor, *, method: Method, shape: FactorShape, damping: float,
        packed: bool, explicit: bool = False,
    ) -> SecondOrder:  # fmt: skip
        if method is Method.INVERSE:
            if shape.diagonal or explicit:
                inv = WireLayout(packed=packed).full(flat, shape)
                return cls(method=method, shape=shape, damping=damping, inverse=inv)
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


@functools.lru_cache(maxsize=256)
def _upper_mask(n: int, device: torch.device) -> torch.Tensor:
    """[n, n], True on and above the diagonal."""
    return torch.ones(n, n, dtype=torch.bool, device=device).triu()


def decompose(
    upper: torch.Tensor, shape: FactorShape, *, method: Method, damping: float, packed: bool,
    explicit: bool = False,
) -> SecondOrder:  # fmt: skip
    """Decompose a factor given by its upper triangle (or its diagonal).

    Args:
        upper: [groups, n, n] whose upper triangle holds the factor, or [n] for a diagonal.
        shape: the factor's shape.
        method: inverse or eigen.
        damping: Tikhonov gamma (> 0).
        packed: the result will travel packed. An explicit inverse is then made exactly
            symmetric from its upper triangle here, so that its owner and every receiver
            hold the same bits and replicas never drift apart (a Cholesky factor, zero below
            its diagonal, arrives as it is).
        explicit: the inverse method's explicit form instead of the Cholesky form.
    """
    if method is Method.INVERSE:
        root = math.sqrt(damping)
        if shape.diagonal:
            return SecondOrder(method=method, shape=shape, damping=damping,
                               inverse=1.0 / (upper.clamp(min=0) + root))  # fmt: skip
        eye = torch.eye(shape.dim, dtype=upper.dtype, device=upper.device)
        damped = torch.add(upper, eye, alpha=root)
        # The lower factor of the transposed (lower-stored) matrix comes back column-major,
        # so its transpose is the upper factor row-major: what receivers unpack, and the
        # solves must see the same layout as well as the same values to give the same bits.
        low, info = torch.linalg.cholesky_ex(damped.transpose(-1, -2), upper=False)
        if bool(info.any()):  # rounding left it indefinite: lift its spectrum to >= root
            vals, vecs = torch.linalg.eigh(damped, UPLO="U")
            lifted = (vecs * vals.clamp(min=root).unsqueeze(-2)).matmul(vecs.transpose(-1, -2))
            low = torch.linalg.cholesky(lifted)
        chol = low.transpose(-1, -2).contiguous()  # a no-op unless the fallback ran
        if not explicit:
            return SecondOrder(method=method, shape=shape, damping=damping, chol=chol)
        inv = torch.cholesky_inverse(chol, upper=True)
        # as received: mirrored from the packed triangle (the same bits as unpacking its
        # packed form, in one operator), or row-major
        if packed:
            inv = torch.where(_upper_mask(shape.dim, inv.device), inv, inv.mT)
        else:
            inv = inv.contiguous()
        return SecondOrder(method=method, shape=shape, damping=damping, inverse=inv)
    if shape.diagonal:
        return SecondOrder(method=method, shape=shape, damping=damping,
                           values=upper.clamp(min=0))  # fmt: skip
    vals, vecs = torch.linalg.eigh(upper, UPLO="U")
    # row-major like a received basis: the products must see the same layout on every rank
    return SecondOrder(method=method, shape=shape, damping=damping, basis=vecs.contiguous(),
                       values=vals.clamp(min=0))  # fmt: skip


def to_basis(m: torch.Tensor, a: SecondOrder, g: SecondOrder) -> torch.Tensor:
    """``Q_G^T M Q_A``: a [groups, g_dim, a_dim] matrix in the layer's Kronecker eigenbasis
    (a diagonal A's basis is the identity)."""
    assert g.basis is not None
    v = torch.matmul(g.basis.transpose(-1, -2), m)
    return v if a.basis is None else torch.matmul(v, a.basis)


def from_basis(v: torch.Tensor, a: SecondOrder, g: SecondOrder) -> torch.Tensor:
    """``Q_G V Q_A^T``: the inverse of `to_basis` (the bases are orthogonal)."""
    assert g.basis is not None
    m = torch.matmul(g.basis, v)
    return m if a.basis is None else torch.matmul(m, a.basis.transpose(-1, -2))


def eigenvalue_products(a: SecondOrder, g: SecondOrder) -> torch.Tensor:
    """``lambda_G lambda_A^T`` [groups, g_dim, a_dim]: the Kronecker product's eigenvalues,
    which K-FAC's eigen method divides by (and EKFAC starts from)."""
    assert a.values is not None and g.values is not None
    a_vals = a.values if a.shape.diagonal else a.values.unsqueeze(-2)
    return g.values.unsqueeze(-1) * a_vals


def precondition(grad: torch.Tensor, a: SecondOrder, g: SecondOrder) -> torch.Tensor:
    """``(G (x) A)^-1`` applied to a [groups, g_dim, a_dim] gradient matrix."""
    if a.method is Method.INVERSE:
        # G^-1 M = U^-1 (U^-T M) and M A^-1 = (M U^-1) U^-T, with U^T U the damped factor
        out: torch.Tensor
        if g.chol is not None:
            out = torch.linalg.solve_triangular(g.chol.transpose(-1, -2), grad, upper=False)
            out = torch.linalg.solve_triangular(g.chol, out, upper=True)
        else:
            assert g.inverse is not None
            out = torch.matmul(g.inverse, grad)
        if a.chol is not None:
            out = torch.linalg.solve_triangular(a.chol, out, upper=True, left=False)
            return torch.linalg.solve_triangular(  # type: ignore[no-any-return]
                a.chol.transpose(-1, -2), out, upper=False, left=False
            )
        assert a.inverse is not None
        return out * a.inverse if a.shape.diagonal else torch.matmul(out, a.inverse)
    return from_basis(to_basis(grad, a, g) / (eigenvalue_products(a, g) + a.damping), a, g)


def explicit_form(form: InverseForm, method: Method, *, dim: int, partner: int, uses: int) -> bool:
    """Whether the inverse method keeps a factor of side `dim` as an explicit inverse.

    AUTO weighs one worker's work between two inversions: the Cholesky form saves an
    explicit inversion (~n^3) and costs slower solves (~n^2 m more, m the `partner` side)
    at every one of the `uses` steps until the next inversion. The two forms round
    differently, so the rule reads the model and the settings only, never the placement:
    placement follows measured timings, and a job must train to the same bits whatever it
    measured (alone or co-located, first run or resumed).
    """
    if form is not InverseForm.AUTO or method is not Method.INVERSE:
        return form is InverseForm.EXPLICIT
    return uses * partner >= EXPLICIT_PAYOFF * dim


#: An explicit inverse of side n pays once ``uses * m >= EXPLICIT_PAYOFF * n`` (m: the partner
#: side it is multiplied with). From the per-layer kernel tables on one core
#: (benchmarks/kfac/kernels-*, A and G timed together), the break-even ratio is 0.4-0.8 for
#: ResNet-18's layers up to 1152 wide, about 1 for the GPT's, and 1-2 for ResNet-18's
#: 2304-4608 wide ones. 0.7 fits the narrow layers and leans to the explicit form for the
#: widest: a 4608 factor reused 7 to 18 times gets the explicit form although the Cholesky
#: one would be cheaper (by up to about 15% of the decompositions and solves).
EXPLICIT_PAYOFF = 0.7


def kl_clip_scale(
    pairs: list[tuple[torch.Tensor, torch.Tensor]], *, lr: float, kl_clip: float
) -> torch.Tensor:
    """``min(1, sqrt(kl_clip / |lr^2 sum <P, M>|))`` as a 0-d tensor, with no host sync.

    One reduction over all layers replaces the per-layer ``.item()`` calls that would stall
    the host once per layer; the scale stays on the device and multiplies the gradients.
    """
    if not pairs:
        return torch.ones(())
    # the sum in three operators for any number of layers (on small models their count,
    # not their size, is the cost: a dot per layer made it nine on the digits CNN)
    products = torch._foreach_mul([p for p, _ in pairs], [m for _, m in pairs])
    vg = torch.cat([x.reshape(-1) for x in products]).sum()
    # vg = 0 gives rsqrt(0) = inf, clamped to 1: no step to clip, and no branch
    return (vg.abs() * (lr * lr / kl_clip)).rsqrt().clamp(max=1.0)
