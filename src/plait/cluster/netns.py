"""An emulated multi-node cluster on one machine: network namespaces, a bridge and tc.

Each node is a Linux network namespace holding one end of a veth pair; the other end is
attached to a per-cluster bridge. The node's egress is shaped with a token bucket (tbf),
optionally with netem beneath it for delay and loss, so every byte a worker sends crosses
a link of the configured rate, exactly like a NIC. Names carry a random cluster id, so two
clusters (say a test and a benchmark) coexist; the addresses live inside the namespaces
only, so their subnets never clash with the host's.

Building namespaces needs root or CAP_NET_ADMIN, and a kernel that offers them with tc
(gVisor's network stack, for one, does not). Without them a cluster falls back to
loopback, all workers on 127.0.0.1, and a shaped network becomes a *modelled link*
(`plait.comm.link`): plait's collectives take the time the alpha-beta model gives them on
a link of the configured rate. The fallback is announced; ``link=`` (``--link``, or
``PLAIT_LINK``) forces either way.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import secrets
import shutil
import subprocess
import threading
import time
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from pathlib import Path
from types import TracebackType

from plait._proc import (
    deferred_signals,
    kill_quietly,
    pid_start_time,
    process_alive,
    stop_signals_interrupt,
)
from plait.cluster.network import NetworkSpec, parse_rate

STATE_DIR = Path(os.environ.get("PLAIT_STATE_DIR", "/run/plait/clusters"))
_PREFIX = "plait-"
_TBF_BURST_MIN = 256 * 1024
_CAP_NET_ADMIN = 12
#: Set to 1 for a node's agent in the loopback fallback: its stores bind 127.0.0.1 only.
LOOPBACK_ENV = "PLAIT_LOOPBACK"
#: How long `teardown` waits for the killed processes of a namespace to be gone.
_KILL_WAIT_S = 5.0

logger = logging.getLogger(__name__)


class ClusterError(RuntimeError):
    """Raised when the emulated network cannot be built or changed."""


class Link(StrEnum):
    """How a cluster's links get their rate.

    ``tc``: network namespaces joined by veth pairs shaped with tc (needs root or
    CAP_NET_ADMIN and a kernel with namespaces and tc). ``model``: loopback, with plait's
    collectives delayed to a modelled link's time (`plait.comm.link`). ``none``: loopback,
    unshaped. ``auto`` (a request only): tc where it works, else a model when a rate,
    delay or loss is asked for, else none.
    """

    AUTO = "auto"
    TC = "tc"
    MODEL = "model"
    NONE = "none"


#: The environment variable that chooses the link when no ``link=`` is given (``--link``).
LINK_ENV = "PLAIT_LINK"


def _run(cmd: list[str], *, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if check and proc.returncode != 0:
        raise ClusterError(f"`{' '.join(cmd)}` failed: {proc.stderr.strip() or proc.stdout}")
    return proc


def has_net_admin() -> bool:
    """True when this process may create namespaces and shape links (root or CAP_NET_ADMIN)."""
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return False
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        return os.geteuid() == 0
    for line in status.splitlines():
        if line.startswith("CapEff:"):
            return bool(int(line.split()[1], 16) >> _CAP_NET_ADMIN & 1)
    return os.geteuid() == 0


@dataclass(kw_only=True)
class Cluster:
    """N emulated nodes. Use as a context manager: teardown always runs.

    Attributes:
        nodes: number of nodes (network namespaces).
        network: egress shaping of every node's link.
        emulated: True for namespaces; False for the loopback fallback.
        link: tc on namespaces, a modelled link on loopback, or none (unshaped loopback).
        cid: random id that makes names and subnets unique to this cluster.
        persistent: outlives this process (`plait cluster up`); otherwise the cluster
            belongs to this process and `plait cluster down` leaves it alone while the
            process lives.
    """

    nodes: int
    network: NetworkSpec = field(default_factory=NetworkSpec)
    emulated: bool = True
    link: Link = Link.TC
    cid: str = field(default_factory=lambda: secrets.token_hex(3))
    persistent: bool = False
    _up: bool = field(default=False, repr=False)
    _signals: contextlib.ExitStack | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.link = Link(self.link)
        if self.link is Link.AUTO:
            raise ValueError("a cluster's link is tc, model or none (auto is for create)")
        if not self.emulated and self.link is Link.TC:
            self.link = Link.NONE  # loopback built by hand: nothing shapes it
        if self.nodes < 1:
            raise ValueError(f"nodes must be >= 1, got {self.nodes}")
        if self.nodes > 250:
            raise ValueError(f"nodes must be <= 250, got {self.nodes}")

    # ----------------------------------------------------------------- naming
    @property
    def bridge(self) -> str:
        return f"plb{self.cid}"

    def netns(self, node: int) -> str:
        return f"{_PREFIX}{self.cid}-{node}"

    def ifname(self, node: int) -> str:
        """The node's interface name inside its namespace (GLOO_SOCKET_IFNAME)."""
        return f"plv{self.cid}n{node}" if self.emulated else "lo"

    def _peer(self, node: int) -> str:
        return f"plp{self.cid}n{node}"

    @property
    def subnet(self) -> str:
        b = int(self.cid, 16)
        return f"10.{200 + (b >> 16) % 50}.{(b >> 8) & 0xFF}"

    def address(self, node: int) -> str:
        """The node's IPv4 address: in its subnet, or on loopback (127.0.0.x) in the fallback.

        Addresses sort as strings in node order: torchrun's rendezvous ranks the nodes by
        their address string, and global rank 0 belongs on node 0.
        """
        octet = node_octet(node, self.nodes)
        return f"{self.subnet}.{octet}" if self.emulated else f"127.0.0.{octet}"

    def exec_prefix(self, node: int) -> list[str]:
        """Argv prefix that runs a command inside the node's namespace."""
        return ["ip", "netns", "exec", self.netns(node)] if self.emulated else []

    # ------------------------------------------------------------- lifecycle
    @classmethod
    def create(
        cls,
        *,
        nodes: int,
        network: NetworkSpec | None = None,
        quiet: bool = False,
        persistent: bool = False,
        link: Link | str | None = None,
    ) -> Cluster:
        """A cluster of `nodes` nodes: namespaces shaped by tc where this machine allows
        them, else loopback with a modelled link (or unshaped when nothing is shaped).

        Args:
            link: `Link` (or its name); None reads ``PLAIT_LINK``, else ``auto``.

        Raises:
            ValueError: an unknown link; ``tc`` where namespaces or tc are unavailable
                (the reason named); loss on a modelled link (a model has no packets).
        """
        network = network or NetworkSpec()
        want = Link(_link_name(link))
        if want is Link.TC:
            why = tc_unavailable()
            if why:
                raise ValueError(f"link tc: {why}; use --link model (or auto)")
            chosen = Link.TC
        elif want is Link.AUTO:
            why = tc_unavailable()
            chosen = Link.TC if not why else (Link.MODEL if network.shaped else Link.NONE)
        else:
            why = f"link {want} asked for"
            chosen = Link.MODEL if want is Link.MODEL and network.shaped else Link.NONE
        if chosen is Link.MODEL and network.loss:
            raise ValueError(
                f"--loss {network.loss}: a modelled link cannot lose packets ({why}); "
                "drop --loss or run where namespaces and tc work (root, not gVisor)"
            )
        if not quiet and chosen is not Link.TC:
            what = (
                f"MODELLED link: plait's collectives take the time of {network.describe()} "
                "under the alpha-beta model"
                if chosen is Link.MODEL
                else f"UNSHAPED ({network.describe()})"
            )
            logger.warning(
                "no shaped namespaces (%s): %d node(s) on 127.0.0.1, %s", why, nodes, what
            )
        return cls(
            nodes=nodes,
            network=network,
            emulated=chosen is Link.TC,
            link=chosen,
            persistent=persistent,
        )

    def up(self) -> Cluster:
        """Build the namespaces and links (after removing clusters whose owner died).

        While the cluster is up, SIGTERM and SIGHUP stop the owning command as Ctrl-C does
        (in the main thread), so `down` runs however the command is told to stop.
        """
        if self._up:
            return self
        self._up = True  # from here on, down() must run even if setup fails half-way
        if threading.current_thread() is threading.main_thread() and not self.persistent:
            self._signals = contextlib.ExitStack()
            self._signals.enter_context(stop_signals_interrupt())
        if not self.emulated:
            return self
        try:
            reap_dead()
            self._build()
        except BaseException:
            self.down()
            raise
        return self

    def _build(self) -> None:
        self._save_state()
        _run(["ip", "link", "add", self.bridge, "type", "bridge"])
        _run(["ip", "link", "set", self.bridge, "up"])
        for i in range(self.nodes):
            ns, dev, peer = self.netns(i), self.ifname(i), self._peer(i)
            _run(["ip", "netns", "add", ns])
            _run(["ip", "link", "add", dev, "type", "veth", "peer", "name", peer])
            _run(["ip", "link", "set", dev, "netns", ns])
            _run(["ip", "link", "set", peer, "master", self.bridge])
            _run(["ip", "link", "set", peer, "up"])
            inside = ["ip", "netns", "exec", ns]
            _run([*inside, "ip", "addr", "add", f"{self.address(i)}/24", "dev", dev])
            _run([*inside, "ip", "link", "set", dev, "up"])
            _run([*inside, "ip", "link", "set", "lo", "up"])
        self.shape(self.network)

    def shape(self, network: NetworkSpec) -> None:
        """(Re)apply egress shaping on every node's link; cheap, so benchmarks sweep rates."""
        self.network = network
        if not self.emulated or not self._up:
            return
        for i in range(self.nodes):
            inside = ["ip", "netns", "exec", self.netns(i)]
            dev = self.ifname(i)
            _run([*inside, "tc", "qdisc", "del", "dev", dev, "root"], check=False)
            parent = ["root"]
            if network.rate is not None:
                rate_bps = parse_rate(network.rate)
                burst = max(_TBF_BURST_MIN, int(rate_bps / 8 * 0.004))
                _run(
                    [
                        *inside,
                        "tc",
                        "qdisc",
                        "add",
                        "dev",
                        dev,
                        "root",
                        "handle",
                        "1:",
                        "tbf",
                        "rate",
                        network.rate,
                        "burst",
                        str(burst),
                        "latency",
                        "400ms",
                    ]
                )
                parent = ["parent", "1:1"]
            netem: list[str] = []
            if network.latency:
                netem += ["delay", network.latency]
            if network.loss:
                netem += ["loss", f"{network.loss}%"]
            if netem:
                if not netem_available():
                    raise ClusterError(
                        "--latency and --loss need the kernel's netem qdisc (sch_netem), "
                        "which this kernel does not provide; shape bandwidth only"
                    )
                _run(
                    [
                        *inside,
                        "tc",
                        "qdisc",
                        "add",
                        "dev",
                        dev,
                        *parent,
                        "handle",
                        "10:",
                        "netem",
                        *netem,
                        "limit",
                        "100000",
                    ]
                )
        self._save_state()

    def down(self) -> None:
        """Kill what runs in the namespaces and remove them; a second Ctrl-C waits for it."""
        if not self._up:
            return
        self._up = False
        try:
            if self.emulated:
                with deferred_signals():
                    teardown(self.cid)
        finally:
            if self._signals is not None:
                self._signals.close()
                self._signals = None

    def __enter__(self) -> Cluster:
        return self.up()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.down()

    def _save_state(self) -> None:
        with contextlib.suppress(OSError):
            STATE_DIR.mkdir(parents=True, exist_ok=True)
            state = {
                "cid": self.cid,
                "nodes": self.nodes,
                "network": asdict(self.network),
                "pid": None if self.persistent else os.getpid(),
                "pid_start": None if self.persistent else pid_start_time(os.getpid()),
                "created": time.time(),
                "addresses": [self.address(i) for i in range(self.nodes)],
            }
            (STATE_DIR / f"{self.cid}.json").write_text(json.dumps(state))


def _link_name(link: Link | str | None) -> str:
    name = (os.environ.get(LINK_ENV) or "auto") if link is None else str(link)
    name = name.strip().lower()
    if name not in {k.value for k in Link}:
        raise ValueError(
            f"link {name!r}: expected one of {', '.join(k.value for k in Link)} "
            f"(from --link or {LINK_ENV})"
        )
    return name


@functools.cache
def tc_unavailable() -> str:
    """Why this machine cannot build shaped namespaces ('' when it can).

    Capabilities are not enough: gVisor, for one, grants root but has no veth pairs or
    qdiscs. So a scratch namespace is built with a veth pair and a token bucket on it,
    once per process, and removed.
    """
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "the ip and tc commands are not installed"
    if not has_net_admin():
        return "no CAP_NET_ADMIN (run as root to shape links with tc)"
    ns = f"{_PREFIX}probe{os.getpid()}"
    made = _run(["ip", "netns", "add", ns], check=False)
    if made.returncode != 0:
        return f"cannot create a network namespace ({made.stderr.strip() or 'ip netns add'})"
    try:
        inside = ["ip", "netns", "exec", ns]
        steps = (
            ["ip", "link", "add", "plpa", "type", "veth", "peer", "name", "plpb"],
            ["ip", "link", "set", "plpa", "up"],
            ["tc", "qdisc", "add", "dev", "plpa", "root", "tbf", "rate", "100mbit",
             "burst", str(_TBF_BURST_MIN), "latency", "400ms"],
        )  # fmt: skip
        for cmd in steps:
            done = _run([*inside, *cmd], check=False)
            if done.returncode != 0:
                return f"`{' '.join(cmd)}` fails here ({done.stderr.strip() or 'no reason given'})"
        return ""
    finally:
        _run(["ip", "netns", "del", ns], check=False)


@functools.cache
def netem_available() -> bool:
    """Whether this kernel offers netem (delay, loss); tried in a scratch namespace."""
    if not has_net_admin():
        return False
    ns = f"{_PREFIX}probe-{os.getpid()}"
    if _run(["ip", "netns", "add", ns], check=False).returncode != 0:
        return False
    try:
        inside = ["ip", "netns", "exec", ns]
        _run([*inside, "ip", "link", "set", "lo", "up"], check=False)
        add = [*inside, "tc", "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"]
        return _run(add, check=False).returncode == 0
    finally:
        _run(["ip", "netns", "del", ns], check=False)


def node_octet(node: int, nodes: int) -> int:
    """The last octet of `node`'s address in a cluster of `nodes` nodes.

    Chosen so that the addresses' strings sort in node order: 1..9 for small clusters,
    100..254 (all three digits) up to 155 nodes, else the octets in string order.
    """
    if nodes <= 9:
        return node + 1
    if nodes <= 155:
        return 100 + node
    return sorted(range(1, 255), key=str)[node]


def namespace_pids(ns: str) -> list[int]:
    """Processes whose network namespace is `ns` (`ip netns pids`)."""
    out = _run(["ip", "netns", "pids", ns], check=False).stdout
    return [int(p) for p in out.split() if p.isdigit()]


def kill_namespace(ns: str) -> list[int]:
    """SIGKILL every process in namespace `ns` and wait (briefly) until none is left.

    A namespace deleted with processes inside lives on, unnamed, with them: agents and
    workers of a crashed job would run on invisibly.
    """
    killed: list[int] = []
    end = time.monotonic() + _KILL_WAIT_S
    while True:
        pids = [p for p in namespace_pids(ns) if p != os.getpid()]
        if not pids:
            return killed
        if time.monotonic() > end:
            logger.warning("processes %s in %s survived SIGKILL", pids, ns)
            return killed
        for pid in pids:
            kill_quietly(pid)
        killed += [p for p in pids if p not in killed]
        time.sleep(0.05)


def teardown(cid: str) -> None:
    """Kill the processes of cluster `cid` and remove its namespaces, links and state file
    (idempotent)."""
    for ns in _namespaces():
        if ns.startswith(f"{_PREFIX}{cid}-"):
            kill_namespace(ns)
            _run(["ip", "netns", "del", ns], check=False)
    _run(["ip", "link", "del", f"plb{cid}"], check=False)
    for link in _links():
        if link.startswith(f"plp{cid}"):
            _run(["ip", "link", "del", link], check=False)
    with contextlib.suppress(OSError):
        (STATE_DIR / f"{cid}.json").unlink()


def _namespaces() -> list[str]:
    out = _run(["ip", "netns", "list"], check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _links() -> list[str]:
    out = _run(["ip", "-o", "link", "show"], check=False).stdout
    names = []
    for line in out.splitlines():
        parts = line.split(":")
        if len(parts) > 1:
            names.append(parts[1].strip().split("@")[0])
    return names


def list_clusters() -> list[dict[str, object]]:
    """Clusters present on this machine: from state files, plus leftovers found by name."""
    found: dict[str, dict[str, object]] = {}
    if STATE_DIR.is_dir():
        for path in STATE_DIR.glob("*.json"):
            with contextlib.suppress(OSError, ValueError):
                state = json.loads(path.read_text())
                found[str(state["cid"])] = state
    if has_net_admin():
        for ns in _namespaces():
            if ns.startswith(_PREFIX):
                cid = ns[len(_PREFIX) :].split("-")[0]
                found.setdefault(cid, {"cid": cid, "leftover": True})
        for link in _links():
            if link.startswith("plb") and len(link) == 9:
                found.setdefault(link[3:], {"cid": link[3:], "leftover": True})
    names = _namespaces() if found else []
    for state in found.values():
        pid, start = state.get("pid"), state.get("pid_start")
        mine = [ns for ns in names if ns.startswith(f"{_PREFIX}{state['cid']}-")]
        if state.get("leftover"):
            # no state file here (another PLAIT_STATE_DIR, or a write that failed): its
            # owner is unknown, so a process inside its namespaces means a job runs there
            state["alive"] = any(namespace_pids(ns) for ns in mine)
        else:
            state["alive"] = isinstance(pid, int) and process_alive(
                pid, start if isinstance(start, int) else None
            )
        state["namespaces"] = len(mine)
    return list(found.values())


def teardown_all(*, only_dead: bool = True) -> list[str]:
    """Remove plait clusters: leftovers and persistent ones, or all with ``only_dead=False``.

    A cluster whose owning process still runs is in use by a job; it is kept unless
    `only_dead` is False. So is a leftover (namespaces without a state file) with processes
    inside: its job's state may live in another state folder (`plait cluster down` once
    removed such a cluster under a running job, which died 3.5 s later).
    """
    removed = []
    for state in list_clusters():
        if only_dead and state.get("alive"):
            continue
        teardown(str(state["cid"]))
        removed.append(str(state["cid"]))
    return removed


def reap_dead() -> list[str]:
    """Remove the clusters whose owning process died (a ``kill -9`` of a job), nothing else.

    Unlike `teardown_all`, persistent clusters (`plait cluster up`) and namespaces without a
    state file (perhaps another state directory's) are left alone: only a cluster whose
    state names an owner that is gone is certainly abandoned. Every command that builds a
    cluster calls this first.
    """
    removed: list[str] = []
    if not STATE_DIR.is_dir():
        return removed
    for path in STATE_DIR.glob("*.json"):
        try:
            state = json.loads(path.read_text())
            cid, pid = str(state["cid"]), state.get("pid")
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if not isinstance(pid, int):
            continue
        start = state.get("pid_start")
        if process_alive(pid, start if isinstance(start, int) else None):
            continue
        logger.warning("removing cluster %s: its owner (pid %d) is gone", cid, pid)
        teardown(cid)
        removed.append(cid)
    return removed
