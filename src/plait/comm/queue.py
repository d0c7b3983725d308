"""An ordered asynchronous collective queue.

Gloo pairs collectives by issue order, so every rank must issue the same collectives in
the same order. Code that issues its second collective from the first one's callback (as
PyTorch's own PowerSGD hook does) breaks that rule as soon as two buckets are in flight:
callbacks run on whichever thread completes the previous work. A `CollectiveQueue` is the
fix: callers submit *jobs* (functions that issue collectives and compute between them)
and one communication thread per queue runs them strictly first-in first-out, so the order
is the submission order on every rank while the caller (say, backward) keeps computing.

Jobs return values through `torch.futures.Future`, the type DDP comm hooks return. A job
that raises fails its future with a real future error (so DDP, which reads the future in
C++, raises it), and every later job fails at once without running: the ranks' collective
sequences have diverged, and running more collectives could only hang or mix them up.
`drain` re-raises the first failure until the queue is closed.
"""

from __future__ import annotations

import contextvars
import functools
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from plait.comm.ops import CollectiveError
from plait.trace import COMM, tracer

T = TypeVar("T")
_STOP = object()
logger = logging.getLogger(__name__)


class _Failed:
    """A job's exception, carried as a value to the future's error-raising callback."""

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


def _unwrap(done: torch.futures.Future[Any]) -> Any:
    value = done.value()
    if isinstance(value, _Failed):
        raise value.exc
    return value


class CollectiveQueue:
    """One FIFO communication thread; see the module docstring.

    Args:
        name: thread name (also the track name in traces).
        timeout_s: `drain` gives up after this long and raises TimeoutError, so a peer
            that never arrives cannot hang the caller forever.
    """

    def __init__(self, *, name: str = "comm", timeout_s: float = 600.0) -> None:
        self.name = name
        self.timeout_s = timeout_s
        self._jobs: queue.Queue[Any] = queue.Queue()
        self._pending = 0
        self._cv = threading.Condition()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def _ensure_thread(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
            self._thread.start()

    def submit(
        self, fn: Callable[..., T], *args: Any, name: str | None = None
    ) -> torch.futures.Future[T]:
        """Run ``fn(*args)`` on the communication thread after every earlier job.

        The returned future yields ``fn``'s result, or fails with the exception ``fn``
        raised (a RuntimeError naming it when seen through torch's future machinery).
        ``fn`` runs in a copy of the caller's context (its context variables: the owner
        `plait.comm.stats` counts the job's collectives for, among them).
        """
        inner: torch.futures.Future[Any] = torch.futures.Future()
        fut: torch.futures.Future[T] = inner.then(_unwrap)
        with self._cv:
            self._pending += 1
        self._ensure_thread()
        job = functools.partial(contextvars.copy_context().run, fn)
        self._jobs.put((job, args, inner, name or getattr(fn, "__name__", "job")))
        return fut

    def _loop(self) -> None:
        while True:
            item = self._jobs.get()
            if item is _STOP:
                return
            fn, args, inner, name = item
            try:
                self._run(fn, args, inner, name)
            except BaseException as exc:  # bookkeeping failed: never leave a waiter hanging
                logger.exception("collective queue %r: job %r bookkeeping failed", self.name, name)
                if not inner.done():
                    inner.set_result(
                        _Failed(exc if isinstance(exc, Exception) else RuntimeError(repr(exc)))
                    )
            finally:
                with self._cv:
                    self._pending -= 1
                    self._cv.notify_all()

    def _run(self, fn: Callable[..., Any], args: tuple[Any, ...], inner: Any, name: str) -> None:
        with self._cv:
            earlier = self._error
        if earlier is not None:
            inner.set_result(
                _Failed(
                    CollectiveError(
                        f"collective queue {self.name!r}: job {name!r} not run, an earlier job "
                        f"failed: {earlier}"
                    )
                )
            )
            return
        start = tracer.now_us()
        try:
            result = fn(*args)
        except BaseException as exc:  # propagate to the waiter; later jobs fail fast
            logger.debug("collective queue %r: job %r failed: %s", self.name, name, exc)
            with self._cv:
                self._error = exc
            if not isinstance(exc, Exception):  # futures carry Exceptions only
                exc = RuntimeError(f"job {name!r} interrupted: {exc!r}")
            inner.set_result(_Failed(exc))
        else:
            inner.set_result(result)
        finally:
            tracer.add(name, COMM, start, tracer.now_us(), thread=self.name)

    @property
    def pending(self) -> int:
        with self._cv:
            return self._pending

    def drain(self, timeout_s: float | None = None) -> None:
        """Block until every submitted job has finished; re-raise the first failure.

        A failed queue stays failed: every later `drain` raises the same error.
        """
        limit = self.timeout_s if timeout_s is None else timeout_s
        with self._cv:
            if not self._cv.wait_for(lambda: self._pending == 0, timeout=limit):
                raise TimeoutError(
                    f"collective queue {self.name!r}: {self._pending} job(s) unfinished after "
                    f"{limit:.0f}s (a peer is missing or issued collectives in another order)"
                )
            err = self._error
        if err is not None:
            raise err

    def close(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            self._jobs.put(_STOP)
            self._thread.join(timeout=self.timeout_s)
        self._thread = None
