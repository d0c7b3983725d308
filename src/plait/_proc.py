"""Process helpers shared by the cluster registry, the launcher, the compute token, the
planner and the benchmarks.

A distributed job is a tree of processes that plait does not fully control: plait starts one
torchrun agent per node, and each agent starts its workers in sessions of their own. The
helpers here make that tree die as a whole: a parent-death signal ties every process to its
parent, `descendants` finds the processes a process group kill misses, and `temp_dir` and
`deferred_signals` keep cleanup itself from being skipped or cut short.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import ctypes.util
import functools
import logging
import os
import re
import shutil
import signal
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
#: The pid of the plait process that launched a node's agent (checked against its parent).
PARENT_ENV = "PLAIT_PARENT_PID"
#: Signals that end a command: Ctrl-C, `kill`, and the terminal closing.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def pid_alive(pid: int) -> bool:
    """Whether process `pid` exists (a process of another user counts as alive)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def pid_start_time(pid: int) -> int | None:
    """The start time of process `pid` in clock ticks since boot (None when unknown).

    A pid and its start time name one process for good: a recycled pid has a later start.
    """
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # the command name (field 2) may hold spaces and parentheses: split after its last ')'
    fields = stat[stat.rfind(")") + 2 :].split()
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return None


def process_alive(pid: int, start_time: int | None) -> bool:
    """Whether the process that had `pid` and `start_time` still runs (not a recycled pid)."""
    if not pid_alive(pid):
        return False
    if start_time is None:
        return True
    now = pid_start_time(pid)
    return now is None or now == start_time


def usable_cpus() -> int:
    """CPU cores this process may run on (its affinity mask where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


@functools.cache
def _prctl() -> Callable[..., int] | None:
    """libc's prctl, found on first use: `find_library` runs a subprocess, which would
    slow every import of plait (and the command line's first instant) by tens of ms."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6", use_errno=True)
        fn: Callable[..., int] = libc.prctl
    except (OSError, AttributeError):
        return None
    return fn


def die_with_parent(expected_parent: int | None = None, sig: int = signal.SIGKILL) -> bool:
    """Have the kernel send `sig` to this process when its parent exits (Linux only).

    Without it a SIGKILLed launcher leaves its agents, and an agent its workers, running
    forever, reparented to init. When the parent is already gone (not `expected_parent`),
    the signal is sent at once, closing the race between fork and this call.

    Returns:
        Whether the parent-death signal is set.
    """
    prctl = _prctl()
    if prctl is None:
        return False
    if prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0) != 0:
        return False
    if expected_parent is not None and os.getppid() != expected_parent:
        os.kill(os.getpid(), sig)
    return True


def die_with_parent_preexec() -> Callable[[], None]:
    """A ``preexec_fn`` for `subprocess.Popen` that ties the child to this process.

    Only a prebuilt ctypes call runs in the child, so no Python lock is taken there.
    """
    parent = os.getpid()
    prctl = _prctl()

    def preexec() -> None:
        if prctl is not None:
            prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
            if os.getppid() != parent:
                os.kill(os.getpid(), signal.SIGKILL)

    return preexec


def descendants(pid: int) -> list[int]:
    """Every live descendant of `pid` (children first), read from /proc.

    torchrun starts its workers in sessions of their own, so killing the agent's process
    group misses them; this finds them.
    """
    children: dict[int, list[int]] = {}
    with contextlib.suppress(OSError):
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                stat = Path(entry.path, "stat").read_text()
                ppid = int(stat[stat.rfind(")") + 2 :].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out: list[int] = []
    todo = list(children.get(pid, []))
    while todo:
        p = todo.pop(0)
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def kill_quietly(pid: int, sig: int = signal.SIGKILL) -> None:
    """Send `sig` to `pid`, ignoring processes that are gone or not ours."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)


@contextlib.contextmanager
def deferred_signals(on_signal: Callable[[int], None] | None = None) -> Iterator[None]:
    """Hold off Ctrl-C, SIGTERM and SIGHUP while cleanup runs.

    A second Ctrl-C during teardown would otherwise interrupt it half-way and orphan
    processes. A signal that arrives is passed to `on_signal` (say, to skip a grace period)
    and otherwise dropped: the command is already stopping. Outside the main thread the
    handlers cannot be changed and this does nothing.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: FrameType | None) -> None:
        logger.warning("signal %d during cleanup: stopping faster", signum)
        if on_signal is not None:
            on_signal(signum)

    old = {s: signal.signal(s, handler) for s in STOP_SIGNALS}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


@contextlib.contextmanager
def interrupts_held() -> Iterator[None]:
    """Note Ctrl-C, SIGTERM and SIGHUP inside the block; raise KeyboardInterrupt after it.

    A command's first second imports torch, whose import swallows a KeyboardInterrupt
    raised inside it (measured: a Ctrl-C in the first 0.2-0.4 s was lost in about half
    of the tries, and the job then built its cluster and trained to the end; once C++
    aborted on it). Held here, the signal cannot land inside torch; it stops the command
    as soon as the block ends, before anything is built. Outside the main thread this
    does nothing.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    got: list[int] = []

    def handler(signum: int, frame: FrameType | None) -> None:
        got.append(signum)

    old = {s: signal.signal(s, handler) for s in STOP_SIGNALS}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    if got:
        raise KeyboardInterrupt(f"signal {got[0]}")


@contextlib.contextmanager
def stop_signals_interrupt() -> Iterator[None]:
    """Turn SIGTERM and SIGHUP into KeyboardInterrupt, as Ctrl-C is, while inside.

    `finally` blocks (teardown of namespaces and process trees) then run for every way a
    command is told to stop. Outside the main thread this does nothing.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    old = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


@contextlib.contextmanager
def temp_dir(prefix: str, *, keep_on_error: bool = False) -> Iterator[Path]:
    """A fresh temporary directory, removed on exit.

    Args:
        prefix: name prefix (``plait-train-``), so leftovers are recognisable.
        keep_on_error: keep the directory when the block raises (it holds logs a failure
            report points to); where it is kept is logged.
    """
    path = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield path
    except BaseException:
        if keep_on_error:
            logger.warning("kept %s for the failure report", path)
        else:
            shutil.rmtree(path, ignore_errors=True)
        raise
    shutil.rmtree(path, ignore_errors=True)


_SCRATCH: dict[Path, Callable[[], None]] = {}
#: ``<prefix>o<pid>.<start>-<random>``: the owner of a scratch folder, by pid and start time.
_OWNER = re.compile(r"^plait-.*?o(\d+)\.(\d+)-[^-]+$")
_reaped: list[bool] = []  # one sweep per process (`scratch_dir`)
_KEPT = ".kept"


def reap_scratch(root: Path | None = None) -> list[Path]:
    """Remove this user's scratch folders whose owner died without cleaning up (SIGKILL).

    Folders kept for a failure report (`keep_scratch`, marked by a ``.kept`` file) stay:
    the user was pointed to them.
    """
    removed = []
    base = root or Path(tempfile.gettempdir())
    with contextlib.suppress(OSError):
        for entry in os.scandir(base):
            m = _OWNER.match(entry.name)
            if m is None or not entry.is_dir(follow_symlinks=False):
                continue
            with contextlib.suppress(OSError):
                if entry.stat(follow_symlinks=False).st_uid != os.geteuid():
                    continue
            if process_alive(int(m.group(1)), int(m.group(2))) or Path(entry.path, _KEPT).exists():
                continue
            shutil.rmtree(entry.path, ignore_errors=True)
            removed.append(Path(entry.path))
    return removed


def scratch_dir(prefix: str) -> Path:
    """A temporary directory removed when this process exits (normally, by an exception,
    Ctrl-C, or SIGTERM/SIGHUP while a cluster is up), unless `keep_scratch` keeps it.

    For folders that outlive the function creating them: a job's config handed to
    torchrun, a probe's output read after the cluster is down. Its name carries this
    process's pid and start time, so the first scratch folder of a later process removes
    the ones a ``kill -9`` left behind (`reap_scratch`).
    """
    if not _reaped:
        _reaped.append(True)
        reap_scratch()
    pid = os.getpid()
    path = Path(tempfile.mkdtemp(prefix=f"{prefix}o{pid}.{pid_start_time(pid) or 0}-"))

    def remove() -> None:
        shutil.rmtree(path, ignore_errors=True)

    _SCRATCH[path] = remove
    atexit.register(remove)
    return path


def keep_scratch(path: Path, why: str = "for the failure report") -> None:
    """Keep a `scratch_dir` at exit (it holds what a failure report points to); logged."""
    remove = _SCRATCH.pop(path, None)
    if remove is not None:
        atexit.unregister(remove)
        with contextlib.suppress(OSError):
            (path / _KEPT).write_text(why)
        logger.warning("kept %s %s", path, why)
