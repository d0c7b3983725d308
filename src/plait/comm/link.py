"""A modelled link: where no namespace can be shaped, plait's collectives take the time a
shaped link would give them.

The emulated cluster shapes each node's link with tc inside a network namespace. Where
that is impossible (no root or CAP_NET_ADMIN, no ``ip``/``tc``, gVisor's network stack)
the nodes run on loopback, and this module makes plait's collectives behave as if they
crossed a link of the configured rate: every collective issued through `plait.comm.ops`
still runs for real (so results are right and peers still wait for each other), and its
future completes no earlier than the time the alpha-beta model gives it on the link.

A link behaves like a wire, not like a sleep:

- **Serialised.** Each process has one outgoing link: a collective's transfer starts when
  it is issued or when the link finishes the previous transfer, whichever is later (one
  NIC, several process groups: DDP's buckets, K-FAC's factors and Power-SGD's queue share
  it, as they share a node's veth under tc).
- **Overlapping with compute.** Nothing blocks the issuing thread: the future is completed
  later by a timer thread, so backward keeps computing while buckets are "in flight", as
  it does while a real NIC sends them.
- **Never faster than the real collective.** The future completes at
  ``max(real completion, transfer end)``: a peer that issues late still holds everyone up.

The model prices gloo's algorithms (`Algorithms.GLOO`): ring all-reduce and all-gather,
tree broadcast, reduce-scatter as an all-reduce, with a per-byte time of the rate plus the
TCP/IP and Ethernet headers a tc token bucket counts (`FRAMING`). The launcher enables it
for the workers (``PLAIT_LINK=model`` with the node's ``PLAIT_RATE`` and
``PLAIT_LATENCY``); `configure` and `current` do it in a process of one's own.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from plait.comm.cost import Algorithms, AlphaBeta
from plait.comm.stats import Collective
from plait.units import parse_duration, parse_rate

logger = logging.getLogger(__name__)

#: ``PLAIT_LINK``: ``model`` makes this process's collectives take the modelled link's time.
LINK_ENV = "PLAIT_LINK"
#: The node's link rate (tc syntax) and one-way added delay, as the launcher exports them.
RATE_ENV = "PLAIT_RATE"
LATENCY_ENV = "PLAIT_LATENCY"

#: Wire bytes per payload byte of a TCP stream over Ethernet with a 1500-byte MTU, as a tc
#: token bucket counts them: 1448 payload bytes (20 of IP and 32 of TCP with timestamps
#: taken out of 1500) travel in frames of 1514 (14 of Ethernet header). The tc-shaped links
#: here measure 94-96% of their rate as all-reduce bus bandwidth (benchmarks/RESULTS.md,
#: "Link shaping"); 1448/1514 is 95.6%.
FRAMING = 1514 / 1448

#: Start-up time of one message on the link itself (the real collective's own host costs
#: are paid by running it): propagation and queueing on a veth pair, tens of microseconds.
LINK_ALPHA_S = 50e-6


def link_model(rate_bps: float, *, latency_s: float = 0.0) -> AlphaBeta:
    """The alpha-beta model of a tc-shaped TCP link of `rate_bps` with `latency_s` added
    one-way delay (paid once per message, like netem's)."""
    if rate_bps <= 0:
        raise ValueError(f"link rate must be > 0 bit/s, got {rate_bps}")
    if latency_s < 0:
        raise ValueError(f"link latency must be >= 0 s, got {latency_s}")
    return AlphaBeta(alpha=LINK_ALPHA_S + latency_s, beta=8.0 * FRAMING / rate_bps)


@dataclass(frozen=True, order=True)
class _Due:
    """A future to complete at `at` (ties in issue order); ordered for the heap."""

    at: float
    seq: int
    future: torch.futures.Future[Any] = field(compare=False)
    value: Any = field(compare=False)


class ModelledLink:
    """One process's outgoing link (see the module docstring).

    Args:
        model: the link's alpha-beta model (`link_model`).
        algorithms: the collective algorithms it prices (gloo's by default).
        clock: seconds, monotonic (tests pass a fake one).
    """

    def __init__(
        self,
        model: AlphaBeta,
        *,
        algorithms: Algorithms = Algorithms.GLOO,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.model = model
        self.algorithms = algorithms
        self.clock = clock
        self._free_at = 0.0
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)
        self._heap: list[_Due] = []
        self._seq = itertools.count()
        self._thread: threading.Thread | None = None
        self.modelled_s = 0.0  # the link's busy time so far (reports and tests)

    def transfer_s(self, op: Collective, nbytes: float, world: int) -> float:
        """Seconds the link needs for one collective of `nbytes` payload among `world`."""
        return self.model.time_as(self.algorithms, op, nbytes, world)

    def reserve(self, op: Collective, nbytes: float, world: int, *, issued_at: float) -> float:
        """Book the collective on the wire; return when its transfer ends."""
        with self._lock:
            start = max(issued_at, self._free_at)
            cost = self.transfer_s(op, nbytes, world)
            self._free_at = start + cost
            self.modelled_s += cost
            return self._free_at

    def delay(
        self, fut: torch.futures.Future[Any], *, ends_at: float, device: torch.device | None = None
    ) -> torch.futures.Future[Any]:
        """A future of `fut`'s value that completes at ``max(fut's completion, ends_at)``.

        A failed `fut` fails the returned future at once. CUDA results are synchronised with
        the completing stream before they are handed to the timer thread.
        """
        cuda = device is not None and device.type == "cuda"
        out: torch.futures.Future[Any] = (
            torch.futures.Future(devices=[device])
            if device is not None and cuda
            else torch.futures.Future()
        )

        def landed(done: torch.futures.Future[Any]) -> None:
            try:
                value = done.value()
                if cuda:
                    torch.cuda.current_stream().synchronize()
                self._schedule(ends_at, out, value)
            except Exception as exc:  # never delay a failure: the waiters must raise now
                if not out.done():
                    out.set_exception(exc)

        fut.add_done_callback(landed)
        return out

    def _schedule(self, at: float, future: torch.futures.Future[Any], value: Any) -> None:
        if at <= self.clock():
            future.set_result(value)
            return
        with self._cv:
            heapq.heappush(self._heap, _Due(at, next(self._seq), future, value))
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="plait-link", daemon=True)
                self._thread.start()
            self._cv.notify()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._heap:
                    self._cv.wait()
                wait_s = self._heap[0].at - self.clock()
                if wait_s > 0:
                    self._cv.wait(timeout=wait_s)
                    continue
                due = heapq.heappop(self._heap)
            # completing runs the future's callbacks (a compressor's decompression) here,
            # as a real backend runs them on its own thread; their errors go to their own
            # futures, and nothing may stop this thread while others wait on it
            try:
                due.future.set_result(due.value)
            except Exception:
                logger.exception("modelled link: completing a collective's future failed")

    def describe(self) -> str:
        rate = self.model.bandwidth_bps / FRAMING
        return (
            f"modelled link: {rate / 1e6:g} Mbit/s, {1e6 * self.model.alpha:g} us per message, "
            f"{self.algorithms} algorithms"
        )


_current: list[ModelledLink | None] = []
_current_lock = threading.Lock()


def from_env() -> ModelledLink | None:
    """The link ``PLAIT_LINK=model`` with ``PLAIT_RATE`` (and ``PLAIT_LATENCY``) describe.

    Raises:
        ValueError: ``PLAIT_LINK`` is another value, or the rate is missing or malformed.
    """
    kind = os.environ.get(LINK_ENV, "").strip().lower()
    if kind in ("", "tc", "none"):
        return None
    if kind != "model":
        raise ValueError(f"{LINK_ENV}={kind!r}: expected model, tc or none")
    rate = os.environ.get(RATE_ENV, "").strip()
    if not rate:
        raise ValueError(f"{LINK_ENV}=model needs the link's rate in {RATE_ENV} (e.g. 100mbit)")
    latency = os.environ.get(LATENCY_ENV, "").strip()
    return ModelledLink(
        link_model(parse_rate(rate), latency_s=parse_duration(latency) if latency else 0.0)
    )


def current() -> ModelledLink | None:
    """This process's modelled link, read from the environment on first use (or None)."""
    with _current_lock:
        if not _current:
            link = from_env()
            if link is not None:
                logger.info("%s (%s=model)", link.describe(), LINK_ENV)
            _current.append(link)
        return _current[0]


def configure(link: ModelledLink | None) -> None:
    """Use `link` for this process's collectives from now on (None: the real link only)."""
    with _current_lock:
        _current[:] = [link]
