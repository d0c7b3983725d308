"""`KFACCosts`: the measured prices K-FAC's placement and fusion decisions are made from.

Distributed K-FAC decides who inverts which factor, whether a small factor is inverted by
every worker instead of broadcast, which distribution (comm-opt, mem-opt, hybrid) is the
cheapest, and how factor all-reduces are fused. Every one of those decisions weighs
communication against computation, so it needs three numbers: the alpha-beta model of the
links, the seconds per n^3 of a decomposition, and the seconds per matmul flop.

They are an object of their own, not something the preconditioner measures as a side
effect of being built, so that they can be

- measured on the live group (`KFACCosts.measure`, collective: every rank calls it),
- saved and loaded as JSON (`save`, `load`) to reuse one measurement across jobs or to
  reproduce a placement exactly, or
- given by hand (``KFACCosts(link=AlphaBeta.from_rate(1e8), inverse_s_per_n3=1e-10,
  flop_s=1e-11)``), which is how the decisions are unit-tested without any process group.

Every rank must hold the same costs (placement is computed on every rank and must agree):
`measure` averages its timings over the group, and a loaded or hand-given object is the
same everywhere by construction.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from plait import comm
from plait.comm.cost import AlphaBeta
from plait.kfac.factors import Method, decompose
from plait.kfac.layers import FactorShape

logger = logging.getLogger(__name__)

#: The link assumed when the network is not probed: 1 Gbit/s with 50 us latency.
DEFAULT_LINK = AlphaBeta.from_rate(1e9)

#: Side of the matrix whose decomposition and product are timed by `measure`: large enough
#: that the n^3 term dominates call overhead, small enough to take milliseconds.
_TIMED_SIDE = 256

#: Payloads of the start-up link probe (bytes): three points for the alpha-beta fit.
_PROBE_SIZES = (16 * 1024, 128 * 1024, 1024 * 1024)


@dataclass(frozen=True, kw_only=True)
class KFACCosts:
    """Link and compute prices of one job.

    Attributes:
        link: alpha-beta model of the data-parallel group's links.
        inverse_s_per_n3: seconds per n^3 of decomposing a factor of side n.
        flop_s: seconds per floating-point operation of a matrix product.
        source: where the numbers came from (``measured``, ``given``, a file), for reports.
    """

    link: AlphaBeta
    inverse_s_per_n3: float
    flop_s: float
    source: str = "given"

    def __post_init__(self) -> None:
        if not isinstance(self.link, AlphaBeta):
            raise ValueError(f"link must be an AlphaBeta, got {type(self.link).__name__}")
        for name in ("inverse_s_per_n3", "flop_s"):
            v = getattr(self, name)
            if not isinstance(v, int | float) or isinstance(v, bool) or not v > 0:
                raise ValueError(f"{name} must be a number > 0, got {v!r}")

    # ------------------------------------------------------------------ measuring
    @classmethod
    def measure(
        cls, group: Any = None, *, method: Method | str = Method.INVERSE, probe_links: bool = True
    ) -> KFACCosts:
        """Time a decomposition and a product here, and probe the links of `group`.

        Collective when the group has more than one rank: every rank must call it, and every
        rank gets the same result (compute rates averaged over ranks, link fitted from the
        slowest rank's timings). On one process nothing is communicated.

        Args:
            group: the process group (None: the default group, if one is initialised).
            method: the decomposition to time (``inverse`` or ``eigen``).
            probe_links: fit the alpha-beta model on the live group; otherwise assume
                `DEFAULT_LINK` (the probe costs a few collectives at start-up).
        """
        distributed = dist.is_available() and dist.is_initialized()
        world = dist.get_world_size(group) if distributed else 1
        inverse_s, flop_s = _time_compute(Method(method))
        inverse_s, flop_s = comm.reduce_floats(
            [inverse_s, flop_s], op="mean", group=group, name="kfac rates"
        )
        link = DEFAULT_LINK
        if world > 1 and probe_links:
            from plait.comm.probe import probe_allreduce

            link = probe_allreduce(sizes=_PROBE_SIZES, repeats=2, group=group).model
        costs = cls(
            link=link,
            inverse_s_per_n3=inverse_s,
            flop_s=flop_s,
            source="measured" if probe_links and world > 1 else "measured compute",
        )
        logger.debug("K-FAC costs: %s", costs)
        return costs

    # ------------------------------------------------------------------ files
    def to_dict(self) -> dict[str, Any]:
        return {
            "link": self.link.to_dict(),
            "inverse_s_per_n3": self.inverse_s_per_n3,
            "flop_s": self.flop_s,
            "source": self.source,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> KFACCosts:
        """Inverse of `to_dict`.

        Raises:
            ValueError: a missing or malformed field (named).
        """
        try:
            link = AlphaBeta(**dict(data["link"]))
            return cls(
                link=link,
                inverse_s_per_n3=float(data["inverse_s_per_n3"]),
                flop_s=float(data["flop_s"]),
                source=str(data.get("source", "given")),
            )
        except KeyError as exc:
            raise ValueError(f"K-FAC costs lack the field {exc.args[0]!r}") from None
        except TypeError as exc:
            raise ValueError(f"malformed K-FAC costs: {exc}") from None

    def save(self, path: str | Path) -> None:
        """Write the costs as JSON (to load in a later job with `load`)."""
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> KFACCosts:
        """Read costs written by `save`; the source becomes the file's path.

        Raises:
            ValueError: the file is not valid JSON or lacks a field.
        """
        p = Path(path)
        try:
            data = json.loads(p.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{p}: not a K-FAC costs file ({exc})") from None
        if not isinstance(data, dict):
            raise ValueError(f"{p}: not a K-FAC costs file (expected a JSON object)")
        return cls.from_dict({**data, "source": str(p)})


def _time_compute(method: Method) -> tuple[float, float]:
    """Seconds per n^3 of a decomposition and per matmul flop, on this process."""
    n = _TIMED_SIDE
    x = torch.randn(n, n, generator=torch.Generator().manual_seed(0))
    spd = x @ x.T / n + torch.eye(n)
    shape = FactorShape(dim=n)

    def timed(fn: Callable[[], Any]) -> float:
        fn()
        t0 = time.perf_counter()
        for _ in range(3):
            fn()
        return (time.perf_counter() - t0) / 3

    inv = timed(lambda: decompose(spd, shape, method=method, damping=1e-3, packed=False))
    mm = timed(lambda: x @ spd)
    # a clock too coarse for the kernel still gives a positive (if rough) rate
    return max(inv, 1e-9) / n**3, max(mm, 1e-9) / (2 * n**3)
