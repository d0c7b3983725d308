"""Tensor-fusion planners: which tensors travel together in one collective.

One collective per tensor pays the start-up latency alpha many times; one collective for
everything cannot start until the last tensor is ready. A planner partitions an ordered
list of tensors (in the order they become ready) into consecutive buckets. Every strategy
plans its buffers here: DDP gradient buckets (via `ddp_bucket_caps`), compressed ACP-SGD
buffers (threshold scaled by the compression ratio) and K-FAC factor buckets.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from plait.comm.cost import AlphaBeta
from plait.comm.stats import Collective, latency_steps

#: DDP's own default bucket cap, and its small bucket for the gradients ready last.
DDP_DEFAULT_BUCKET_MB = 25.0
DDP_DEFAULT_FINAL_BUCKET_MB = 1.0


@dataclass(frozen=True, kw_only=True)
class FusionItem:
    """One tensor to communicate.

    Attributes:
        name: for reports and traces.
        nbytes: bytes it adds to a bucket (after compression, if any).
        ready_s: when it becomes ready, seconds from the start of the step (dynamic
            planners use it; static ones ignore it).
    """

    name: str
    nbytes: int
    ready_s: float = 0.0


BucketPlan = list[list[int]]


class FusionPlanner(Protocol):
    """Partition items (in ready order) into consecutive buckets of indices."""

    def plan(self, items: Sequence[FusionItem]) -> BucketPlan: ...


@dataclass(frozen=True, kw_only=True)
class ThresholdPlanner:
    """Static fusion: close a bucket once it holds `threshold_bytes` (Horovod, DDP, KAISA).

    Args:
        threshold_bytes: bucket capacity; <= 0 means one bucket per item.
        final_bytes: if > 0, the items ready last form a bucket of their own of at most
            this size (and of the threshold; at least one item): whatever that bucket holds
            can only be reduced after the last item is ready, so a small one shortens the
            exposed tail of a step (DDP's 1 MiB bucket plays this role).
    """

    threshold_bytes: int
    final_bytes: int = 0

    def plan(self, items: Sequence[FusionItem]) -> BucketPlan:
        n = len(items)
        split = n
        final = min(self.final_bytes, self.threshold_bytes)  # never above a regular bucket
        if final > 0 and n > 1:
            size = 0
            while split > 0 and size + items[split - 1].nbytes <= final:
                split -= 1
                size += items[split].nbytes
            split = min(split, n - 1)  # the final bucket holds at least one item
        buckets: BucketPlan = []
        current: list[int] = []
        size = 0
        for i in range(split):
            current.append(i)
            size += items[i].nbytes
            if size >= self.threshold_bytes:
                buckets.append(current)
                current, size = [], 0
        if current:
            buckets.append(current)
        if split < n:
            buckets.append(list(range(split, n)))
        return buckets

    def scaled(self, ratio: float) -> ThresholdPlanner:
        """The same planner for data compressed by `ratio` (compressed/original bytes).

        A compressed buffer is smaller, so a threshold scaled by the same ratio keeps the
        number of buckets (and hence the overlap with backward) equal to uncompressed S-SGD.
        """
        if ratio <= 0:
            raise ValueError(f"compression ratio must be > 0, got {ratio}")
        return ThresholdPlanner(
            threshold_bytes=max(1, int(self.threshold_bytes * ratio)),
            final_bytes=int(self.final_bytes * ratio) if self.final_bytes > 0 else 0,
        )


@dataclass(frozen=True, kw_only=True)
class ReadyTimePlanner:
    """Dynamic fusion from ready times (SPD-KFAC, after MG-WFBP): merge when waiting is free.

    Walk the items in ready order, simulating one communication channel priced by the
    alpha-beta model. The open bucket could start at ``max(its last item's ready time, the
    channel's free time)``. The next item joins it when it is ready by then (merging costs
    nothing: the bucket would have waited for the channel anyway), or when the wait is
    shorter than the start-up latency one more collective would pay; otherwise the bucket
    closes and occupies the channel for its modelled time. Small tensors produced in quick
    succession thus travel together, while a tensor ready long after its predecessor starts
    its own collective instead of holding the others back.

    Args:
        cost: the alpha-beta model of the group's links.
        world: workers in the collective.
        op: the collective the buckets travel in.
    """

    cost: AlphaBeta
    world: int
    op: Collective = Collective.ALL_REDUCE

    @property
    def startup_s(self) -> float:
        """The latency one more collective costs: its alpha term."""
        return latency_steps(self.op, self.world) * self.cost.alpha

    def plan(self, items: Sequence[FusionItem]) -> BucketPlan:
        if not items:
            return []
        buckets: BucketPlan = []
        current, size = [0], items[0].nbytes
        channel_free = 0.0
        for i in range(1, len(items)):
            start = max(items[current[-1]].ready_s, channel_free)
            if items[i].ready_s - start <= self.startup_s:
                current.append(i)
                size += items[i].nbytes
                continue
            channel_free = start + self.cost.time(self.op, size, self.world)
            buckets.append(current)
            current, size = [i], items[i].nbytes
        buckets.append(current)
        return buckets

    def makespan(self, items: Sequence[FusionItem], plan: BucketPlan) -> float:
        """Modelled time at which the last bucket of `plan` finishes."""
        free = 0.0
        for bucket in plan:
            start = max(free, *(items[i].ready_s for i in bucket))
            free = start + self.cost.time(self.op, sum(items[i].nbytes for i in bucket), self.world)
        return free


def bucket_sizes(items: Sequence[FusionItem], plan: BucketPlan) -> list[int]:
    """Bytes per planned bucket."""
    return [sum(items[i].nbytes for i in bucket) for bucket in plan]


def check_plan(plan: BucketPlan, n: int) -> None:
    """Assert a plan is a partition of range(n) into consecutive buckets (internal check)."""
    flat = [i for bucket in plan for i in bucket]
    assert flat == list(range(n)), f"fusion plan is not an ordered partition of {n} items"


def ddp_bucket_caps_mb(
    planner: FusionPlanner,
    sizes_in_ready_order: Sequence[int],
    *,
    wire_sizes: Sequence[float] | None = None,
) -> list[float]:
    """Per-bucket caps (MiB) that make DDP form exactly the planner's buckets.

    DDP fills buckets with parameters in reverse registration order (about the order their
    gradients become ready) and closes a bucket once it reaches its cap, so caps equal to
    the planned bucket sizes reproduce the plan; pass them as ``bucket_cap_mb_list``.

    Args:
        planner: plans the buckets.
        sizes_in_ready_order: gradient bytes per parameter (what DDP's caps count).
        wire_sizes: bytes each parameter actually sends, if compressed; the planner then
            plans on these (with a threshold scaled by the compression ratio this keeps
            the bucket count of uncompressed S-SGD), and the caps still count gradients.
    """
    planned = sizes_in_ready_order if wire_sizes is None else wire_sizes
    if len(planned) != len(sizes_in_ready_order):
        raise ValueError(f"{len(planned)} wire sizes for {len(sizes_in_ready_order)} tensors")
    items = [FusionItem(name=str(i), nbytes=math.ceil(n)) for i, n in enumerate(planned)]
    caps = [FusionItem(name=str(i), nbytes=n) for i, n in enumerate(sizes_in_ready_order)]
    return [size / 2**20 for size in bucket_sizes(caps, planner.plan(items))]
