"""The emulated multi-node cluster: namespaces, shaped links, one torchrun per node."""

from __future__ import annotations

from plait.cluster.launch import LaunchResult, free_port, launch
from plait.cluster.netns import (
    Cluster,
    ClusterError,
    Link,
    has_net_admin,
    list_clusters,
    reap_dead,
    tc_unavailable,
    teardown_all,
)
from plait.cluster.network import NAMED_RATES, NetworkSpec, parse_rate, resolve_bandwidth

__all__ = [
    "NAMED_RATES",
    "Cluster",
    "ClusterError",
    "LaunchResult",
    "Link",
    "NetworkSpec",
    "free_port",
    "has_net_admin",
    "launch",
    "list_clusters",
    "parse_rate",
    "reap_dead",
    "resolve_bandwidth",
    "tc_unavailable",
    "teardown_all",
]
