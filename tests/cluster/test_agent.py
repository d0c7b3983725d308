"""The node agent's changes to torchrun: workers tied to their agent, a fresh store per
rendezvous round, and stores bound to loopback in the fallback."""

from __future__ import annotations

import datetime
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.subprocess_handler import (
    subprocess_handler as handler,
)
from torch.distributed.elastic.rendezvous import (
    c10d_rendezvous_backend,
    dynamic_rendezvous,
    static_tcp_rendezvous,
)

from plait.cluster import agent


def _running(pid: int) -> bool:
    """Whether `pid` runs: neither gone nor a zombie waiting for a reaper."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_worker_dies_with_the_agent_that_started_it() -> None:
    # a stand-in agent starts a worker the way torchrun does, then exits abruptly
    code = textwrap.dedent(
        """
        import os
        from plait.cluster.agent import _WorkerPopen
        p = _WorkerPopen(["sleep", "60"], start_new_session=True)
        print(p.pid, flush=True)
        os._exit(0)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True, timeout=60
    )
    worker = int(out.stdout)
    deadline = time.monotonic() + 10
    while _running(worker) and time.monotonic() < deadline:
        time.sleep(0.05)
    alive = _running(worker)
    if alive:
        subprocess.run(["kill", "-9", str(worker)], check=False)
    assert not alive, "the worker outlived its agent"


def test_torchrun_launches_workers_through_the_tied_popen(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(handler, "Popen", getattr(handler, "Popen"))  # noqa: B009  # restored after the test
    assert agent._tie_workers_to_agent()
    assert getattr(handler, "Popen") is agent._WorkerPopen  # noqa: B009


def test_each_rendezvous_round_forgets_the_previous_store(monkeypatch: pytest.MonkeyPatch) -> None:
    cls: Any = dynamic_rendezvous.DynamicRendezvousHandler
    seen: list[tuple[Any, Any]] = []

    def original(self: Any) -> str:
        seen.append((self._bootstrap_store_info, self._shared_tcp_store_server))
        return "round"

    monkeypatch.setattr(cls, "next_rendezvous", original)  # restored after the test
    assert agent._fresh_worker_store_each_round()
    rdzv = SimpleNamespace(_bootstrap_store_info="old", _shared_tcp_store_server="old")
    assert cls.next_rendezvous(rdzv) == "round"
    assert seen == [(None, None)]


def _listening_on(port: int) -> set[str]:
    """The local addresses (hex, as /proc/net/tcp writes them) listening on `port`."""
    found = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        addr, hexport = local.split(":")
        if int(hexport, 16) == port and state == "0A":
            found.add(addr)
    return found


def test_loopback_stores_listen_on_loopback_only(monkeypatch: pytest.MonkeyPatch) -> None:
    store_cls = agent._loopback_store_class()
    store = store_cls("127.0.0.1", 0, 1, True, datetime.timedelta(seconds=10))
    store.set("k", "v")
    assert store.get("k") == b"v"
    assert _listening_on(store.port) == {"0100007F"}  # 127.0.0.1, not 0.0.0.0
    del store
    # torch's stubs do not re-export TCPStore: reached by name; restored after the test
    for mod in (dist, c10d_rendezvous_backend, static_tcp_rendezvous):
        if hasattr(mod, "TCPStore"):
            monkeypatch.setattr(mod, "TCPStore", getattr(mod, "TCPStore"))  # noqa: B009
    agent._bind_stores_to_loopback()
    assert getattr(dist, "TCPStore").__name__ == "LoopbackTCPStore"  # noqa: B009
    assert getattr(c10d_rendezvous_backend, "TCPStore") is getattr(dist, "TCPStore")  # noqa: B009
