"""Communication core: counted collectives, an ordered queue, fusion planners, a cost model."""

from __future__ import annotations

from plait.comm.backends import check_collectives, unsupported
from plait.comm.cost import AlphaBeta, CollectiveCosts
from plait.comm.fusion import (
    FusionItem,
    FusionPlanner,
    ReadyTimePlanner,
    ThresholdPlanner,
    bucket_sizes,
)
from plait.comm.ops import (
    CollectiveError,
    all_gather,
    all_gather_object,
    all_reduce,
    all_to_all,
    barrier,
    broadcast,
    broadcast_object,
    reduce_floats,
    reduce_scatter,
    wait,
    world_size,
)
from plait.comm.queue import CollectiveQueue
from plait.comm.stats import Collective, CollectiveRecord, CommStats, stats, wire_bytes

__all__ = [
    "AlphaBeta",
    "Collective",
    "CollectiveCosts",
    "CollectiveError",
    "CollectiveQueue",
    "CollectiveRecord",
    "CommStats",
    "FusionItem",
    "FusionPlanner",
    "ReadyTimePlanner",
    "ThresholdPlanner",
    "all_gather",
    "all_gather_object",
    "all_reduce",
    "all_to_all",
    "barrier",
    "broadcast",
    "broadcast_object",
    "bucket_sizes",
    "check_collectives",
    "reduce_floats",
    "reduce_scatter",
    "stats",
    "unsupported",
    "wait",
    "wire_bytes",
    "world_size",
]
