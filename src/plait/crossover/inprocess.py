"""Crossover inside one process: K models, each with its own process group, in rotation.

When one program trains several models (an ensemble, a small sweep) data-parallel, it can
overlap them without any token: model k's gradient all-reduce, on model k's own process
group, runs in the background while model k+1 computes its forward and backward. The
communication of the last model of a round overlaps the first model's next forward, so
the pipeline never drains between steps; `synchronize()` completes it.

Every model's math is plain synchronous data parallelism (gradients averaged over the
workers, then its own optimizer step), so each model trains exactly as it would alone.
Gradients travel in buckets planned by plait's fusion planner, issued in the same order on
every rank from this thread, and counted and traced by plait.comm.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from plait.comm import FusionItem, ThresholdPlanner, all_reduce, broadcast, wait, world_size
from plait.comm.fusion import DDP_DEFAULT_BUCKET_MB
from plait.distributed import new_group
from plait.trace import COMPUTE, OPTIM, span

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class _Member:
    model: nn.Module
    optimizer: torch.optim.Optimizer
    group: Any
    buckets: list[list[nn.Parameter]]
    futures: list[torch.futures.Future[torch.Tensor]] = field(default_factory=list)
    flats: list[torch.Tensor] = field(default_factory=list)


class InterleavedModels:
    """Train several data-parallel models in one process, overlapping their communication.

    Args:
        models: the models; replicas must start identical on every rank.
        optimizers: one optimizer per model.
        bucket_cap_mb: fusion threshold of the gradient buckets.
        groups: one process group per model (default: a new group over all ranks for
            each, created collectively with plait's collective timeout, so their
            collectives run concurrently).
    """

    def __init__(
        self,
        models: Sequence[nn.Module],
        optimizers: Sequence[torch.optim.Optimizer],
        *,
        bucket_cap_mb: float = DDP_DEFAULT_BUCKET_MB,
        groups: Sequence[Any] | None = None,
    ) -> None:
        if len(models) < 1 or len(models) != len(optimizers):
            raise ValueError(
                f"need one optimizer per model, got {len(models)} models and "
                f"{len(optimizers)} optimizers"
            )
        if groups is not None and len(groups) != len(models):
            raise ValueError(f"need one process group per model, got {len(groups)}")
        if groups is None:
            groups = [new_group() if dist.is_initialized() else None for _ in models]
        planner = ThresholdPlanner(threshold_bytes=int(bucket_cap_mb * 2**20))
        self.members: list[_Member] = []
        for model, opt, group in zip(models, optimizers, groups, strict=True):
            params = [p for p in reversed(list(model.parameters())) if p.requires_grad]
            items = [
                FusionItem(name=str(i), nbytes=p.numel() * p.element_size())
                for i, p in enumerate(params)
            ]
            buckets = [[params[i] for i in b] for b in planner.plan(items)]
            if world_size(group) > 1:
                for p in model.state_dict().values():
                    # start from identical replicas
                    broadcast(p, src=0, group=group, name="replicas", async_op=False)
            self.members.append(_Member(model=model, optimizer=opt, group=group, buckets=buckets))
        self._in_flight: _Member | None = None

    def _launch(self, m: _Member) -> None:
        """Start the averaging all-reduces of `m`'s gradients (asynchronous)."""
        p = world_size(m.group)
        m.flats, m.futures = [], []
        for i, bucket in enumerate(m.buckets):
            grads = [q.grad if q.grad is not None else torch.zeros_like(q) for q in bucket]
            flat = torch.cat([g.reshape(-1) for g in grads]).div_(p)
            m.flats.append(flat)
            m.futures.append(all_reduce(flat, group=m.group, name=f"model{id(m) % 1000} b{i}"))

    def _finish(self, m: _Member) -> None:
        """Wait for `m`'s gradients, write them back, and step its optimizer."""
        for bucket, flat, fut in zip(m.buckets, m.flats, m.futures, strict=True):
            wait(fut)  # raises CollectiveError if a peer is gone: never step on local grads
            offset = 0
            for q in bucket:
                n = q.numel()
                q.grad = flat[offset : offset + n].view_as(q).clone()
                offset += n
        with span("optimizer", OPTIM):
            m.optimizer.step()
        m.flats, m.futures = [], []

    def step(
        self, batches: Sequence[tuple[torch.Tensor, torch.Tensor]], loss_fn: LossFn
    ) -> list[float]:
        """One optimizer step of every model on its batch; returns the losses.

        The last model's communication is left in flight to overlap the next call's first
        forward: call `synchronize()` before reading or saving its parameters.
        """
        if len(batches) != len(self.members):
            raise ValueError(f"need one batch per model ({len(self.members)}), got {len(batches)}")
        losses = []
        for k, (m, (x, y)) in enumerate(zip(self.members, batches, strict=True)):
            if self._in_flight is m:  # a single model cannot overlap with itself
                self.synchronize()
            m.optimizer.zero_grad(set_to_none=True)
            with span("forward", COMPUTE, model=k):
                loss = loss_fn(m.model(x), y)
            with span("backward", COMPUTE, model=k):
                loss.backward()
            losses.append(float(loss.detach()))
            self._launch(m)
            if self._in_flight is not None:
                self._finish(self._in_flight)
            self._in_flight = m
        return losses

    def synchronize(self) -> None:
        """Complete the communication still in flight and apply its optimizer step."""
        if self._in_flight is not None:
            self._finish(self._in_flight)
            self._in_flight = None
