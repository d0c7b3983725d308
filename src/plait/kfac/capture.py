"""`FactorCapture`: the hooks that compute K-FAC's factor sums during forward and backward.

A forward hook on each layer computes the sum of ``a a^T`` over its input rows, and a hook
on the layer's output computes the sum of ``g g^T`` over the output gradient's rows when
backward reaches it; with EKFAC bases, the same backward hook also computes the layer's
eigenvalue-correction statistic (`KFACLayer.scale_sum`). Each sum, with its row count, goes
to a *sink*. `KFAC` installs one whose sink accumulates uses and micro-batches and hands
finished factors to the factor pipeline; anything else that needs K-FAC's factor work
(the trainer's compute-only timing, a user's own statistics) uses the same hooks with its
own sink instead of writing hooks again: ``with kfac.capture.redirected(sink): ...``.

Hooks act only on modules in training mode with gradients enabled, and only when
`active` says the step updates factors, so evaluation and frozen passes cost nothing.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from plait.kfac.layers import (
    Approximation,
    Conv2dLayer,
    EmbeddingLayer,
    FactorKind,
    KFACLayer,
)
from plait.trace import FACTOR, span

#: Receives one factor sum: ``sink(layer, kind, total, rows)`` (total flat, in the wire
#: layout: packed triangles, dense or a diagonal; rows: how many rows it sums).
Sink = Callable[[KFACLayer, FactorKind, torch.Tensor, int], None]

#: A layer's EKFAC bases, or None when the layer has no statistic: (A's basis, or None for
#: the identity of a diagonal A; G's basis, or None before the layer has any).
LayerBases = tuple[torch.Tensor | None, torch.Tensor | None]
Bases = Callable[[KFACLayer], LayerBases | None]


def batch_size(layer: KFACLayer, x: torch.Tensor) -> int:
    """Samples the layer's mean loss is taken over: the leading dimension of batched input."""
    if isinstance(layer, Conv2dLayer):
        return int(x.shape[0]) if x.dim() == 4 else 1
    if isinstance(layer, EmbeddingLayer):
        return int(x.shape[0]) if x.dim() >= 1 else 1
    return int(x.shape[0]) if x.dim() > 1 else 1


def discard(layer: KFACLayer, kind: FactorKind, total: torch.Tensor, rows: int) -> None:
    """A sink that drops every sum (the work is done, its result is not kept)."""


class FactorCapture:
    """Factor hooks on `layers`, handing each sum to a sink.

    Args:
        layers: the layers to hook, by module name (a mapping the owner may shrink later:
            a layer it removes is skipped).
        sink: receives each sum.
        packed: symmetric sums as packed upper triangles (else dense).
        approximation: expand or reduce (`plait.kfac.layers`); a layer that is not
            reducible stays on expand.
        active: whether the current step updates factors (asked at each hooked forward).
        accept: asked with a layer and its input on the first capture: False leaves the
            layer out from then on (None: accept all).
        bases: EKFAC's per-layer bases; a layer it names also gets its statistic
            (`FactorKind.S`), zero before it has a basis (None: no statistic).
        on_forward: called at each hooked training forward (a step's clock starts there).
    """

    def __init__(
        self,
        layers: Mapping[str, KFACLayer],
        sink: Sink,
        *,
        packed: bool = True,
        approximation: Approximation = Approximation.EXPAND,
        active: Callable[[], bool] = lambda: True,
        accept: Callable[[KFACLayer, torch.Tensor], bool] | None = None,
        bases: Bases | None = None,
        on_forward: Callable[[], None] | None = None,
    ) -> None:
        self.layers = layers
        self.sink = sink
        self.packed = packed
        self.approximation = approximation
        self.active = active
        self.accept = accept
        self.bases = bases
        self.on_forward = on_forward
        #: seconds spent computing sums since the owner last reset it
        self.seconds = 0.0
        self._quiet = False
        self._handles: list[Any] = []

    # ------------------------------------------------------------------ hooks on / off
    @property
    def attached(self) -> bool:
        return bool(self._handles)

    def attach(self) -> None:
        """Install the hooks (no-op if installed)."""
        if self._handles:
            return
        self._handles = [
            layer.module.register_forward_hook(functools.partial(self._on_forward, layer))
            for layer in self.layers.values()
        ]

    def remove(self) -> None:
        """Remove the hooks (the model is left as it was)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()

    @contextlib.contextmanager
    def redirected(self, sink: Sink = discard) -> Iterator[None]:
        """Hand the sums to `sink` meanwhile (default: drop them), without touching the
        owner's clock or discovery: the hooks do their work and nothing else changes."""
        saved = self.sink, self._quiet, self.seconds
        self.sink, self._quiet = sink, True
        try:
            yield
        finally:
            self.sink, self._quiet, self.seconds = saved

    def reduces(self, layer: KFACLayer) -> bool:
        """Whether `layer` forms its factors by K-FAC-reduce."""
        return self.approximation is Approximation.REDUCE and layer.reducible

    # ------------------------------------------------------------------ the hooks
    def _on_forward(
        self, layer: KFACLayer, module: nn.Module, inputs: tuple[Any, ...], output: Any
    ) -> None:
        if not (module.training and torch.is_grad_enabled()):
            return
        if self.on_forward is not None and not self._quiet:
            self.on_forward()
        if not inputs or not isinstance(inputs[0], torch.Tensor) or not self.active():
            return
        if self.layers.get(layer.name) is not layer:  # left out by the owner
            return
        x = inputs[0].detach()
        if self.accept is not None and not self._quiet and not self.accept(layer, x):
            return
        t0 = time.perf_counter()
        batch = batch_size(layer, x)
        reduce = self.reduces(layer)
        with span(f"A {layer.name}", FACTOR):
            total, rows = layer.a_sum(x, packed=self.packed, reduce_to=batch if reduce else None)
        self.sink(layer, FactorKind.A, total, rows)
        bases = None if self.bases is None else self.bases(layer)
        self._count(t0)
        if isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(functools.partial(self._on_grad, layer, batch, x, bases))

    def _on_grad(
        self,
        layer: KFACLayer,
        batch: int,
        x: torch.Tensor,
        bases: LayerBases | None,
        grad: torch.Tensor,
    ) -> None:
        t0 = time.perf_counter()
        reduce = self.reduces(layer)
        with torch.no_grad(), span(f"G {layer.name}", FACTOR):
            g = grad.detach()
            total, rows = layer.g_sum(g, batch, packed=self.packed, reduce=reduce)
            self.sink(layer, FactorKind.G, total, rows)
            if bases is not None:
                self._scale(layer, batch, x, g, bases=bases, reduce=reduce)
        self._count(t0)

    def _scale(
        self,
        layer: KFACLayer,
        batch: int,
        x: torch.Tensor,
        g: torch.Tensor,
        *,
        bases: LayerBases,
        reduce: bool,
    ) -> None:
        """EKFAC's statistic in the bases the forward saw (zeros before the first basis:
        its running average starts from K-FAC's eigenvalues when a basis arrives)."""
        a_basis, g_basis = bases
        if g_basis is None:
            shape = layer.shape(FactorKind.S)
            rows = batch if reduce else 1
            self.sink(layer, FactorKind.S, g.new_zeros(shape.dense_numel), rows)
            return
        total, rows = layer.scale_sum(x, g, batch, a_basis=a_basis, g_basis=g_basis,
                                      reduce=reduce)  # fmt: skip
        self.sink(layer, FactorKind.S, total, rows)

    def _count(self, t0: float) -> None:
        if not self._quiet:
            self.seconds += time.perf_counter() - t0
