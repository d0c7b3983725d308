"""Local-update strategies: ``diloco`` and ``localsgd`` (`plait.dp.local`).

``--strategy diloco:inner_steps=20,fragments=4,delay=2,compression=int4`` trains with
`plait.dp.local.LocalUpdate`. Evaluation sees the shared parameters (the model the
workers agree on, identical on every rank), and a checkpoint keeps, per rank, what
differs between workers in the middle of a round: the local parameters, the inner
optimizer's state and the error feedback, with the shared copy, the outer optimizer and
the exchanges in flight, so a resumed run continues the round exactly.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from plait.comm import Collective
from plait.dp.local import METHODS, LocalConfig, LocalUpdate, local_config
from plait.dp.local.codecs import codec_class
from plait.train.strategy import Strategy, register_strategy


class LocalStrategy(Strategy):
    """Local-update training (`LocalConfig`'s fields are its options)."""

    def __init__(self, *, method: str, **options: Any) -> None:
        self.name = method
        self.options = options
        self.config: LocalConfig = local_config(method, **options)
        self._model: LocalUpdate | None = None
        self._optimizer: torch.optim.Optimizer | None = None
        self._pending_state: dict[str, Any] | None = None

    def collectives(self) -> frozenset[Collective]:
        # the initial broadcast, the buffers' (and evaluation's) all-reduce, the codec's
        return (
            frozenset({Collective.BROADCAST, Collective.ALL_REDUCE})
            | codec_class(self.config).collectives
        )

    def wrap(self, model: nn.Module) -> nn.Module:
        self._model = LocalUpdate(model, self.config)
        return self._model

    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        assert self._model is not None, "wrap() before attach_optimizer()"
        self._model.attach(optimizer)
        self._optimizer = optimizer
        if self._pending_state is not None:
            self.load_state_dict(self._pending_state)
            self._pending_state = None

    @contextlib.contextmanager
    def compute_only(self, model: nn.Module) -> Iterator[None]:
        assert isinstance(model, LocalUpdate)
        with model.paused():
            yield

    def eval_context(self, model: nn.Module) -> contextlib.AbstractContextManager[Any]:
        assert isinstance(model, LocalUpdate)
        return model.consensus()

    def state_dict(self) -> dict[str, Any]:
        if self._model is None or self._optimizer is None:
            return {}
        return {
            "outer": self._model.outer_state_dict(),
            "local": {n: p.detach().clone() for n, p in self._model.module.named_parameters()},
            "inner": self._optimizer.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not state:
            return
        if self._model is None or self._optimizer is None:
            self._pending_state = state
            return
        self._model.load_outer_state_dict(state["outer"])
        missing, unexpected = self._model.module.load_state_dict(state["local"], strict=False)
        if missing or unexpected:
            raise ValueError(
                f"local parameters in the checkpoint do not match the model (missing "
                f"{missing[:3]}, unexpected {unexpected[:3]})"
            )
        self._optimizer.load_state_dict(state["inner"])

    def close(self) -> None:
        if self._model is not None:
            self._model.close()

    def describe(self) -> str:
        opts = ",".join(f"{k}={v}" for k, v in sorted(self.options.items()))
        return f"{self.name}:{opts}" if opts else self.name


def _factory(method: str) -> Any:
    def make(**options: Any) -> LocalStrategy:
        return LocalStrategy(method=method, **options)

    return make


for _method in METHODS:
    register_strategy(_method)(_factory(_method))
