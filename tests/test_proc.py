"""Process helpers: liveness, process trees, signal handling during cleanup, scratch folders."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from plait import _proc
from plait._proc import (
    deferred_signals,
    descendants,
    keep_scratch,
    kill_quietly,
    pid_alive,
    pid_start_time,
    process_alive,
    scratch_dir,
    stop_signals_interrupt,
    temp_dir,
)


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield proc
    proc.kill()
    proc.wait()


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()  # reaped: the pid names no process now (until the kernel reuses it)
    return proc.pid


def test_pid_alive() -> None:
    assert pid_alive(os.getpid())
    assert pid_alive(1)  # init: alive, and another user's process counts as alive
    assert not pid_alive(0) and not pid_alive(-5)
    assert not pid_alive(_dead_pid())


def test_process_alive_tells_a_recycled_pid(sleeper: subprocess.Popen[bytes]) -> None:
    start = pid_start_time(sleeper.pid)
    assert start is not None and start == pid_start_time(sleeper.pid)
    assert process_alive(sleeper.pid, start)
    assert process_alive(sleeper.pid, None)
    assert not process_alive(sleeper.pid, start + 1)  # same pid, another process
    assert pid_start_time(_dead_pid()) is None


def test_descendants_and_kill_quietly(sleeper: subprocess.Popen[bytes]) -> None:
    assert sleeper.pid in descendants(os.getpid())
    assert descendants(sleeper.pid) == []
    kill_quietly(sleeper.pid, signal.SIGKILL)
    assert sleeper.wait(timeout=10) == -signal.SIGKILL
    kill_quietly(sleeper.pid)  # gone: no error


def test_deferred_signals_hold_off_a_stop(caplog: pytest.LogCaptureFixture) -> None:
    before = signal.getsignal(signal.SIGTERM)
    seen: list[int] = []
    with caplog.at_level(logging.WARNING, logger="plait._proc"), deferred_signals(seen.append):
        os.kill(os.getpid(), signal.SIGTERM)  # would end the test run if not held off
        os.kill(os.getpid(), signal.SIGINT)
    assert seen == [signal.SIGTERM, signal.SIGINT]
    assert signal.getsignal(signal.SIGTERM) is before
    assert "during cleanup" in caplog.text


def test_stop_signals_interrupt_like_ctrl_c() -> None:
    before = signal.getsignal(signal.SIGTERM)
    stop = pytest.raises(KeyboardInterrupt, match=f"signal {int(signal.SIGTERM)}")
    with stop, stop_signals_interrupt():
        os.kill(os.getpid(), signal.SIGTERM)
    assert signal.getsignal(signal.SIGTERM) is before


def test_temp_dir_is_removed() -> None:
    with temp_dir("plait-test-") as path:
        (path / "f").write_text("x")
        assert path.name.startswith("plait-test-")
    assert not path.exists()
    with pytest.raises(RuntimeError), temp_dir("plait-test-") as failed:
        raise RuntimeError
    assert not failed.exists()  # removed on error too unless asked to keep it


def test_scratch_dir_removal_and_keep(caplog: pytest.LogCaptureFixture) -> None:
    removed = scratch_dir("plait-test-")
    kept = scratch_dir("plait-test-")
    try:
        assert removed.is_dir() and kept.is_dir()
        with caplog.at_level(logging.WARNING, logger="plait._proc"):
            keep_scratch(kept, "(for the test)")
        assert f"kept {kept} (for the test)" in caplog.text
        assert kept not in _proc._SCRATCH  # no longer removed at exit
        _proc._SCRATCH.pop(removed)()  # what exit runs for the others
        assert not removed.exists() and kept.is_dir()
        caplog.clear()
        keep_scratch(Path("/nonexistent"))  # not a scratch dir: nothing to keep, no log
        assert caplog.text == ""
    finally:
        for path in (removed, kept):
            _proc._SCRATCH.pop(path, None)
            shutil.rmtree(path, ignore_errors=True)


def test_interrupts_held_defers_a_stop_signal_to_the_end_of_the_block() -> None:
    from plait._proc import interrupts_held

    reached = []
    with pytest.raises(KeyboardInterrupt, match=f"signal {int(signal.SIGINT)}"), interrupts_held():
        os.kill(os.getpid(), signal.SIGINT)  # as if it arrived while torch imports
        reached.append("the rest of the block ran")
    assert reached == ["the rest of the block ran"]
    # the handlers are back: Python's own Ctrl-C raises at once again
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    with interrupts_held():
        pass  # no signal, nothing raised


def test_scratch_of_a_killed_process_is_removed_by_the_next(tmp_path: Path) -> None:
    """`kill -9` skips atexit: the folder used to stay for good."""
    code = (
        "import os, signal, tempfile, sys; tempfile.tempdir = sys.argv[1]; "
        "from plait._proc import scratch_dir, keep_scratch; "
        "a = scratch_dir('plait-train-'); b = scratch_dir('plait-logs-'); "
        "keep_scratch(b, 'for the report'); print(a, b, flush=True); "
        "os.kill(os.getpid(), signal.SIGKILL)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, check=False
    )
    assert proc.returncode == -signal.SIGKILL
    left, kept = (Path(p) for p in proc.stdout.split())
    assert left.is_dir() and kept.is_dir()
    from plait._proc import reap_scratch

    removed = reap_scratch(tmp_path)
    assert removed == [left] and not left.exists()
    assert kept.is_dir()  # a failure report pointed the user there
