"""Per-collective byte counters.

Every collective plait issues goes through `plait.comm.ops`, which records its kind,
payload and group size here. From those records follow the bytes a worker sends (under
the bandwidth-optimal ring algorithms gloo and NCCL use for large messages) and, with an
`AlphaBeta` model, a lower bound on the step's communication time.
"""

from __future__ import annotations

import contextvars
import math
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import StrEnum


class Collective(StrEnum):
    """Collective kinds with a cost model."""

    ALL_REDUCE = "all_reduce"
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    BROADCAST = "broadcast"
    ALL_TO_ALL = "all_to_all"
    BARRIER = "barrier"
    SEND = "send"


def wire_bytes(op: Collective, nbytes: int, world: int) -> float:
    """Bytes one worker sends for a collective on `nbytes` of its own payload.

    `nbytes` is the tensor the worker hands in: the whole buffer for all-reduce,
    reduce-scatter and broadcast, the worker's own shard for all-gather.
    """
    p = world
    if p <= 1 or op is Collective.BARRIER:
        return 0.0
    if op is Collective.ALL_REDUCE:
        return 2.0 * (p - 1) / p * nbytes
    if op is Collective.ALL_GATHER:
        return float((p - 1) * nbytes)
    if op in (Collective.REDUCE_SCATTER, Collective.ALL_TO_ALL):
        return (p - 1) / p * nbytes
    if op is Collective.BROADCAST:
        return float(nbytes)  # pipelined chain: every rank but the last forwards it once
    if op is Collective.SEND:
        return float(nbytes)
    raise AssertionError(op)


def latency_steps(op: Collective, world: int) -> int:
    """Sequential message start-ups of the algorithm (the alpha term's multiplier)."""
    p = world
    if p <= 1:
        return 0
    if op is Collective.ALL_REDUCE:
        return 2 * (p - 1)
    if op in (Collective.ALL_GATHER, Collective.REDUCE_SCATTER, Collective.ALL_TO_ALL):
        return p - 1
    if op in (Collective.BROADCAST, Collective.BARRIER):
        return math.ceil(math.log2(p))
    return 1


#: Who a collective is counted for (see `CommStats.owned_by`); None outside such a block.
_owner: contextvars.ContextVar[object | None] = contextvars.ContextVar(
    "plait_comm_owner", default=None
)


@dataclass(frozen=True, slots=True)
class CollectiveRecord:
    op: Collective
    nbytes: int
    world: int
    owner: object | None = field(default=None, compare=False)

    @property
    def wire_bytes(self) -> float:
        return wire_bytes(self.op, self.nbytes, self.world)


@dataclass
class CommStats:
    """Thread-safe accumulation of collective records (communication threads add too)."""

    records: list[CollectiveRecord] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, op: Collective, nbytes: int, world: int) -> None:
        record = CollectiveRecord(op, int(nbytes), int(world), _owner.get())
        with self._lock:
            self.records.append(record)

    @contextmanager
    def owned_by(self, owner: object) -> Iterator[None]:
        """Tag the collectives issued inside the block, and those of the jobs it hands
        to a `plait.comm.CollectiveQueue` (which run them in the submitter's context),
        with `owner`, wherever and whenever they run.

        A time window cannot attribute communication that outlives it: when a race
        switches entries while one entry's exchange is still on its communication thread,
        the exchange lands in another entry's window (streaming DiLoCo lost about 40% of
        its bytes that way). Collectives issued from a torch future's callback on a
        backend thread (PyTorch's Power-SGD hook) do not carry the tag; they finish
        within the step that issued them, so a window still catches them.
        """
        token = _owner.set(owner)
        try:
            yield
        finally:
            _owner.reset(token)

    def owned(self, owner: object) -> list[CollectiveRecord]:
        """Every record tagged with `owner` so far."""
        with self._lock:
            return [r for r in self.records if r.owner is owner]

    def reset(self) -> list[CollectiveRecord]:
        """Clear and return the records so far."""
        with self._lock:
            out, self.records = self.records, []
        return out

    @property
    def payload_bytes(self) -> int:
        with self._lock:
            return sum(r.nbytes for r in self.records)

    @property
    def wire_bytes(self) -> float:
        with self._lock:
            return sum(r.wire_bytes for r in self.records)

    @property
    def calls(self) -> int:
        with self._lock:
            return len(self.records)

    @contextmanager
    def window(self) -> Iterator[list[CollectiveRecord]]:
        """Collect the records made inside the block into the yielded list."""
        with self._lock:
            start = len(self.records)
        out: list[CollectiveRecord] = []
        try:
            yield out
        finally:
            with self._lock:
                out.extend(self.records[start:])


#: The process-wide counters.
stats = CommStats()
