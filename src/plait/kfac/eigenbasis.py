"""What a layer's gradient becomes, given its decomposed factors: K-FAC, EKFAC or SOAP.

All three share K-FAC's factors, their exchange, placement and decomposition schedule;
they differ only in the rule applied to each layer's gradient matrix ``M``
([groups, g_dim, a_dim]) once the factors are decomposed (`Mode`):

- ``kfac``: ``(G (x) A + gamma)^-1 M``, by inverses or by eigenbases (`factors.precondition`).
- ``ekfac`` (George et al., 2018): the same eigenbasis ``Q_G (x) Q_A``, but the diagonal
  that K-FAC reads off the factors' eigenvalues (``lambda_G lambda_A^T``, exact only when
  the two sides are independent) is re-estimated as the running second moments ``S`` of
  each row's gradient projected on that basis: ``Q_G ((Q_G^T M Q_A) / (S + gamma)) Q_A^T``.
  ``S`` is formed in the factor hooks from the same rows as the factors
  (`KFACLayer.scale_sum`), averaged over workers in the same buckets, and kept as a running
  average with the factors' decay. It starts from K-FAC's eigenvalue products on the first
  basis (so EKFAC's first step is K-FAC's eigen step) and is carried into each new basis.
- ``soap`` (Vyas et al., 2024): Adam in that eigenbasis. The gradient is rotated, Adam's
  first and second moments are kept in the rotated coordinates, and the normalised step
  ``m_hat / (sqrt(v_hat) + eps)`` is rotated back. The step has Adam's scale, so the
  optimizer beside it applies it as it is (SGD without momentum; its weight decay is then
  AdamW's decoupled decay). Parameters outside the preconditioned layers (norms, tied or
  batch-shared embeddings) get plain Adam, as SOAP gives them.

When a basis is refreshed (every inversion interval), state kept in the old basis is
carried into the new one with ``R = Q_new^T Q_old`` per side: a first moment exactly,
``R_G m R_A^T``; a second moment (a diagonal in the old coordinates) as the diagonal of its
rotation, ``(R_G o R_G) v (R_A o R_A)^T`` (o: elementwise), exact when the old coordinates
are uncorrelated and exact for any reordering or sign change of the eigenvectors.

Step-size grafting (`Graft`, the natural-gradient modes only): each layer's step is scaled
to the norm of Adam's normalised gradient ``M / (sqrt(v_hat) + eps)`` in the parameters'
own basis (Distributed Shampoo's Adam grafting: second moment only, momentum left to the
optimizer), so that the preconditioner chooses directions and a tuned Adam schedule the
step length; KL clipping is then off.

A rule's per-layer state lives where the layer is preconditioned (`Assignment.grad_workers`);
every such worker sees the same averaged gradient and the same decompositions, so replicas
agree bit for bit. `layer_state` / `set_layer_state` move it when placement changes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import torch
from torch import nn

from plait.kfac.factors import (
    Method,
    SecondOrder,
    eigenvalue_products,
    from_basis,
    precondition,
    to_basis,
)
from plait.kfac.layers import FactorKind, FactorShape, KFACLayer

#: A layer's decompositions held on this worker (A, G), or None.
Held = Callable[[str], "tuple[SecondOrder, SecondOrder] | None"]


class Mode(StrEnum):
    """The rule applied to a layer's gradient (see the module docstring)."""

    KFAC = "kfac"
    EKFAC = "ekfac"
    SOAP = "soap"

    @property
    def eigenbasis(self) -> bool:
        """Whether the mode needs eigendecompositions (`Method.EIGEN`)."""
        return self is not Mode.KFAC

    @property
    def natural(self) -> bool:
        """A natural-gradient step (K-FAC, EKFAC), which KL clipping bounds."""
        return self is not Mode.SOAP


class Graft(StrEnum):
    """Step-size grafting of the natural-gradient modes."""

    NONE = "none"
    ADAM = "adam"  #: each layer's step gets the norm of Adam's normalised gradient


@dataclass(frozen=True, kw_only=True)
class Moments:
    """Adam's constants: first- and second-moment decays and the denominator's epsilon."""

    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8

    def bias(self, beta: float, t: int) -> float:
        return 1.0 - beta**t


def rotation(new: SecondOrder, old: SecondOrder) -> torch.Tensor | None:
    """``R = Q_new^T Q_old`` per group (None for a diagonal factor: the identity)."""
    if new.basis is None or old.basis is None:
        return None
    return torch.matmul(new.basis.transpose(-1, -2), old.basis)


def rotate_first(m: torch.Tensor, ra: torch.Tensor | None, rg: torch.Tensor | None) -> torch.Tensor:
    """A first moment from the old eigenbasis to the new one: ``R_G m R_A^T`` (exact)."""
    out = m if rg is None else torch.matmul(rg, m)
    return out if ra is None else torch.matmul(out, ra.transpose(-1, -2))


def rotate_second(
    v: torch.Tensor, ra: torch.Tensor | None, rg: torch.Tensor | None
) -> torch.Tensor:
    """A second moment from the old eigenbasis to the new one: the diagonal of the rotated
    diagonal, ``(R_G o R_G) v (R_A o R_A)^T``."""
    return rotate_first(v, None if ra is None else ra.square(), None if rg is None else rg.square())


def _basis_wire(so: SecondOrder) -> torch.Tensor:
    return so.to_wire(packed=False)


def _basis_numel(shape: FactorShape) -> int:
    return shape.dim if shape.diagonal else shape.groups * shape.dim * (shape.dim + 1)


@dataclass
class _Layer:
    """One layer's state: the basis it is expressed in (None: not yet) and its tensors."""

    a: SecondOrder | None = None
    g: SecondOrder | None = None
    t: int = 0
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)


class UpdateRule:
    """K-FAC's rule (`Mode.KFAC`) and the base of the eigenbasis rules.

    Args:
        mode: the mode this rule implements.
        graft: step-size grafting (natural-gradient modes).
        moments: Adam's constants (SOAP's moments, grafting's second moment).
    """

    #: the state tensors each layer keeps, all shaped like its gradient matrix
    names: tuple[str, ...] = ()

    def __init__(self, mode: Mode, *, graft: Graft = Graft.NONE, moments: Moments) -> None:
        self.mode = mode
        self.graft = graft
        self.moments = moments
        self.layers: dict[str, _Layer] = {}
        if graft is Graft.ADAM:
            self.names = (*self.names, "graft_v")

    @property
    def clips(self) -> bool:
        """Whether the step is KL-clipped (a natural-gradient step not grafted)."""
        return self.mode.natural and self.graft is Graft.NONE

    # ------------------------------------------------------------------ per step
    def refresh(self, name: str, a: SecondOrder, g: SecondOrder) -> None:
        """The layer's decompositions in force now: carry its state into a new basis."""
        st = self.layers.setdefault(name, _Layer())
        if st.a is a and st.g is g:
            return
        if self.mode.eigenbasis and st.a is not None and st.g is not None:
            ra, rg = rotation(a, st.a), rotation(g, st.g)
            self._rotate(name, st, ra, rg)
        elif self.mode.eigenbasis:
            self._first_basis(name, st, a, g)
        st.a, st.g = a, g

    def _rotate(self, name: str, st: _Layer, ra: torch.Tensor | None,
                rg: torch.Tensor | None) -> None:  # fmt: skip
        if "m" in st.tensors:
            st.tensors["m"] = rotate_first(st.tensors["m"], ra, rg)
        if "v" in st.tensors:
            st.tensors["v"] = rotate_second(st.tensors["v"], ra, rg)

    def _first_basis(self, name: str, st: _Layer, a: SecondOrder, g: SecondOrder) -> None:
        """Called when the layer gets its first basis."""

    def direction(
        self, name: str, grad: torch.Tensor, a: SecondOrder, g: SecondOrder, *,
        damping: float, update: bool = True,
    ) -> torch.Tensor:  # fmt: skip
        """The layer's new gradient; `update` False leaves every state as it was."""
        out = self._direction(name, grad, a, g, damping=damping, update=update)
        if self.graft is Graft.ADAM:
            out = self._grafted(name, out, grad, update=update)
        return out

    def _direction(
        self, name: str, grad: torch.Tensor, a: SecondOrder, g: SecondOrder, *,
        damping: float, update: bool,
    ) -> torch.Tensor:  # fmt: skip
        return precondition(grad, a, g)

    def _grafted(
        self, name: str, out: torch.Tensor, grad: torch.Tensor, *, update: bool
    ) -> torch.Tensor:
        st = self.layers.setdefault(name, _Layer())
        mo = self.moments
        v = st.tensors.get("graft_v")
        sq = grad.square() * (1.0 - mo.beta2)
        v = sq if v is None else v * mo.beta2 + sq
        steps = st.t + 1
        if update:
            st.t, st.tensors["graft_v"] = steps, v
        adam = grad / ((v / mo.bias(mo.beta2, steps)).sqrt() + mo.eps)
        norm = out.norm()
        scale = torch.where(norm > 0, adam.norm() / norm.clamp(min=torch.finfo(out.dtype).tiny),
                            torch.zeros_like(norm))  # fmt: skip
        return out * scale

    def rest(self, params: Sequence[nn.Parameter], *, update: bool = True) -> None:
        """Parameters outside the preconditioned layers (SOAP: plain Adam; else untouched)."""

    # ------------------------------------------------------------------ state
    def layer_numel(self, layer: KFACLayer) -> int:
        """Elements of one layer's packed state (`layer_state`), the same on every rank."""
        n = 2 + len(self.names) * layer.shape(FactorKind.S).dense_numel
        if self.mode.eigenbasis and self.names:
            n += _basis_numel(layer.a_shape) + _basis_numel(layer.g_shape)
        return n

    def layer_state(self, layer: KFACLayer) -> torch.Tensor:
        """One layer's state, flat: present flag, step count, tensors, basis (zeros if absent)."""
        st = self.layers.get(layer.name)
        out = torch.zeros(self.layer_numel(layer), dtype=torch.float64)
        if st is None or not all(k in st.tensors for k in self.names) or not self.names:
            return out
        parts = [torch.tensor([1.0, float(st.t)], dtype=torch.float64)]
        parts += [st.tensors[k].reshape(-1).double() for k in self.names]
        if self.mode.eigenbasis:
            if st.a is None or st.g is None:
                return out
            parts += [_basis_wire(st.a).double(), _basis_wire(st.g).double()]
        flat = torch.cat(parts)
        out[: flat.numel()] = flat
        return out

    def set_layer_state(self, layer: KFACLayer, flat: torch.Tensor, dtype: torch.dtype) -> None:
        """Install `layer_state` output (from the worker that held the layer)."""
        if not self.names or float(flat[0]) == 0.0:
            self.layers.pop(layer.name, None)
            return
        st = _Layer(t=int(flat[1]))
        n = layer.shape(FactorKind.S).dense_numel
        shape = (layer.g_shape.groups, layer.g_shape.dim, layer.a_shape.dim)
        pos = 2
        for k in self.names:
            st.tensors[k] = flat[pos : pos + n].to(dtype).reshape(shape).clone()
            pos += n
        if self.mode.eigenbasis:
            sides = []
            for shape_ in (layer.a_shape, layer.g_shape):
                m = _basis_numel(shape_)
                sides.append(SecondOrder.from_wire(flat[pos : pos + m].to(dtype).clone(),
                                                   method=Method.EIGEN, shape=shape_,
                                                   damping=0.0, packed=False))  # fmt: skip
                pos += m
            st.a, st.g = sides
        self.layers[layer.name] = st

    def state_dict(self) -> dict[str, Any]:
        return {
            name: {
                "t": st.t,
                "tensors": dict(st.tensors),
                "a": None if st.a is None else st.a.state(),
                "g": None if st.g is None else st.g.state(),
            }
            for name, st in self.layers.items()
        }

    def load_state_dict(self, state: dict[str, Any], *, layers: dict[str, KFACLayer],
                        held: Held) -> None:  # fmt: skip
        """Restore `state_dict` output. A layer's basis is re-linked to the decompositions
        `held` returns when they are the saved ones, so that a resumed run does not rotate
        its state by a rounding of the identity (and resumes bit for bit)."""
        self.layers.clear()
        for name, d in state.items():
            st = _Layer(t=int(d["t"]), tensors=dict(d["tensors"]))
            if d["a"] is not None and d["g"] is not None and name in layers:
                now = held(name)
                if now is not None and _same(now[0], d["a"]) and _same(now[1], d["g"]):
                    st.a, st.g = now
                else:
                    layer = layers[name]
                    st.a = _restore(d["a"], layer.a_shape)
                    st.g = _restore(d["g"], layer.g_shape)
            self.layers[name] = st


def _same(so: SecondOrder, saved: dict[str, Any]) -> bool:
    for key in ("basis", "values", "inverse", "chol"):
        x, y = getattr(so, key), saved[key]
        if (x is None) != (y is None) or (x is not None and not torch.equal(x, y)):
            return False
    return True


def _restore(saved: dict[str, Any], shape: FactorShape) -> SecondOrder:
    return SecondOrder(method=Method(saved["method"]), shape=shape, damping=float(saved["damping"]),
                       chol=saved["chol"], inverse=saved["inverse"], basis=saved["basis"],
                       values=saved["values"])  # fmt: skip


class EKFACRule(UpdateRule):
    """EKFAC: K-FAC's eigenbasis, the diagonal re-estimated (see the module docstring).

    Args:
        scale_of: the running average of a layer's statistic ``S`` as a [groups, g, a] view
            into the factor pipeline (rotated in place when the basis changes, so the
            hooks keep accumulating in the basis they project on).
    """

    def __init__(self, *, scale_of: Callable[[str], torch.Tensor], graft: Graft,
                 moments: Moments) -> None:  # fmt: skip
        super().__init__(Mode.EKFAC, graft=graft, moments=moments)
        self.scale_of = scale_of
        self.snapshot: dict[str, torch.Tensor] = {}

    def _first_basis(self, name: str, st: _Layer, a: SecondOrder, g: SecondOrder) -> None:
        running = self.scale_of(name)
        running.copy_(eigenvalue_products(a, g).reshape(running.shape))
        self.snapshot[name] = running.clone()

    def _rotate(self, name: str, st: _Layer, ra: torch.Tensor | None,
                rg: torch.Tensor | None) -> None:  # fmt: skip
        running = self.scale_of(name)
        running.copy_(rotate_second(running, ra, rg))
        self.snapshot[name] = running.clone()

    def take_scale(self, name: str) -> None:
        """The running ``S`` was just averaged over workers: precondition with it from now."""
        self.snapshot[name] = self.scale_of(name).clone()

    def basis(self, name: str) -> tuple[SecondOrder, SecondOrder] | None:
        """The basis the hooks project on (the one ``S`` is kept in), or None before any."""
        st = self.layers.get(name)
        if st is None or st.a is None or st.g is None:
            return None
        return st.a, st.g

    def _direction(
        self, name: str, grad: torch.Tensor, a: SecondOrder, g: SecondOrder, *,
        damping: float, update: bool,
    ) -> torch.Tensor:  # fmt: skip
        scale = self.snapshot[name].view_as(grad)
        return from_basis(to_basis(grad, a, g) / (scale + damping), a, g)

    def state_dict(self) -> dict[str, Any]:
        return {"layers": super().state_dict(), "snapshot": dict(self.snapshot)}

    def load_state_dict(self, state: dict[str, Any], *, layers: dict[str, KFACLayer],
                        held: Held) -> None:  # fmt: skip
        super().load_state_dict(state.get("layers", {}), layers=layers, held=held)
        self.snapshot = dict(state.get("snapshot", {}))


class SOAPRule(UpdateRule):
    """Adam in K-FAC's eigenbasis, Adam on the other parameters (see the module docstring)."""

    names = ("m", "v")

    def __init__(self, *, moments: Moments, rest_scale: float = 1.0) -> None:
        super().__init__(Mode.SOAP, moments=moments)
        self.rest_scale = rest_scale
        self.rest_state: dict[int, dict[str, Any]] = {}

    def _direction(
        self, name: str, grad: torch.Tensor, a: SecondOrder, g: SecondOrder, *,
        damping: float, update: bool,
    ) -> torch.Tensor:  # fmt: skip
        st = self.layers.setdefault(name, _Layer())
        step = st.t + 1
        (m,), (v,) = _adam([st.tensors], [to_basis(grad, a, g)], self.moments)
        if update:
            st.t, st.tensors["m"], st.tensors["v"] = step, m, v
        (out,) = _normalised([m], [v], step, self.moments)
        return from_basis(out, a, g)

    def rest(self, params: Sequence[nn.Parameter], *, update: bool = True) -> None:
        """Adam on the parameters outside the layers, all of one step count at once.

        A model's norms and biases are many small tensors (the digits CNN's twelve batch
        norm vectors): per tensor, Adam's dozen operators cost more than their arithmetic,
        so the tensors that share a step count go through torch's multi-tensor operators.
        """
        by_t: dict[int, list[tuple[int, torch.Tensor]]] = {}
        for i, p in enumerate(params):
            if p.grad is not None:
                st = self.rest_state.setdefault(i, {"t": 0, "tensors": {}})
                by_t.setdefault(int(st["t"]), []).append((i, p.grad))
        for t, items in by_t.items():
            states = [self.rest_state[i]["tensors"] for i, _ in items]
            grads = [g for _, g in items]
            ms, vs = _adam(states, grads, self.moments)
            if update:
                for (i, _), m, v in zip(items, ms, vs, strict=True):
                    self.rest_state[i] = {"t": t + 1, "tensors": {"m": m, "v": v}}
            out = _normalised(ms, vs, t + 1, self.moments, scale=self.rest_scale)
            torch._foreach_copy_(grads, out)

    def state_dict(self) -> dict[str, Any]:
        return {"layers": super().state_dict(), "rest": self.rest_state}

    def load_state_dict(self, state: dict[str, Any], *, layers: dict[str, KFACLayer],
                        held: Held) -> None:  # fmt: skip
        super().load_state_dict(state.get("layers", {}), layers=layers, held=held)
        self.rest_state = {int(k): v for k, v in state.get("rest", {}).items()}


def _adam(
    held: list[dict[str, torch.Tensor]], grads: list[torch.Tensor], mo: Moments
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """One step of Adam's moments from the `held` ones (none before the first), on torch's
    multi-tensor operators. Returns new tensors; `held` is not changed."""
    if any("m" not in h or "v" not in h for h in held):
        ms = torch._foreach_mul(grads, 1.0 - mo.beta1)
        vs = torch._foreach_mul(grads, grads)
        torch._foreach_mul_(vs, 1.0 - mo.beta2)
        return list(ms), list(vs)
    ms = torch._foreach_lerp([h["m"] for h in held], grads, 1.0 - mo.beta1)
    vs = torch._foreach_mul([h["v"] for h in held], mo.beta2)
    torch._foreach_addcmul_(vs, grads, grads, value=1.0 - mo.beta2)
    return list(ms), list(vs)


def _normalised(
    ms: list[torch.Tensor], vs: list[torch.Tensor], t: int, mo: Moments, *, scale: float = 1.0
) -> list[torch.Tensor]:
    """``m_hat / (sqrt(v_hat) + eps)`` times `scale` for tensors of step count `t`, in four
    operators: with ``c1, c2`` the bias corrections, ``m / (sqrt(v) + eps sqrt(c2))`` times
    ``sqrt(c2) / c1``."""
    c1, root2 = mo.bias(mo.beta1, t), mo.bias(mo.beta2, t) ** 0.5
    den = torch._foreach_sqrt(vs)
    torch._foreach_add_(den, mo.eps * root2)
    out = torch._foreach_div(ms, den)
    torch._foreach_mul_(out, root2 / c1 * scale)
    return list(out)


def make_rule(
    mode: Mode,
    *,
    graft: Graft,
    moments: Moments,
    scale_of: Callable[[str], torch.Tensor],
    rest_scale: float = 1.0,
) -> UpdateRule:
    """The rule of `mode` (`scale_of`: EKFAC's running statistic per layer; `rest_scale`:
    SOAP's step on the parameters outside the layers, a multiple of the rate)."""
    if mode is Mode.EKFAC:
        return EKFACRule(scale_of=scale_of, graft=graft, moments=moments)
    if mode is Mode.SOAP:
        return SOAPRule(moments=moments, rest_scale=rest_scale)
    return UpdateRule(Mode.KFAC, graft=graft, moments=moments)
