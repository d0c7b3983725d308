"""Launch a distributed job on an emulated cluster: one ``torchrun`` per node.

Each node's torchrun runs inside the node's namespace with ``GLOO_SOCKET_IFNAME`` and
``NCCL_SOCKET_IFNAME`` set to the node's link (without them gloo binds 127.0.0.1 and the
peers cannot connect, and NCCL would take shared-memory and P2P paths between the nodes,
which share one host, around the shaped link). The nodes meet in torchrun's c10d
rendezvous hosted by node 0's agent: when a worker fails, every node's agent stops its
workers and the whole group re-forms for the restart (independent static rendezvous per
node cannot: the nodes' restarts drift apart and gloo's mesh never connects). Node
addresses sort in node order, so global rank 0 lives on node 0. Node 0's output goes to
the terminal (rank 0 draws progress bars); the other nodes write log files whose tails are
shown when the job fails (and kept when it is stopped). A node still running long after its
peers' workers all finished (`exit_grace_s`: a worker hung at interpreter exit, which
torchrun's exit barrier would wait out for five minutes and then report as success) is
stopped and reported as hung. The whole job has a wall-clock limit and every process tree
is killed on exit, Ctrl-C, SIGTERM, SIGHUP or failure, so nothing is left running; each agent
runs under `plait.cluster.agent`, which ties it to plait and its workers to it, so even a
``kill -9`` of plait leaves nothing behind.

In the loopback fallback the nodes are N torchruns on 127.0.0.x whose stores listen on
loopback only.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from plait._proc import (
    PARENT_ENV,
    deferred_signals,
    descendants,
    keep_scratch,
    kill_quietly,
    scratch_dir,
    stop_signals_interrupt,
)
from plait.cluster.agent import DONE_DIR_ENV, FATAL_PREFIX, LOG_DIR_ENV
from plait.cluster.netns import LINK_ENV, LOOPBACK_ENV, Cluster

logger = logging.getLogger(__name__)

_TERM_GRACE_S = 5.0
#: After one node fails, how long the others get to notice and exit on their own (a
#: torchrun whose workers succeeded otherwise waits at its exit barrier for the dead one).
_FAIL_GRACE_S = 10.0
#: Longest the nodes wait for each other in a rendezvous round (first start or restart).
_JOIN_TIMEOUT_S = 300
#: How long a node may run on after every worker of some other node finished: rank 0's
#: last writes (metrics, a trace) take seconds after the last collective, a worker hung at
#: interpreter exit forever (torchrun's exit barrier would wait 300 s, then call it done).
#: A job whose rank 0 works on longer alone sets PLAIT_EXIT_GRACE (seconds).
EXIT_GRACE_S = float(os.environ.get("PLAIT_EXIT_GRACE", "60"))


def free_port() -> int:
    """A TCP port that is free on this machine right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


@dataclass(kw_only=True)
class LaunchResult:
    """Exit codes per node and where the logs went."""

    returncodes: list[int]
    log_dir: Path
    elapsed_s: float
    timed_out: bool = False
    logs: dict[int, Path] = field(default_factory=dict)
    #: nodes stopped because they ran on `EXIT_GRACE_S` after a peer's workers finished
    hung: list[int] = field(default_factory=list)
    #: an error a worker reported as one that every restart would repeat (not restarted)
    fatal: str = ""

    @property
    def ok(self) -> bool:
        return (
            not self.timed_out
            and not self.hung
            and not self.fatal
            and all(rc == 0 for rc in self.returncodes)
        )

    def describe_failure(self) -> str:
        """One line per thing that went wrong: hung nodes, a time-out, failed nodes."""
        lines = [
            f"node {n} was still running {EXIT_GRACE_S:.0f} s after its peers' workers "
            f"finished (a worker hung, perhaps at exit): stopped"
            + (f"; its log: {self.logs[n]}" if n in self.logs else "")
            for n in self.hung
        ]
        if self.fatal:
            lines.append(f"stopped without restarting (a restart would fail alike): {self.fatal}")
        if self.timed_out:
            lines.append(f"the job ran past its time limit ({self.elapsed_s:.0f} s): stopped")
        failed = [n for n, rc in enumerate(self.returncodes) if rc != 0 and n not in self.hung]
        if failed and not self.timed_out:
            lines.append(f"node(s) {failed} failed (exit codes {self.returncodes})")
        return "\n".join(lines)

    def tail(self, lines: int = 30) -> str:
        out = []
        for node, path in sorted(self.logs.items()):
            with contextlib.suppress(OSError):
                text = path.read_text(errors="replace").splitlines()[-lines:]
                out.append(f"--- node {node} ({path}) ---\n" + "\n".join(text))
        return "\n".join(out)


def worker_env(
    cluster: Cluster, node: int, *, threads: int, extra: Mapping[str, str] | None = None
) -> dict[str, str]:
    """Environment of the node's torchrun: socket interfaces, thread count, cluster facts.

    NCCL is pinned to the node's link like gloo: sockets on the node's interface, and its
    shared-memory, peer-to-peer (NVLink/PCIe) and InfiniBand transports off, since the
    emulated nodes share one host and those paths would bypass the shaped link. On a
    modelled link (`Link.MODEL`) the workers read the rate and delay from ``PLAIT_RATE`` and
    ``PLAIT_LATENCY`` and ``PLAIT_LINK=model`` turns the model on (`plait.comm.link`).
    """
    env = dict(os.environ)
    ifname = cluster.ifname(node)
    env.update(
        {
            "GLOO_SOCKET_IFNAME": ifname,
            "NCCL_SOCKET_IFNAME": ifname,
            "NCCL_SHM_DISABLE": "1",
            "NCCL_P2P_DISABLE": "1",
            "NCCL_IB_DISABLE": "1",
            "OMP_NUM_THREADS": str(threads),
            "PLAIT_NODES": str(cluster.nodes),
            "PLAIT_NODE": str(node),
            "PLAIT_CLUSTER": cluster.cid,
            "PLAIT_RATE": cluster.network.rate or "",
            "PLAIT_BANDWIDTH": cluster.network.bandwidth or "",
            "PLAIT_EMULATED": "1" if cluster.emulated else "0",
            LINK_ENV: cluster.link.value,
            "PLAIT_LATENCY": cluster.network.latency or "",
            PARENT_ENV: str(os.getpid()),
            LOOPBACK_ENV: "0" if cluster.emulated else "1",
            "TORCH_CPP_LOG_LEVEL": env.get("TORCH_CPP_LOG_LEVEL", "ERROR"),
            "PYTHONUNBUFFERED": "1",
        }
    )
    if extra:
        env.update(extra)
    return env


def torchrun_argv(
    cluster: Cluster,
    node: int,
    argv: Sequence[str],
    *,
    nproc_per_node: int,
    port: int,
    max_restarts: int,
    module: bool,
    run_id: str | None = None,
) -> list[str]:
    """The node's torchrun command line (through `plait.cluster.agent`).

    All nodes join one c10d rendezvous hosted by node 0's agent at `port`; `run_id` names
    the job (two jobs on one cluster need different ones).
    """
    host = "1" if node == 0 else "0"
    cmd = [
        *cluster.exec_prefix(node),
        sys.executable,
        "-m",
        "plait.cluster.agent",
        f"--nnodes={cluster.nodes}",
        f"--nproc-per-node={nproc_per_node}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={cluster.address(0)}:{port}",
        f"--rdzv-id={run_id or f'{cluster.cid}-{port}'}",
        f"--rdzv-conf=is_host={host},join_timeout={_JOIN_TIMEOUT_S}",
        f"--local-addr={cluster.address(node)}",
        f"--max-restarts={max_restarts}",
        "--monitor-interval=0.5",
    ]
    if module:
        cmd.append("-m")
    return [*cmd, *argv]


def launch(
    cluster: Cluster,
    argv: Sequence[str],
    *,
    nproc_per_node: int = 1,
    threads: int = 1,
    max_restarts: int = 0,
    timeout_s: float | None = None,
    module: bool = False,
    env: Mapping[str, str] | None = None,
    log_dir: Path | None = None,
    quiet: bool = False,
    stop: threading.Event | None = None,
    exit_grace_s: float = EXIT_GRACE_S,
) -> LaunchResult:
    """Run `argv` (a script and its arguments, or a module with ``module=True``) on every node.

    Args:
        cluster: an up cluster.
        argv: the script (or module) and its arguments, as torchrun takes them.
        nproc_per_node: worker processes per node.
        threads: intra-op threads per worker (OMP_NUM_THREADS).
        max_restarts: torchrun restarts after a worker failure (resume from checkpoints).
        timeout_s: wall-clock limit of the whole job; None for no limit.
        module: run `argv[0]` as a module (``python -m``).
        env: extra environment for the workers.
        log_dir: where node logs go. By default a temporary directory, removed when this
            process exits if the job succeeded and kept (its path is in
            `LaunchResult.tail`) if it failed.
        quiet: send node 0's output to its log file too.
        stop: when set (from another thread), the job is stopped and torn down; a launch
            outside the main thread cannot see Ctrl-C, so its caller relays it here.
        exit_grace_s: a node still running this long after every worker of another node
            finished is stopped and reported in `LaunchResult.hung`.
    """
    if nproc_per_node < 1:
        raise ValueError(f"nproc_per_node must be >= 1, got {nproc_per_node}")
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    if not argv:
        raise ValueError("nothing to run: give a script (and its arguments)")
    own_logs = log_dir is None
    log_dir = Path(log_dir) if log_dir is not None else scratch_dir(f"plait-{cluster.cid}-")
    log_dir.mkdir(parents=True, exist_ok=True)
    done_dir = log_dir / f".done-{time.time_ns()}"  # each node's agent marks its end here
    done_dir.mkdir()
    port = free_port()
    procs: list[subprocess.Popen[bytes]] = []
    logs: dict[int, Path] = {}
    start = time.monotonic()
    timed_out = False
    hung: list[int] = []
    with stop_signals_interrupt():
        try:
            for node in range(cluster.nodes):
                cmd = torchrun_argv(
                    cluster,
                    node,
                    argv,
                    nproc_per_node=nproc_per_node,
                    port=port,
                    max_restarts=max_restarts,
                    module=module,
                )
                penv = worker_env(cluster, node, threads=threads, extra=env)
                # torchrun's per-node log folder lives with the job's logs, not in /tmp
                penv[LOG_DIR_ENV] = str(log_dir / f"torchelastic-node{node}")
                penv[DONE_DIR_ENV] = str(done_dir)
                if node == 0 and not quiet:
                    out = None
                else:
                    logs[node] = log_dir / f"node{node}.log"
                    out = logs[node].open("wb")
                procs.append(
                    subprocess.Popen(
                        cmd,
                        env=penv,
                        stdout=out,
                        stderr=subprocess.STDOUT if out else None,
                        start_new_session=True,
                    )
                )
                if out is not None:
                    out.close()
            deadline = None if timeout_s is None else start + timeout_s
            timed_out, hung = _wait_all(procs, deadline, stop, done_dir, exit_grace_s)
        except BaseException:
            if own_logs and logs:  # stopped (Ctrl-C, SIGTERM): the logs say where it was
                keep_scratch(log_dir, "(node logs of the stopped job)")
            raise
        finally:
            hurry = threading.Event()
            with deferred_signals(lambda _sig: hurry.set()):
                _kill_all(procs, hurry)
    codes = [p.returncode if p.returncode is not None else -9 for p in procs]
    if hung:  # the nodes that waited for the hung one had finished their work
        codes = [0 if (done_dir / f"node{n}").exists() else rc for n, rc in enumerate(codes)]
    result = LaunchResult(
        returncodes=codes,
        log_dir=log_dir,
        elapsed_s=time.monotonic() - start,
        timed_out=timed_out,
        logs=logs,
        hung=hung,
    )
    fatal = sorted(p for p in done_dir.iterdir() if p.name.startswith(FATAL_PREFIX))
    if fatal:
        result.fatal = fatal[0].read_text(errors="replace").strip()
    shutil.rmtree(done_dir, ignore_errors=True)
    if hung:
        logger.error("%s", result.describe_failure())
    if own_logs and not result.ok and logs:
        keep_scratch(log_dir, "(node logs of the failed job)")
    return result


def _wait_all(
    procs: list[subprocess.Popen[bytes]],
    deadline: float | None,
    stop: threading.Event | None,
    done_dir: Path | None = None,
    exit_grace_s: float = EXIT_GRACE_S,
) -> tuple[bool, list[int]]:
    """Wait for every node; when one fails, give the others a grace period, then stop.

    A node whose workers all finished marks it in `done_dir` (`plait.cluster.agent`), or
    exits; the nodes still running `exit_grace_s` after the first such end are hung.

    Returns:
        Whether the deadline passed, and the hung nodes.
    """
    failed_at: float | None = None
    finished_at: float | None = None
    while True:
        codes = [p.poll() for p in procs]
        if all(c is not None for c in codes):
            return False, []
        if stop is not None and stop.is_set():
            return False, []
        now = time.monotonic()
        if any(c not in (None, 0) for c in codes) and failed_at is None:
            failed_at = now
        if failed_at is not None and now - failed_at > _FAIL_GRACE_S:
            return False, []  # a node failed and the others did not notice: stop them
        if finished_at is None and (
            any(c == 0 for c in codes) or (done_dir is not None and any(done_dir.iterdir()))
        ):
            finished_at = now
        if finished_at is not None and now - finished_at > exit_grace_s:
            done = {p.name for p in done_dir.iterdir()} if done_dir is not None else set()
            hung = [n for n, c in enumerate(codes) if c is None and f"node{n}" not in done]
            if hung:
                return False, hung
        if done_dir is not None and any(
            p.name.startswith(FATAL_PREFIX) for p in done_dir.iterdir()
        ):
            return False, []  # an error every restart would repeat: stop now
        if deadline is not None and now > deadline:
            return True, []
        time.sleep(0.1)


def _kill_all(procs: list[subprocess.Popen[bytes]], hurry: threading.Event | None = None) -> None:
    """Stop every node's process tree: SIGTERM, a grace period, then SIGKILL.

    torchrun forwards SIGTERM to its workers, but its workers live in sessions of their
    own, so the SIGKILL goes to every descendant found under each agent as well as to the
    agent's process group. `hurry` (a second Ctrl-C) cuts the grace period short.
    """
    live = [p for p in procs if p.poll() is None]
    tree = {p.pid: descendants(p.pid) for p in live}
    for p in live:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(p.pid, signal.SIGTERM)
    end = time.monotonic() + _TERM_GRACE_S
    for p in live:
        while p.poll() is None and time.monotonic() < end:
            if hurry is not None and hurry.is_set():
                break
            time.sleep(0.05)
    for p in procs:
        victims = set(tree.get(p.pid, [])) | set(descendants(p.pid))
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(p.pid, signal.SIGKILL)
        for pid in victims:
            kill_quietly(pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=5)
