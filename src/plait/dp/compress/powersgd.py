"""Power-SGD (Vogels et al., 2019), fused per bucket and overlapped with backward.

Each step, with M the local gradient plus error feedback and Q the previous step's
all-reduced Q (warm start), orthonormalised:

    P = M Q  -> all-reduce -> orthonormalise P -> Q = M^T P -> all-reduce
    gradient = P Q^T,  error = M - P Q^T

The second all-reduce depends on the first, so it cannot be issued from the DDP hook.
PyTorch's own hook issues it from the first one's future callback, which on gloo breaks
as soon as two buckets are in flight (the callbacks run on whichever thread finishes a
collective, so ranks disagree on the order). Here the hook computes P on the autograd
thread and hands the rest of the bucket's pipeline to a `CollectiveQueue`: one FIFO
communication thread issues every collective in bucket order on every rank, while
backward carries on. The queue talks on its own process group, so DDP's own collectives
(the unused-parameter map) cannot interleave with it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._C._distributed_c10d import GradBucket

from plait.comm import CollectiveQueue, all_reduce, wait, world_size
from plait.distributed import new_group
from plait.dp.compress.lowrank import (
    BucketPlan,
    LowRankCompressor,
    Phase,
    orthonormalize_rows_,
    write_product_,
)
from plait.trace import COMPRESS, span, tracer


def duplicate_group(group: Any) -> Any:
    """A new process group over the ranks of `group` (collective: call on every rank).

    It carries plait's collective timeout (`plait.distributed.new_group`), so a stopped
    peer fails the step instead of hanging it for torch's 30-minute default.
    """
    if not dist.is_initialized():
        return group
    ranks = None if group is None else dist.get_process_group_ranks(group)
    return new_group(ranks)


class PowerSGD(LowRankCompressor):
    """Power-SGD with fused buckets; see the module docstring.

    Args:
        timeout_s: how long a step may wait for its collectives before failing.
        **options: as `LowRankCompressor` (rank, min_compression_rate, layer_ranks,
            warmup, seed).
    """

    name = "powersgd"

    def __init__(
        self,
        *,
        group: Any = None,
        rank: int = 4,
        min_compression_rate: float = 2.0,
        layer_ranks: str | Mapping[str, int] | None = None,
        warmup: int | None = None,
        seed: int = 0,
        timeout_s: float = 600.0,
    ) -> None:
        super().__init__(
            group=group,
            rank=rank,
            min_compression_rate=min_compression_rate,
            layer_ranks=layer_ranks,
            warmup=warmup,
            seed=seed,
        )
        self.queue = CollectiveQueue(name="powersgd", timeout_s=timeout_s)
        self._comm_group: Any = None
        self._has_comm_group = False

    def register(self, ddp: nn.parallel.DistributedDataParallel) -> None:
        self._ensure_group()  # every rank constructs DDP at the same point: safe to create
        super().register(ddp)

    def _ensure_group(self) -> Any:
        if not self._has_comm_group:
            self._comm_group = duplicate_group(self.group)
            self._has_comm_group = True
        return self._comm_group

    def hook(self, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
        phase = self.begin(bucket)
        group = self._ensure_group()
        index = bucket.index()
        p = world_size(group)
        if phase is Phase.DENSE:
            buf = bucket.buffer()
            buf.div_(p)
            return self.queue.submit(
                lambda: wait(all_reduce(buf, group=group, name=f"allreduce b{index}")),
                name=f"dense b{index}",
            )
        grads = bucket.gradients()
        plan = self.plan(bucket, grads)
        p_wire = plan.wire_buffer("p")
        q_wire = plan.wire_buffer("q", dense=False)
        with span(f"compress b{index}", COMPRESS, phase="p"):
            ps = encode_p(plan, grads, p_wire)
            p_wire.div_(p)

        def pipeline() -> torch.Tensor:
            wait(all_reduce(p_wire, group=group, name=f"allreduce P b{index}"))
            with span(f"compress Q b{index}", COMPRESS):
                qs = encode_q(plan, ps, q_wire)
                q_wire.div_(p)
            if q_wire.numel():
                wait(all_reduce(q_wire, group=group, name=f"allreduce Q b{index}"))
            start = tracer.now_us()
            decode(plan, grads, ps, qs, p_wire)
            tracer.add(f"decompress b{index}", COMPRESS, start, tracer.now_us())
            return bucket.buffer()

        return self.queue.submit(pipeline, name=f"powersgd b{index}")

    def close(self) -> None:
        self.queue.close()


def encode_p(
    plan: BucketPlan, grads: Sequence[torch.Tensor], p_wire: torch.Tensor
) -> list[torch.Tensor]:
    """Power-SGD's first half into `p_wire`: per matrix group, error := M + error and
    P = M Q on last step's Q, orthonormalised (warm start), then the uncompressed tensors.
    Returns the groups' P views of `p_wire`."""
    ps = plan.factor_views(p_wire, "p")
    for g, send in zip(plan.groups, ps, strict=True):
        torch._foreach_add_(g.errors, g.matrices(grads))  # error := M + error
        orthonormalize_rows_(g.q)  # warm start from last step's Q
        torch.bmm(g.q, g.error.transpose(1, 2), out=send)  # P^T = Q^T M^T
    plan.pack_dense(grads, p_wire)
    return ps


def encode_q(
    plan: BucketPlan, ps: Sequence[torch.Tensor], q_wire: torch.Tensor
) -> list[torch.Tensor]:
    """Power-SGD's second half, once P is averaged: orthonormalise P and compute
    Q = M^T P into `q_wire`. Returns the groups' Q views of `q_wire`."""
    qs = plan.factor_views(q_wire, "q")
    for g, pt, qt in zip(plan.groups, ps, qs, strict=True):
        orthonormalize_rows_(pt)
        torch.bmm(pt, g.error, out=qt)  # Q^T = P^T M
    return qs


def decode(
    plan: BucketPlan,
    grads: Sequence[torch.Tensor],
    ps: Sequence[torch.Tensor],
    qs: Sequence[torch.Tensor],
    p_wire: torch.Tensor,
) -> None:
    """Write P Q^T (both averaged) into `grads` and the averaged uncompressed tensors;
    keep error := M - P Q^T and Q for the next step's warm start."""
    for g, pt, qt in zip(plan.groups, ps, qs, strict=True):
        mats = g.matrices(grads)
        for j, mat in enumerate(mats):
            write_product_(mat, pt[j].t(), qt[j])
        torch._foreach_sub_(g.errors, mats)  # error := M - P Q^T
        g.q.copy_(qt)
    plan.unpack_dense(grads, p_wire)
