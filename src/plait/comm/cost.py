"""The alpha-beta cost model of collective communication.

A message of w bytes costs alpha + w * beta: a start-up latency and a per-byte time on a
link. A collective is a sequence of such messages (`latency_steps`) moving `wire_bytes`
per worker, so its time is ``steps * alpha + wire * beta``. The model is fitted from
measured collectives (`plait cluster probe`, the benchmark harness), and drives the fusion
planners (merge two buffers when the saved start-up beats the wait), the SPD-KFAC
planner and the automatic parallelism planner.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from enum import StrEnum

import numpy as np

from plait.comm.stats import Collective, CollectiveRecord, latency_steps, wire_bytes


class Algorithms(StrEnum):
    """The algorithms a backend runs each collective with, as the model prices them.

    ``ring``: the bandwidth-optimal ones NCCL uses for large messages (ring all-reduce,
    all-gather and reduce-scatter, pipelined broadcast), as `plait.comm.stats` counts them.
    ``gloo``: gloo's, where they differ: a binomial-tree broadcast (the root sends the whole
    buffer once per tree level, ceil(log2 p) times in a row) and a reduce-scatter that is
    an all-reduce of the whole buffer followed by a local slice (ProcessGroupGloo).
    """

    RING = "ring"
    GLOO = "gloo"


@dataclass(frozen=True, kw_only=True)
class AlphaBeta:
    """Latency `alpha` (seconds per message) and inverse bandwidth `beta` (seconds per byte)."""

    alpha: float
    beta: float

    def __post_init__(self) -> None:
        if self.alpha < 0 or self.beta < 0:
            raise ValueError(f"alpha and beta must be >= 0, got {self.alpha}, {self.beta}")

    @classmethod
    def from_rate(cls, rate_bps: float, *, alpha: float = 50e-6) -> AlphaBeta:
        """A model of a link of `rate_bps` bits per second."""
        return cls(alpha=alpha, beta=8.0 / rate_bps)

    @property
    def bandwidth_bps(self) -> float:
        """Link bandwidth in bits per second implied by beta."""
        return float("inf") if self.beta == 0 else 8.0 / self.beta

    def time(self, op: Collective, nbytes: float, world: int) -> float:
        """Seconds for one collective on `nbytes` of payload among `world` workers."""
        return (
            latency_steps(op, world) * self.alpha + wire_bytes(op, int(nbytes), world) * self.beta
        )

    def time_as(self, algorithms: Algorithms, op: Collective, nbytes: float, world: int) -> float:
        """Seconds for one collective run with `algorithms` (see `Algorithms`)."""
        if algorithms is Algorithms.GLOO and world > 1:
            if op is Collective.BROADCAST:
                return math.ceil(math.log2(world)) * (self.alpha + nbytes * self.beta)
            if op is Collective.REDUCE_SCATTER:
                return self.time(Collective.ALL_REDUCE, nbytes, world)
        return self.time(op, nbytes, world)

    def total(self, records: Iterable[CollectiveRecord]) -> float:
        """Seconds of the records run back to back: a lower bound on their communication."""
        return sum(self.time(r.op, r.nbytes, r.world) for r in records)

    @classmethod
    def fit(cls, samples: Sequence[tuple[Collective, int, int, float]]) -> AlphaBeta:
        """Least-squares fit of (op, payload bytes, world, seconds) samples, both terms >= 0."""
        if len(samples) < 2:
            raise ValueError("fitting alpha-beta needs at least two samples")
        a = np.array(
            [[latency_steps(op, p), wire_bytes(op, n, p)] for op, n, p, _ in samples], dtype=float
        )
        y = np.array([t for *_, t in samples], dtype=float)
        coef, *_ = np.linalg.lstsq(a, y, rcond=None)
        alpha, beta = float(coef[0]), float(coef[1])
        if alpha < 0:  # latency not resolvable: attribute everything to bandwidth
            alpha = 0.0
            beta = float(np.dot(a[:, 1], y) / max(np.dot(a[:, 1], a[:, 1]), 1e-30))
        if beta < 0:
            beta = 0.0
            alpha = float(np.dot(a[:, 0], y) / max(np.dot(a[:, 0], a[:, 0]), 1e-30))
        return cls(alpha=alpha, beta=beta)

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


def wire_bytes_as(algorithms: Algorithms, op: Collective, nbytes: float, world: int) -> float:
    """Bytes one worker sends for a collective run with `algorithms` (the root's, for
    gloo's tree broadcast: once per tree level)."""
    if algorithms is Algorithms.GLOO and world > 1:
        if op is Collective.BROADCAST:
            return math.ceil(math.log2(world)) * nbytes
        if op is Collective.REDUCE_SCATTER:
            return wire_bytes(Collective.ALL_REDUCE, int(nbytes), world)
    return wire_bytes(op, int(nbytes), world)


@dataclass(frozen=True, kw_only=True)
class CollectiveCosts:
    """One alpha-beta model per collective kind, where they differ.

    Backends do not implement every collective as the bandwidth-optimal ring: gloo, for
    one, reduces and scatters by way of an all-reduce, and broadcasts along a tree. Fitted
    per kind on the live network (`plait.comm.probe.probe_collectives`), the models price
    each collective as it really runs; kinds not measured fall back to `default`.
    """

    default: AlphaBeta
    per_op: Mapping[Collective, AlphaBeta] = field(default_factory=dict)

    def model(self, op: Collective) -> AlphaBeta:
        return self.per_op.get(op, self.default)

    def time(self, op: Collective, nbytes: float, world: int) -> float:
        """Seconds for one collective on `nbytes` of payload among `world` workers."""
        return self.model(op).time(op, nbytes, world)

    def to_dict(self) -> dict[str, dict[str, float]]:
        out = {"default": self.default.to_dict()}
        out.update({str(op): m.to_dict() for op, m in self.per_op.items()})
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Mapping[str, float]]) -> CollectiveCosts:
        per_op = {Collective(k): AlphaBeta(**v) for k, v in data.items() if k != "default"}
        return cls(default=AlphaBeta(**data["default"]), per_op=per_op)
