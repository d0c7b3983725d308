"""Chrome-trace (Perfetto) timelines of compute and communication, merged across ranks.

Every rank records complete events ("ph": "X") with wall-clock microsecond timestamps, so
the ranks of one machine (and NTP-synchronised machines) line up in one view. A rank is a
trace "process"; the threads that did the work (the training loop, a communication
thread) are its "threads". When tracing is off, `span` costs one attribute check.

Open the merged file at https://ui.perfetto.dev or chrome://tracing.

Every `span` also opens a `torch.profiler.record_function` of its name while a torch
profiler is recording, so a `torch.profiler` trace of a plait run (and Holistic Trace
Analysis on it) shows plait's stages, compression, factor communication, inversion,
around the kernels they run; `profiled` marks work that has no span of its own (the issue
of a collective whose end is seen elsewhere). With no profiler running this costs one
check of the profiler's state.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

#: Categories used across plait; colours in Perfetto follow the name.
COMPUTE, COMM, COMPRESS, OPTIM, DATA = "compute", "comm", "compress", "optim", "data"
#: K-FAC's own stages: factor computation, inversion (or eigendecomposition), preconditioning.
FACTOR, INVERSE, PRECONDITION = "factor", "inverse", "precondition"


class Tracer:
    """Collects spans of one process. Thread-safe; a no-op until `enable` is called."""

    def __init__(self) -> None:
        self.enabled = False
        self._events: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._thread_names: dict[int, str] = {}

    def enable(self) -> None:
        self.enabled = True

    def clear(self) -> None:
        with self._lock:
            self._events.clear()

    @staticmethod
    def now_us() -> float:
        return time.time_ns() / 1000.0

    def add(
        self,
        name: str,
        cat: str,
        start_us: float,
        end_us: float,
        *,
        thread: str | None = None,
        args: dict[str, Any] | None = None,
    ) -> None:
        """Record a finished span (for work whose start and end are seen in different places)."""
        if not self.enabled:
            return
        tid = threading.get_ident()
        ev: dict[str, Any] = {
            "name": name,
            "cat": cat,
            "ph": "X",
            "ts": start_us,
            "dur": max(0.0, end_us - start_us),
            "tid": thread or self._thread_name(tid),
        }
        if args:
            ev["args"] = args
        with self._lock:
            self._events.append(ev)

    def _thread_name(self, tid: int) -> str:
        name = self._thread_names.get(tid)
        if name is None:
            t = threading.current_thread()
            name = "main" if t is threading.main_thread() else t.name
            self._thread_names[tid] = name
        return name

    @contextlib.contextmanager
    def span(
        self, name: str, cat: str = COMPUTE, *, args: dict[str, Any] | None = None
    ) -> Iterator[None]:
        with profiled(name):
            if not self.enabled:
                yield
                return
            start = self.now_us()
            try:
                yield
            finally:
                self.add(name, cat, start, self.now_us(), args=args)

    def events(self, pid: int) -> list[dict[str, Any]]:
        """This process's events, labelled as trace process `pid`."""
        with self._lock:
            evs = [dict(e, pid=pid) for e in self._events]
        meta = {"name": "process_name", "ph": "M", "pid": pid, "args": {"name": f"rank {pid}"}}
        return [meta, *evs]

    def save(self, path: str | os.PathLike[str], *, group: Any = None) -> Path | None:
        """Gather every rank's events to rank 0 and write one merged trace there.

        Collective when a process group is initialised; call it on every rank. Returns the
        written path on the rank that wrote it.
        """
        if dist.is_available() and dist.is_initialized():
            rank = dist.get_rank()
            gathered: list[list[dict[str, Any]] | None] = (
                [None] * dist.get_world_size() if rank == 0 else []
            )
            dist.gather_object(
                self.events(rank), gathered if rank == 0 else None, dst=0, group=group
            )
            if rank != 0:
                return None
            merged = [e for evs in gathered if evs for e in evs]
        else:
            merged = self.events(0)
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(out.suffix + ".tmp")
        tmp.write_text(json.dumps({"traceEvents": merged, "displayTimeUnit": "ms"}))
        tmp.replace(out)
        return out


def profiler_active() -> bool:
    """Whether a torch profiler (`torch.profiler.profile`) is recording in this process."""
    return bool(torch._C._autograd._profiler_enabled())


def profiled(name: str) -> contextlib.AbstractContextManager[Any]:
    """A `torch.profiler.record_function` named `name` while a profiler records, else a
    no-op (a record function costs a little even when nobody listens)."""
    if profiler_active():
        return torch.profiler.record_function(name)
    return contextlib.nullcontext()


#: The process-wide tracer every plait component records into.
tracer = Tracer()


def span(name: str, cat: str = COMPUTE, **args: Any) -> contextlib.AbstractContextManager[None]:
    """A timed span on the process tracer: ``with span("forward"): ...``."""
    return tracer.span(name, cat, args=args or None)
