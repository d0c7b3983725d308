"""An independent single-process K-FAC for parity tests, written for clarity, not speed.

Factors come straight from the full batch's layer inputs and output gradients, and the
preconditioned gradient is a linear solve with the explicit Kronecker product
``(G (x) A + damping)``, so it shares no code path with `plait.kfac` beyond stock torch
ops (unfold for convolution patches).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class RefConfig:
    damping: float = 0.01
    factor_decay: float = 0.9
    kl_clip: float | None = 0.01
    lr: float = 0.1
    inv_interval: int = 1
    factor_interval: int = 1
    method: str = "inverse"
    approximation: str = "expand"


def _patches(conv: nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
    """[groups, B*L, C/g*kh*kw] patches as the convolution sees them."""
    if any(conv._reversed_padding_repeated_twice):
        mode = "constant" if conv.padding_mode == "zeros" else conv.padding_mode
        x = F.pad(x, conv._reversed_padding_repeated_twice, mode=mode)
    cols = F.unfold(x, conv.kernel_size, dilation=conv.dilation, stride=conv.stride)
    b, _, length = cols.shape
    g = conv.groups
    cols = cols.view(b, g, -1, length).permute(1, 0, 3, 2).reshape(g, b * length, -1)
    if conv.bias is not None:
        cols = torch.cat([cols, cols.new_ones(*cols.shape[:-1], 1)], dim=-1)
    return cols


def _rows(module: nn.Module, x: torch.Tensor, gout: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(a rows [g, N, a], g rows [g, N, c]) with output gradients times the batch size."""
    batch = x.shape[0]
    if isinstance(module, nn.Conv2d):
        a = _patches(module, x)
        g = gout.permute(0, 2, 3, 1).reshape(-1, gout.shape[1])
        g = g.reshape(g.shape[0], module.groups, -1).transpose(0, 1)
        return a, g * batch
    if isinstance(module, nn.Embedding):
        a = F.one_hot(x.reshape(-1), module.num_embeddings).to(gout.dtype).unsqueeze(0)
        return a, (gout.reshape(-1, gout.shape[-1]) * batch).unsqueeze(0)
    assert isinstance(module, nn.Linear)
    a = x.reshape(-1, x.shape[-1])
    if module.bias is not None:
        a = torch.cat([a, a.new_ones(a.shape[0], 1)], dim=1)
    return a.unsqueeze(0), (gout.reshape(-1, gout.shape[-1]) * batch).unsqueeze(0)


def _grad_matrix(module: nn.Module) -> torch.Tensor:
    w = module.weight.grad
    assert w is not None
    if isinstance(module, nn.Embedding):
        return w.t().unsqueeze(0)
    g = getattr(module, "groups", 1)
    m = w.reshape(g, w.shape[0] // g, -1)
    if getattr(module, "bias", None) is not None:
        m = torch.cat([m, module.bias.grad.reshape(g, -1, 1)], dim=2)
    return m


def _set_grad(module: nn.Module, m: torch.Tensor) -> None:
    w = module.weight
    if isinstance(module, nn.Embedding):
        w.grad = m[0].t().clone()
        return
    if getattr(module, "bias", None) is not None:
        module.bias.grad = m[:, :, -1].reshape(-1).clone()
        m = m[:, :, :-1]
    w.grad = m.reshape(w.shape).clone()


def _solve(a: torch.Tensor, g: torch.Tensor, m: torch.Tensor, cfg: RefConfig) -> torch.Tensor:
    """Preconditioned gradient of one group, by an explicit Kronecker solve."""
    na, ng = a.shape[0], g.shape[0]
    if cfg.method == "inverse":
        r = math.sqrt(cfg.damping)
        big = torch.kron(g + r * torch.eye(ng, dtype=g.dtype), a + r * torch.eye(na, dtype=a.dtype))
    else:
        big = torch.kron(g, a) + cfg.damping * torch.eye(na * ng, dtype=a.dtype)
    return torch.linalg.solve(big, m.reshape(-1)).reshape(ng, na)


class ReferenceKFAC:
    """Single-process K-FAC over every Linear, Conv2d and Embedding of `model`."""

    def __init__(self, model: nn.Module, cfg: RefConfig) -> None:
        self.cfg = cfg
        self.modules = [
            m for m in model.modules() if isinstance(m, (nn.Linear, nn.Conv2d, nn.Embedding))
        ]
        self.inputs: dict[nn.Module, torch.Tensor] = {}
        self.gouts: dict[nn.Module, torch.Tensor] = {}
        self.a: dict[nn.Module, torch.Tensor] = {}
        self.g: dict[nn.Module, torch.Tensor] = {}
        self.a_inv: dict[nn.Module, torch.Tensor] = {}
        self.g_inv: dict[nn.Module, torch.Tensor] = {}
        self.steps = 0
        for m in self.modules:
            m.register_forward_hook(self._fwd)

    def _fwd(self, module: nn.Module, inputs: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
        if not module.training:
            return
        self.inputs[module] = inputs[0].detach()

        def save(grad: torch.Tensor) -> None:
            self.gouts[module] = grad.detach()

        out.register_hook(save)

    def _update_factors(self) -> None:
        cfg = self.cfg
        for m in self.modules:
            a_rows, g_rows = _rows(m, self.inputs[m], self.gouts[m])
            if cfg.approximation == "reduce" and not isinstance(m, nn.Embedding):
                b = self.inputs[m].shape[0]
                a_rows = a_rows.reshape(a_rows.shape[0], b, -1, a_rows.shape[-1]).mean(2)
                g_rows = g_rows.reshape(g_rows.shape[0], b, -1, g_rows.shape[-1]).sum(2)
            a_new = a_rows.transpose(1, 2) @ a_rows / a_rows.shape[1]
            g_new = g_rows.transpose(1, 2) @ g_rows / g_rows.shape[1]
            if m in self.a:
                d = cfg.factor_decay
                self.a[m] = d * self.a[m] + (1 - d) * a_new
                self.g[m] = d * self.g[m] + (1 - d) * g_new
            else:
                self.a[m], self.g[m] = a_new, g_new

    @torch.no_grad()
    def step(self) -> None:
        cfg = self.cfg
        if self.steps % cfg.factor_interval == 0:
            self._update_factors()
        if self.steps % cfg.inv_interval == 0:
            self.a_inv = {m: self.a[m].clone() for m in self.modules}  # decomposed "now"
            self.g_inv = {m: self.g[m].clone() for m in self.modules}
        pairs = []
        for m in self.modules:
            grad = _grad_matrix(m)
            p = torch.stack(
                [_solve(self.a_inv[m][i], self.g_inv[m][i], grad[i], cfg) for i in range(len(grad))]
            )
            pairs.append((m, p, grad))
        scale = 1.0
        if cfg.kl_clip is not None:
            vg = sum(float((p * g).sum()) for _, p, g in pairs) * cfg.lr**2
            scale = min(1.0, math.sqrt(cfg.kl_clip / abs(vg))) if vg != 0 else 1.0
        for m, p, _ in pairs:
            _set_grad(m, p * scale)
        self.steps += 1


@dataclass(frozen=True)
class EigenConfig:
    """The eigenbasis modes' settings (with `RefConfig`'s damping, decay, clip and lr)."""

    mode: str = "ekfac"  # or "soap"
    sync: str = "eager"  # when EKFAC's statistic is taken: every factor step, or every round
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    rest_lr_scale: float = 1.0  # SOAP: the parameters outside the layers' step, x the rate


def _basis(module: nn.Module, factor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Eigenvalues and eigenvectors; an embedding's A is diagonal: its own basis is the
    identity (eigh would pick any basis inside the eigenspaces of tied token counts)."""
    if isinstance(module, nn.Embedding) and factor.shape[0] == module.num_embeddings:
        return torch.diagonal(factor).clamp(min=0), torch.eye(factor.shape[0], dtype=factor.dtype)
    vals, vecs = torch.linalg.eigh(factor)
    return vals.clamp(min=0), vecs.contiguous()


class ReferenceEigenbasis(ReferenceKFAC):
    """EKFAC and SOAP with dense Kronecker bases ``Q = Q_G (x) Q_A`` per group: statistics
    and moments are vectors in that basis, rotated with the dense ``R = Q_new^T Q_old``."""

    def __init__(self, model: nn.Module, cfg: RefConfig, eig: EigenConfig) -> None:
        super().__init__(model, cfg)
        self.eig = eig
        self.q: dict[nn.Module, list[torch.Tensor]] = {}  # held basis per group
        self.lam: dict[nn.Module, list[torch.Tensor]] = {}  # Kronecker eigenvalues
        self.s: dict[nn.Module, list[torch.Tensor]] = {}  # EKFAC: running statistic
        self.snap: dict[nn.Module, list[torch.Tensor]] = {}
        self.m: dict[nn.Module, list[torch.Tensor]] = {}  # SOAP: moments
        self.v: dict[nn.Module, list[torch.Tensor]] = {}
        self.t: dict[nn.Module, int] = {}
        handled = {id(p) for m in self.modules for p in m.parameters()}
        self.rest = [p for p in model.parameters() if id(p) not in handled]
        self.rest_state: dict[int, tuple[int, torch.Tensor, torch.Tensor]] = {}

    def _row_grads(self, m: nn.Module) -> torch.Tensor:
        """[groups, rows, g*a]: each row's gradient g a^T, flattened."""
        a_rows, g_rows = _rows(m, self.inputs[m], self.gouts[m])
        if self.cfg.approximation == "reduce" and not isinstance(m, nn.Embedding):
            b = self.inputs[m].shape[0]
            a_rows = a_rows.reshape(a_rows.shape[0], b, -1, a_rows.shape[-1]).mean(2)
            g_rows = g_rows.reshape(g_rows.shape[0], b, -1, g_rows.shape[-1]).sum(2)
        return torch.einsum("grc,gra->grca", g_rows, a_rows).flatten(2)

    def _adam(self, t: int, m: torch.Tensor, v: torch.Tensor, g: torch.Tensor) -> tuple[Any, ...]:
        """Adam's moments after its t-th gradient `g`, and its normalised step."""
        e = self.eig
        m = e.beta1 * m + (1 - e.beta1) * g
        v = e.beta2 * v + (1 - e.beta2) * g * g
        step = (m / (1 - e.beta1**t)) / ((v / (1 - e.beta2**t)).sqrt() + e.eps)
        return m, v, step

    @torch.no_grad()
    def step(self) -> None:
        cfg, eig = self.cfg, self.eig
        factor_step = self.steps % cfg.factor_interval == 0
        inv_step = self.steps % cfg.inv_interval == 0
        if factor_step:
            self._update_factors()
            if eig.mode == "ekfac":
                for mod in self.modules:
                    if mod not in self.q:
                        continue  # no basis yet: the first one sets the statistic
                    rows = self._row_grads(mod)
                    batch = [((rows[i] @ self.q[mod][i]) ** 2).mean(0) for i in range(len(rows))]
                    d = cfg.factor_decay
                    pairs_ = zip(self.s[mod], batch, strict=True)
                    self.s[mod] = [d * s + (1 - d) * b for s, b in pairs_]
        if inv_step:
            for mod in self.modules:
                qs, lams = [], []
                for i in range(self.a[mod].shape[0]):
                    la, qa = _basis(mod, self.a[mod][i])
                    lg, qg = _basis(mod, self.g[mod][i])
                    qs.append(torch.kron(qg, qa))
                    lams.append(torch.kron(lg, la))
                if mod in self.q:  # carry the state into the new basis
                    rs = [new.T @ old for new, old in zip(qs, self.q[mod], strict=True)]
                    if eig.mode == "ekfac":
                        self.s[mod] = [(r * r) @ s for r, s in zip(rs, self.s[mod], strict=True)]
                    else:
                        self.m[mod] = [r @ m for r, m in zip(rs, self.m[mod], strict=True)]
                        self.v[mod] = [(r * r) @ v for r, v in zip(rs, self.v[mod], strict=True)]
                elif eig.mode == "ekfac":
                    self.s[mod] = [lam.clone() for lam in lams]
                else:
                    self.m[mod] = [torch.zeros_like(lam) for lam in lams]
                    self.v[mod] = [torch.zeros_like(lam) for lam in lams]
                    self.t[mod] = 0
                self.q[mod], self.lam[mod] = qs, lams
        if eig.mode == "ekfac" and (inv_step if eig.sync == "lazy" else factor_step or inv_step):
            self.snap = {mod: [s.clone() for s in self.s[mod]] for mod in self.modules}
        pairs = []
        for mod in self.modules:
            grad = _grad_matrix(mod)
            out = []
            for i in range(grad.shape[0]):
                q = self.q[mod][i]
                gt = q.T @ grad[i].reshape(-1)
                if eig.mode == "ekfac":
                    out.append(q @ (gt / (self.snap[mod][i] + cfg.damping)))
                else:
                    t = self.t[mod] + 1
                    self.m[mod][i], self.v[mod][i], st = self._adam(
                        t, self.m[mod][i], self.v[mod][i], gt
                    )
                    out.append(q @ st)
            if eig.mode == "soap":
                self.t[mod] += 1
            pairs.append((mod, torch.stack(out).reshape(grad.shape), grad))
        scale = 1.0
        if eig.mode == "ekfac" and cfg.kl_clip is not None:
            vg = sum(float((p * g).sum()) for _, p, g in pairs) * cfg.lr**2
            scale = min(1.0, math.sqrt(cfg.kl_clip / abs(vg))) if vg != 0 else 1.0
        for mod, p, _ in pairs:
            _set_grad(mod, p * scale)
        if eig.mode == "soap":
            for j, p in enumerate(self.rest):
                t, m, v = self.rest_state.get(j, (0, torch.zeros_like(p), torch.zeros_like(p)))
                m, v, st = self._adam(t + 1, m, v, p.grad)
                self.rest_state[j] = (t + 1, m, v)
                p.grad = st * self.eig.rest_lr_scale
        self.steps += 1
