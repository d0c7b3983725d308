"""Gradient averaging on the data axis for tensor-parallel models (ZeRO stage 0).

DDP cannot wrap a model whose parameters are DTensors, so when tensor parallelism and plain
data parallelism meet, each rank averages the *local shards* of its gradients across its
data-parallel peers (who hold the same shards). Gradients are fused into buckets by
plait's fusion planner and reduced through `plait.comm` (counted, traced), after the whole
backward pass, which also makes it correct under pipeline schedules and accumulation.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from plait.comm import ops
from plait.comm.fusion import DDP_DEFAULT_BUCKET_MB, FusionItem, ThresholdPlanner


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The rank-local part of a (possibly distributed) tensor."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


class GradientSync:
    """Average gradients of `params` over `group` in fused buckets.

    Args:
        params: the parameters whose gradients to average (rank-local shards).
        group: the data-parallel process group.
        bucket_cap_mb: fusion threshold (DDP's default).
    """

    def __init__(
        self,
        params: Iterable[nn.Parameter],
        *,
        group: Any,
        bucket_cap_mb: float = DDP_DEFAULT_BUCKET_MB,
    ) -> None:
        # reverse registration order: about the order backward produces gradients
        self.params = [p for p in params if p.requires_grad][::-1]
        self.group = group
        self.size = ops.world_size(group)
        self.planner = ThresholdPlanner(threshold_bytes=int(bucket_cap_mb * 2**20))
        self.enabled = True

    def sync(self) -> None:
        """Average every gradient in place; parameters without a gradient count as zero."""
        if self.size == 1 or not self.enabled:
            return
        grads = []
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(local_tensor(p.grad))
        items = [
            FusionItem(name=str(i), nbytes=g.numel() * g.element_size())
            for i, g in enumerate(grads)
        ]
        pending = []
        for b, bucket in enumerate(self.planner.plan(items)):
            flat = torch.cat([grads[i].reshape(-1) for i in bucket])
            flat.div_(self.size)
            pending.append(
                (bucket, flat, ops.all_reduce(flat, group=self.group, name=f"dp grad b{b}"))
            )
        for bucket, flat, fut in pending:
            ops.wait(fut)  # raises CollectiveError if a peer is gone: never keep local grads
            offset = 0
            for i in bucket:
                n = grads[i].numel()
                grads[i].copy_(flat[offset : offset + n].view_as(grads[i]))
                offset += n
