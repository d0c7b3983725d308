"""A node's torchrun agent, tied to the process that launched it.

``python -m plait.cluster.agent ARGS`` is ``torchrun ARGS`` with two guarantees torchrun
does not give on its own:

- the agent dies when plait dies, and every worker when its agent dies: both carry a
  parent-death signal (SIGKILL), so a ``kill -9`` of ``plait run`` leaves nothing running.
  torchrun starts each worker in a session of its own, out of reach of a process-group
  kill, which is why the workers need it too;
- every rendezvous round (a restart after a failed worker) gives the workers a fresh
  store: torchrun keeps one store for the workers across rounds, so restarted workers
  read the dead ones' gloo addresses left in it and the group never connects again (at
  2 nodes the race is usually won, at 4 it is lost);
- in the loopback fallback (``PLAIT_LOOPBACK=1``) every TCPStore server the agent creates
  listens on 127.0.0.1 only: torch binds its stores to all interfaces whatever host it is
  given, which on a machine without namespaces opens the job's rendezvous to the network;
- its workers' log folder is the one plait names (``PLAIT_TORCHRUN_LOG_DIR``, inside the
  job's own log folder) instead of a fresh ``/tmp/torchelastic_*`` per node and job that
  nobody removes;
- when its workers all succeeded it says so at once (a file ``node{N}`` holding
  ``SUCCEEDED`` in ``PLAIT_DONE_DIR``) before torchrun's exit barrier waits for the other
  nodes, so the launcher can tell a node still running long after that from one that is
  merely slower (`plait.cluster.launch.EXIT_GRACE_S`).
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

from plait._proc import PARENT_ENV, die_with_parent, die_with_parent_preexec
from plait.cluster.netns import LOOPBACK_ENV

logger = logging.getLogger(__name__)

#: Folder torchrun writes its per-worker logs into (instead of a new /tmp/torchelastic_*).
LOG_DIR_ENV = "PLAIT_TORCHRUN_LOG_DIR"
#: Folder where a node's agent marks that its workers all finished.
DONE_DIR_ENV = "PLAIT_DONE_DIR"


class _WorkerPopen(subprocess.Popen):  # type: ignore[type-arg]
    """torchrun's worker Popen, with a parent-death signal tying the worker to its agent."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("preexec_fn") is None:
            kwargs["preexec_fn"] = die_with_parent_preexec()
        super().__init__(*args, **kwargs)


def _tie_workers_to_agent() -> bool:
    try:
        from torch.distributed.elastic.multiprocessing.subprocess_handler import (
            subprocess_handler as handler,
        )
    except ImportError:
        return False
    if not hasattr(handler, "Popen"):
        return False
    handler.Popen = _WorkerPopen
    return True


def _fresh_worker_store_each_round() -> bool:
    try:
        from torch.distributed.elastic.rendezvous import dynamic_rendezvous
    except ImportError:
        return False
    handler: Any = getattr(dynamic_rendezvous, "DynamicRendezvousHandler", None)
    if handler is None or not hasattr(handler, "next_rendezvous"):
        return False
    original = handler.next_rendezvous

    def next_rendezvous(self: Any) -> Any:
        # forget the previous round's store: rank 0 hosts a new one, the others read its
        # address from this round's keys
        self._bootstrap_store_info = None
        self._shared_tcp_store_server = None
        return original(self)

    handler.next_rendezvous = next_rendezvous
    return True


def _loopback_store_class() -> type:
    import torch.distributed as dist

    base: Any = getattr(dist, "TCPStore")  # noqa: B009  # not re-exported in torch's stubs

    class LoopbackTCPStore(base):  # type: ignore[misc]
        """A TCPStore whose server socket is bound to 127.0.0.1, not to every interface."""

        def __init__(  # noqa: PLR0917  # TCPStore's own positional signature
            self,
            host_name: str,
            port: int,
            world_size: int | None = None,
            is_master: bool = False,
            timeout: datetime.timedelta = datetime.timedelta(seconds=300),
            wait_for_workers: bool = True,
            multi_tenant: bool = False,
            master_listen_fd: int | None = None,
            use_libuv: bool | None = None,
        ) -> None:
            if is_master and master_listen_fd is None:
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind(("127.0.0.1", port))
                sock.listen(512)
                port = int(sock.getsockname()[1])
                master_listen_fd = sock.detach()  # the store owns the socket from here
            extra = {} if use_libuv is None else {"use_libuv": use_libuv}
            super().__init__(
                host_name,
                port,
                world_size,
                is_master,
                timeout,
                wait_for_workers,
                multi_tenant,
                master_listen_fd,
                **extra,
            )

    return LoopbackTCPStore


def _bind_stores_to_loopback() -> None:
    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend, static_tcp_rendezvous

    store = _loopback_store_class()
    setattr(dist, "TCPStore", store)  # noqa: B010  # read by dynamic_rendezvous, elastic.utils
    for mod in (c10d_rendezvous_backend, static_tcp_rendezvous):
        if hasattr(mod, "TCPStore"):
            mod.TCPStore = store  # type: ignore[attr-defined]


#: Prefix of the file a worker leaves in the done folder for an error a restart repeats.
FATAL_PREFIX = "fatal-"


def report_fatal(message: str) -> bool:
    """From a worker: its error will repeat on every restart (a full disk, a refused
    checkpoint, a bad setting); the launcher stops the job instead of restarting it.

    Returns:
        Whether the job runs under a plait launcher that reads it.
    """
    done = os.environ.get(DONE_DIR_ENV)
    if not done:
        return False
    path = Path(done) / f"{FATAL_PREFIX}rank{os.environ.get('RANK', '0')}"
    try:
        path.write_text(message)
    except OSError:
        return False
    return True


def _mark_done_before_exit_barrier(done_dir: Path, node: str) -> bool:
    try:
        from torch.distributed.elastic.agent.server.api import SimpleElasticAgent
    except ImportError:
        return False
    original: Any = getattr(SimpleElasticAgent, "_exit_barrier", None)
    if original is None:
        return False

    def exit_barrier(self: Any) -> Any:
        # called only once the local workers succeeded (torchrun's _invoke_run)
        tmp = done_dir / f".node{node}.tmp"
        try:
            tmp.write_text("SUCCEEDED")
            tmp.replace(done_dir / f"node{node}")
        except OSError as exc:
            logger.warning("plait: cannot mark node %s done in %s: %s", node, done_dir, exc)
        return original(self)

    SimpleElasticAgent._exit_barrier = exit_barrier  # type: ignore[method-assign]
    return True


def with_log_dir(argv: list[str], log_dir: str | None) -> list[str]:
    """`argv` with ``--log-dir=log_dir`` in front, unless it names a log folder itself."""
    if not log_dir or any(a.split("=")[0] in ("--log-dir", "--log_dir") for a in argv):
        return argv
    return [f"--log-dir={log_dir}", *argv]


def main(argv: list[str] | None = None) -> None:
    """Set up the guarantees above, then run torchrun with `argv`."""
    parent = os.environ.get(PARENT_ENV)
    die_with_parent(int(parent) if parent and parent.isdigit() else None)
    if not _tie_workers_to_agent():
        logger.warning("plait: torchrun's worker launcher changed; workers may outlive it")
    loopback = os.environ.get(LOOPBACK_ENV) == "1"
    if not _fresh_worker_store_each_round():
        # without the hook, workers host a fresh store per round themselves (on every
        # interface: acceptable inside a namespace, not on the loopback fallback)
        os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        logger.warning("plait: torchrun's rendezvous changed; workers host their own store")
    if loopback:
        _bind_stores_to_loopback()
    done = os.environ.get(DONE_DIR_ENV)
    if done and not _mark_done_before_exit_barrier(Path(done), os.environ.get("PLAIT_NODE", "0")):
        logger.warning("plait: torchrun's exit barrier changed; a hung node is found later")
    from torch.distributed.run import main as torchrun_main

    args = sys.argv[1:] if argv is None else argv
    torchrun_main(with_log_dir(list(args), os.environ.get(LOG_DIR_ENV)))


if __name__ == "__main__":
    main()
