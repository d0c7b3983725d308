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
"""

from __future__ import annotations

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


class MuonAdamW(torch.optim.Optimizer):
    """`torch.optim.Muon` over the 2-D parameters, `torch.optim.AdamW` over the rest.

    Args:
        params: parameters (or groups, whose options are ignored: the split is by shape).
        lr: learning rate of both halves (Muon's is RMS-matched to AdamW's).
        weight_decay: decoupled weight decay of both halves.
        momentum: Muon's momentum (its default, 0.95, with Nesterov).
        betas: AdamW's betas.

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
    ) -> None:
        tensors = _tensors(params)
        if not tensors:
            raise ValueError("MuonAdamW got no parameters")
        matrices = [p for p in tensors if p.ndim == 2]
        rest = [p for p in tensors if p.ndim != 2]
        super().__init__(tensors, {"lr": lr, "weight_decay": weight_decay})
        self._muon = (
            torch.optim.Muon(
                matrices,
                lr=lr,
                weight_decay=weight_decay,
                momentum=momentum,
                adjust_lr_fn="match_rms_adamw",
            )
            if matrices
            else None
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
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
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
