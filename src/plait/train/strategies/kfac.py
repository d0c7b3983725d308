"""K-FAC training strategies: ``kfac-naive``, ``kfac-static`` and ``spd-kfac``.

All three are the same preconditioner over DDP-averaged gradients (any plait compressor:
``spd-kfac:compression=acpsgd,rank=4``) with the same math; they differ only in the
distributed mechanics, which is what the benchmarks compare:

- ``kfac-naive``: one all-reduce per factor after backward, dense factors, round-robin
  inversions started once every factor arrived, every worker preconditions (textbook D-KFAC);
- ``kfac-static``: 25 MB buckets issued from the hooks, dense factors, greedy whole-layer
  placement, every worker preconditions (KAISA's defaults);
- ``spd-kfac``: buckets planned from measured ready times and issued from the hooks, packed
  triangles, LPT with local inversion of small factors, each inversion as soon as its bucket
  arrives, lazy factor sync and the distribution the cost model prices cheapest.

Every `KFACConfig` field is an option (``spd-kfac:inv_interval=10,method=eigen``), so any
mechanism can be switched on or off for any of them, and so is the preconditioning rule:
``spd-kfac:mode=ekfac`` and ``spd-kfac:mode=soap`` (Adam in K-FAC's eigenbasis; train it
with ``--optimizer sgd-plain``, SGD without momentum) share all three mechanics.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import fields, replace
from enum import StrEnum
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from plait.comm import Collective
from plait.dp import compressor_class, compressor_of, data_parallel
from plait.kfac.config import KFACConfig
from plait.kfac.pipeline import FactorComm, FactorSync
from plait.kfac.placement import Distribution, PlacementPolicy
from plait.kfac.preconditioner import KFAC, check_model
from plait.train.strategies.dp import DDP_OPTIONS, check_compressor, check_ddp_options
from plait.train.strategy import Strategy, check_options, keyword_options, register_strategy


class KFACPreset(StrEnum):
    """The named K-FAC strategies."""

    NAIVE = "kfac-naive"
    STATIC = "kfac-static"
    SPD = "spd-kfac"


#: The mechanics each named strategy selects, as typed configs (its options may override
#: any field: they are applied with `dataclasses.replace`, which checks them again).
PRESETS: dict[KFACPreset, KFACConfig] = {
    KFACPreset.NAIVE: KFACConfig(
        comm=FactorComm.AFTER_BACKWARD,
        packed=False,
        placement=PlacementPolicy.ROUND_ROBIN,
        local_inversion=False,
        overlap=False,
    ),
    KFACPreset.STATIC: KFACConfig(
        comm=FactorComm.STATIC,
        packed=False,
        placement=PlacementPolicy.GREEDY,
        local_inversion=False,
        overlap=False,
    ),
    KFACPreset.SPD: KFACConfig(
        comm=FactorComm.DYNAMIC,
        packed=True,
        placement=PlacementPolicy.LPT,
        local_inversion=True,
        overlap=True,
        distribution=Distribution.AUTO,
        sync=FactorSync.LAZY,
    ),
}

_CONFIG_FIELDS = {f.name for f in fields(KFACConfig)}


class KFACStrategy(Strategy):
    """DDP (with a plait compressor) plus a `KFAC` preconditioner.

    Args:
        preset: a `KFACPreset` (or its name).
        compression: the gradient compressor's name (``ssgd``, ``acpsgd``, ...).
        include_factors: checkpoints carry factors and decompositions (exact resume).
        **options: `KFACConfig` fields; anything else goes to the compressor.
    """

    def __init__(
        self,
        *,
        preset: KFACPreset | str,
        compression: str = "ssgd",
        include_factors: bool = True,
        **options: Any,
    ) -> None:
        try:
            preset = KFACPreset(preset)
        except ValueError:
            names = ", ".join(p.value for p in KFACPreset)
            raise ValueError(f"unknown K-FAC preset {preset!r}; choose from {names}") from None
        self.name = str(preset)
        self.preset = preset
        self.options = dict(options)
        cls = compressor_class(compression)
        comp_names = [*DDP_OPTIONS, *keyword_options(cls)]
        try:
            accepted = [*_CONFIG_FIELDS, *comp_names, "compression", "include_factors"]
            check_options(self.name, options, accepted)
        except ValueError as exc:
            raise ValueError(
                f"invalid options for {self.name} with compressor {compression!r}: {exc}"
            ) from None
        if not isinstance(include_factors, bool):
            raise ValueError(
                f"strategy {self.name!r}: include_factors must be true or false, "
                f"got {include_factors!r}"
            )
        kfac_opts = {k: v for k, v in options.items() if k in _CONFIG_FIELDS}
        comp_opts = {k: v for k, v in options.items() if k not in _CONFIG_FIELDS}
        if "skip_layers" in kfac_opts and isinstance(kfac_opts["skip_layers"], str):
            kfac_opts["skip_layers"] = tuple(kfac_opts["skip_layers"].split("|"))
        try:
            self.config = replace(PRESETS[preset], **kfac_opts)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"strategy {self.name!r}: {exc}") from exc
        check_ddp_options(self.name, comp_opts)
        # validate the compressor's options now, not at wrap time
        check_compressor(
            f"{self.name} with compressor {compression!r}",
            compression,
            {k: v for k, v in comp_opts.items() if k not in DDP_OPTIONS},
        )
        self.compression = compression
        self.comp_opts = comp_opts
        self.include_factors = include_factors
        self.kfac: KFAC | None = None
        self._model: nn.Module | None = None
        self._pending_state: dict[str, Any] | None = None
        self._compute_only = False
        self._loss: float | None = None

    def check(self, model: nn.Module, *, world: int) -> None:
        """Refuse, before launch, a model with no layer K-FAC can precondition.

        Raises:
            ValueError: naming the model and the layers K-FAC handles.
        """
        try:
            check_model(model, self.config)
        except ValueError as exc:
            raise ValueError(f"strategy {self.name!r}: {exc}") from None

    def collectives(self) -> frozenset[Collective]:
        """DDP's and the compressor's, plus factor all-reduces and inverse broadcasts."""
        comp = compressor_class(self.compression).collectives
        return super().collectives() | comp | {Collective.ALL_REDUCE, Collective.BROADCAST}

    def wrap(self, model: nn.Module) -> nn.Module:
        wrapped: nn.Module = model
        if dist.is_available() and dist.is_initialized():
            wrapped = data_parallel(model, self.compression, **self.comp_opts)
        self._model = wrapped
        self.kfac = KFAC(wrapped, self.config)
        if self._pending_state is not None:
            self.load_state_dict(self._pending_state)
            self._pending_state = None
        return wrapped

    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        if self.kfac is not None:
            self.kfac.optimizer = optimizer

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager[Any]:
        stack = contextlib.ExitStack()
        stack.enter_context(super().no_sync(model))
        if self.kfac is not None:
            stack.enter_context(self.kfac.no_sync())
        return stack

    @contextlib.contextmanager
    def compute_only(self, model: nn.Module) -> Iterator[None]:
        """A step computing what this worker would (factors, its decompositions, its
        preconditioning), communicating nothing and leaving K-FAC's state untouched: the
        factor hooks hand their sums to nowhere (`FactorCapture.redirected`) and the step
        is `KFAC.dry_step`."""
        with super().no_sync(model), contextlib.ExitStack() as stack:
            if self.kfac is not None:
                stack.enter_context(self.kfac.capture.redirected())
                self._compute_only = True
                stack.callback(setattr, self, "_compute_only", False)
            yield

    def observe_loss(self, loss: float) -> None:
        self._loss = loss

    def before_optimizer_step(self, model: nn.Module) -> None:
        if self.kfac is None:
            return
        loss, self._loss = self._loss, None
        if self._compute_only:
            self.kfac.dry_step()
        else:
            self.kfac.step(loss)

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {}
        if self.kfac is not None:
            state["kfac"] = self.kfac.state_dict(include_factors=self.include_factors)
        comp = None if self._model is None else compressor_of(self._model)
        if comp is not None:
            state["compressor"] = comp.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.kfac is None:
            self._pending_state = state
            return
        if "kfac" in state:
            self.kfac.load_state_dict(state["kfac"])
        comp = None if self._model is None else compressor_of(self._model)
        if comp is not None:
            comp.load_state_dict(state.get("compressor", {}))

    def close(self) -> None:
        if self.kfac is not None:
            self.kfac.remove()
        comp = None if self._model is None else compressor_of(self._model)
        if comp is not None:
            comp.close()

    def describe(self) -> str:
        opts = ",".join(f"{k}={v}" for k, v in sorted(self.options.items()))
        return f"{self.name}:{opts}" if opts else self.name


def _factory(preset: KFACPreset) -> Any:
    def make(**options: Any) -> KFACStrategy:
        return KFACStrategy(preset=preset, **options)

    return make


for _preset in KFACPreset:
    register_strategy(_preset.value)(_factory(_preset))
