"""Muon for the weight matrices and AdamW for everything else, as one optimizer.

`torch.optim.Muon` orthogonalises the update of 2-D parameters only; its documentation
advises a standard optimizer such as AdamW for the others (biases, norms, convolution
kernels). The training loop and the strategies take ONE optimizer (K-FAC reads its learning
rate, ZeRO shards it, checkpoints save it), so `MuonAdamW` holds both and shows them as
one: its parameter groups are the two inner optimizers' groups (the same dicts, so a
learning-rate change reaches both), its state is theirs (one table keyed by parameter),
and its state dict is a plain optimizer state dict.

Muon uses ``adjust_lr_fn="match_rms_adamw"``, which scales each matrix's update to the
RMS of an AdamW update so that one learning rate and weight decay serve both halves (the
documentation's reading of "Muon is Scalable for LLM Training"); a race then tunes one
learning rate per optimizer, as for SGD and AdamW.

torch's Muon runs its Newton-Schulz iteration in bfloat16, the fast type of the GPUs it
was written for. A CPU without native bf16 arithmetic emulates it: on this project's
AVX2 host one Muon step of the GPT took 22.3 s against 1.5 s on a host with bf16 units,
so a race there would time the emulation, not the method. `Muon32` is torch's Muon with
the iteration in the parameter's own type (float32): the same update up to the rounding
of the orthogonalised matrix (equal bit for bit to torch's when asked for bfloat16,
tested), selected as the ``muon-fp32`` optimizer.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch


def _tensors(params: Iterable[Any]) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for p in params:
        if isinstance(p, dict):
            out += list(p["params"])
        elif isinstance(p, tuple):  # named parameters
            out.append(p[1])
        else:
            out.append(p)
    return out


def _evaluate(closure: Callable[[], float] | None) -> float | None:
    """The optimizer protocol's closure: the loss recomputed with gradients, if given."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


def orthogonalise(
    update: torch.Tensor,
    dtype: torch.dtype,
    coefficients: tuple[float, float, float],
    steps: int,
    eps: float,
) -> torch.Tensor:
    """Muon's quintic Newton-Schulz iteration towards the polar factor of ``update``.

    The iteration of torch's Muon (and of its paper): scale to a spectral norm of at most
    1 (by the Frobenius norm), then ``steps`` times ``X <- aX + (bA + cA^2)X`` with
    ``A = XX^T``, on the wide orientation so that ``A`` is the smaller Gram matrix. Only
    ``dtype``, the type the iteration runs in, is a parameter here.
    """
    a, b, c = coefficients
    x = update.to(dtype)
    tall = update.size(0) > update.size(1)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.T
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, poly, x, beta=a)
    return x.T if tall else x


class Muon32(torch.optim.Muon):
    """`torch.optim.Muon` whose Newton-Schulz iteration runs in the parameter's type.

    Same options, parameter groups and state (``momentum_buffer``) as torch's Muon, so
    checkpoints interchange; see the module docstring for why the type matters on a CPU.
    ``ns_dtype`` is the iteration's type (None: the parameter's); ``torch.bfloat16``
    reproduces torch's Muon exactly.
    """

    def __init__(self, params: Iterable[Any], *, ns_dtype: torch.dtype | None = None, **kw: Any):
        super().__init__(params, **kw)
        self.ns_dtype = ns_dtype

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One Muon step over every 2-D parameter with a gradient."""
        loss = _evaluate(closure)
        for group in self.param_groups:
            lr, momentum = float(group["lr"]), group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - momentum)
                update = p.grad.lerp(buf, momentum) if group["nesterov"] else buf
                ortho = orthogonalise(
                    update,
                    self.ns_dtype or p.dtype,
                    group["ns_coefficients"],
                    group["ns_steps"],
                    group["eps"],
                )
                p.mul_(1 - lr * group["weight_decay"])
                p.add_(ortho, alpha=-_muon_lr(lr, group["adjust_lr_fn"], p.shape))
        return loss


def _muon_lr(lr: float, rule: str | None, shape: torch.Size) -> float:
    """Muon's per-matrix learning rate (torch's two rules, by name)."""
    rows, cols = shape[:2]
    if rule == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    if rule is None or rule == "original":
        return lr * math.sqrt(max(1.0, rows / cols))
    return lr


class MuonAdamW(torch.optim.Optimizer):
    """`torch.optim.Muon` over the 2-D parameters, `torch.optim.AdamW` over the rest.

    Args:
        params: parameters (or groups, whose options are ignored: the split is by shape).
        lr: learning rate of both halves (Muon's is RMS-matched to AdamW's).
        weight_decay: decoupled weight decay of both halves.
        momentum: Muon's momentum (its default, 0.95, with Nesterov).
        betas: AdamW's betas.
        ns_dtype: None for torch's Muon (bfloat16 Newton-Schulz); a type for `Muon32`
            with its iteration in that type.

    Raises:
        ValueError: no parameters.
    """

    def __init__(
        self,
        params: Iterable[Any],
        *,
        lr: float = 1e-3,
        weight_decay: float = 0.0,
        momentum: float = 0.95,
        betas: tuple[float, float] = (0.9, 0.999),
        ns_dtype: torch.dtype | None = None,
    ) -> None:
        tensors = _tensors(params)
        if not tensors:
            raise ValueError("MuonAdamW got no parameters")
        matrices = [p for p in tensors if p.ndim == 2]
        rest = [p for p in tensors if p.ndim != 2]
        super().__init__(tensors, {"lr": lr, "weight_decay": weight_decay})
        muon_kw: dict[str, Any] = {
            "lr": lr,
            "weight_decay": weight_decay,
            "momentum": momentum,
            "adjust_lr_fn": "match_rms_adamw",
        }
        self._muon: torch.optim.Optimizer | None = None
        if matrices:
            self._muon = (
                torch.optim.Muon(matrices, **muon_kw)
                if ns_dtype is None
                else Muon32(matrices, ns_dtype=ns_dtype, **muon_kw)
            )
        self._adamw = (
            torch.optim.AdamW(rest, lr=lr, weight_decay=weight_decay, betas=betas) if rest else None
        )
        self.param_groups = [g for o in self._inner() for g in o.param_groups]
        self._share()

    def _inner(self) -> list[torch.optim.Optimizer]:
        return [o for o in (self._muon, self._adamw) if o is not None]

    def _share(self) -> None:
        """Make the inner optimizers' groups and state this optimizer's (after a load too)."""
        i = 0
        for o in self._inner():
            n = len(o.param_groups)
            o.param_groups = self.param_groups[i : i + n]
            o.state = self.state
            i += n

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One step of both halves (the closure, if any, is evaluated once)."""
        loss = _evaluate(closure)
        for o in self._inner():
            o.step()
        return loss

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._share()


def heavyball_soap(
    params: Iterable[Any], *, lr: float, weight_decay: float = 0.0
) -> torch.optim.Optimizer:
    """heavyball's SOAP (`pip install plait[bench]`), its step uncompiled.

    heavyball compiles parts of its step with ``torch.compile`` on first use, which took
    about 100 s for a small MLP on this 2-core CPU host and would be charged to the first
    steps of a race; ``heavyball.utils.compile_mode = None`` runs those parts eagerly
    (the same arithmetic; the first step of a digits MLP then takes 0.8 s, later ones
    0.01-0.07 s). Everything else is heavyball's default: betas (0.9, 0.95), Shampoo's
    factors averaged with 0.95, the eigenbases refreshed every 2 steps (its
    ``precondition_frequency``).

    Raises:
        ValueError: heavyball is not installed.
    """
    try:
        import heavyball
        import heavyball.utils
    except ImportError:
        raise ValueError(
            "optimizer heavyball-soap needs heavyball: pip install 'plait[bench]'"
        ) from None
    heavyball.utils.compile_mode = None
    opt: torch.optim.Optimizer = heavyball.SOAP(params, lr=lr, weight_decay=weight_decay)
    return opt
